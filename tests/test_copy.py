"""Copying, pickling and saving sparse layers on the CPU: caches the layers keep (lean launch
plans, with driver handles a copy could not use) are left out, and the copy computes what
the original does. The GPU runs of the same in every mode are in tests/test_gpu_copy.py."""
import copy
import ctypes
import io

import pytest
import torch
from torch import nn

import sparsegen
from copy_cases import LAYER_KINDS, make_layer


def plant_unpicklable_caches(model: nn.Module) -> None:
    """What a GPU run leaves in a layer's lean cache: launch plans holding ctypes pointers."""
    for module in model.modules():
        if hasattr(module, "_lean_forward"):
            module.__dict__["_lean_calls"] = {"signature": ctypes.pointer(ctypes.c_int(3))}


def copies(model):
    """The three copies users make: deepcopy, torch.save/torch.load of the model, dense_copy."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return {"deepcopy": copy.deepcopy(model), "torch.save": torch.load(buffer, weights_only=False),
            "dense_copy": sparsegen.dense_copy(model)}


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_a_layer_that_ran_copies_and_saves(kind):
    layer = make_layer(kind)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer(x).double()
    plant_unpicklable_caches(layer)
    for how, twin in copies(layer).items():
        assert not any("_lean_calls" in m.__dict__ for m in twin.modules()), how
        with torch.no_grad():
            got = twin(x).double()
        # dense_copy of a one-byte layer skips the layer's quantization of x: e4m3's 3-bit steps;
        # of a gated MLP it is the model's own MLP again, rounding act(gate) and the product
        # apart (bf16 ulps) where the fused reference rounds once
        bound = (0.08 if kind.startswith("scaled") else 1e-2 if kind == "gated-mlp" else 0.0) if how == "dense_copy" else 0.0
        assert (got - want).norm() <= bound * want.norm(), how
    lean = [m for m in layer.modules() if hasattr(m, "_lean_forward")]
    assert all("_lean_calls" in m.__dict__ for m in lean)  # (the original keeps its cache)


@pytest.mark.parametrize("kind", ["scaled-e4m3", "scaled-int8"])
def test_dense_copy_turns_one_byte_layers_into_linears_of_their_dequantized_weight(kind):
    model = nn.Sequential(make_layer(kind), nn.LayerNorm(192, dtype=torch.float16))
    twin = sparsegen.dense_copy(model)
    assert type(twin[0]) is nn.Linear and twin[0].weight.dtype == torch.float16  # (the model's dtype)
    assert torch.equal(twin[0].weight.float(), model[0].to_dense_weight().half().float())
    assert torch.equal(twin[0].bias, model[0].bias.half())
    assert (twin[0].weight != 0).sum() == twin[0].weight.numel() // 2  # 2:4: half kept
