"""Inductor lowerings (sparsegen/inductor.py): a compiled graph calls the launchers itself,
into buffers of its own, and computes what eager mode computes."""
import pytest
import torch
from torch._inductor import config
from torch._inductor.utils import run_and_get_code

import sparsegen


def compiled_code(layer, x):
    """(output, Inductor's generated source) of a fresh compile of layer(x)."""
    torch._dynamo.reset()
    with torch.no_grad(), config.patch(force_disable_caches=True):
        return run_and_get_code(torch.compile(layer, fullgraph=True), x)


def scaled(bias: bool, weight_dtype: str = "e4m3"):
    dense = torch.nn.Linear(128, 48, bias=bias, dtype=torch.bfloat16)
    return sparsegen.ScaledSparse24Linear.from_dense(dense, weight_dtype)


LAYERS = {
    "block-sparse": lambda bias: sparsegen.linear(96, 48, block=(16, 16), density=0.5, bias=bias),
    "2:4": lambda bias: sparsegen.Sparse24Linear(64, 48, bias=bias),
    "scaled-e4m3": lambda bias: scaled(bias),
    "scaled-int8": lambda bias: scaled(bias, "int8"),
}
LAUNCHERS = {"block-sparse": "sparsegen_bsr_dds", "2:4": "sparsegen_sp24_dds", "scaled-e4m3": "sparsegen_sp24_scaled_dds",
             "scaled-int8": "sparsegen_sp24_scaled_dds"}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", LAYERS)
def test_compiled_graph_calls_the_launcher_into_its_own_buffer(kind, bias):
    layer = LAYERS[kind](bias)
    x = torch.randn(3, 5, layer.in_features, dtype=torch.bfloat16 if kind.startswith("scaled") else torch.float32)
    got, (source, *_) = compiled_code(layer, x)
    assert f"extern_kernels.{LAUNCHERS[kind]}{'' if bias else '_no_bias'}(" in source, source
    assert "torch.ops.sparsegen" not in source
    with torch.no_grad():
        torch.testing.assert_close(got, layer(x))


def test_two_layers_in_one_graph_share_buffers_and_match_eager():
    """The second layer reads the first one's output buffer: Inductor orders and keeps it."""
    model = torch.nn.Sequential(sparsegen.linear(96, 64, block=(16, 16), density=0.5), torch.nn.GELU(),
                                sparsegen.Sparse24Linear(64, 32), torch.nn.Linear(32, 16))
    x = torch.randn(7, 96)
    got, (source, *_) = compiled_code(model, x)
    assert source.count("extern_kernels.sparsegen_") == 2
    with torch.no_grad():
        torch.testing.assert_close(got, model(x))


def test_compiled_training_step_still_matches_eager():
    """Forward lowered, backward through the ops: gradients as in eager mode."""
    layer = LAYERS["block-sparse"](True)
    x = torch.randn(4, 96, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(layer)(x).square().sum().backward()
    grads = [x.grad.clone(), layer.values.grad.clone()]
    x.grad = layer.values.grad = None
    layer(x).square().sum().backward()
    torch.testing.assert_close(grads, [x.grad, layer.values.grad])
