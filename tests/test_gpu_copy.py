"""Copy, pickle and save every layer type after it ran on the GPU in eager mode, under
torch.compile and inside a CUDA graph: deepcopy, torch.save/torch.load and dense_copy work,
and each copy runs and gives the original's output (pytest -m gpu)."""
import copy
import io

import pytest
import torch

import sparsegen
from copy_cases import LAYER_KINDS, make_layer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def run_eager(layer, x):
    return layer(x)


def run_compiled(layer, x):
    torch._dynamo.reset()
    return torch.compile(layer)(x)


def run_graphed(layer, x):
    layer(x)  # warm-up: kernels loaded, plans made
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    graph.replay()
    return y


MODES = {"eager": run_eager, "compile": run_compiled, "graph": run_graphed}


def saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_a_layer_copies_and_saves_after_it_ran(kind, mode):
    if kind == "scaled-e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs an sm_89 or newer GPU")
    layer = make_layer(kind, device="cuda").eval()
    x = torch.randn(37, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        MODES[mode](layer, x)
        want = layer(x).double()
        for how, twin in {"deepcopy": copy.deepcopy(layer), "torch.save": saved_and_loaded(layer),
                          "dense_copy": sparsegen.dense_copy(layer)}.items():
            got = twin(x).double()
            # (dense_copy: cuBLAS's rounding, and no quantization of x for the one-byte layers)
            bound = 0.08 if how == "dense_copy" and kind.startswith("scaled") else 2e-2 if how == "dense_copy" else 1e-3
            assert ((got - want).norm() / want.norm()).item() <= bound, (how, mode)
            got_graph = run_graphed(twin, x).double()  # the copy captures graphs of its own
            assert ((got_graph - want).norm() / want.norm()).item() <= max(bound, 2e-2), (how, mode)
