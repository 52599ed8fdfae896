"""ScaledSparse24Linear: one-byte 2:4 weights with per-channel scales, activations quantized
per token (or by a static scale), against the float64 product of the same quantized
operands. CPU here; tests/test_gpu_scaled24.py runs the kernels."""
import pytest
import torch
from torch import nn

import sparsegen
from sparsegen.errors import InputError
from sparsegen.jit import epilogues
from sparsegen.semi24 import format as semi24
from sparsegen.semi24.scaled import WEIGHT_DTYPES, quantize, row_scales


def reference(layer, x: torch.Tensor) -> torch.Tensor:
    """float64: x quantized as the layer quantizes it, times the dequantized weight."""
    x2 = x.reshape(-1, x.shape[-1])
    scale = row_scales(x2, layer.values.dtype) if layer.input_scale is None else layer.input_scale
    xq = quantize(x2, scale, layer.values.dtype).double() * (scale.unsqueeze(-1) if scale.dim() else scale).double()
    y = xq @ layer.to_dense_weight().double().t()
    y = epilogues.reference(y if layer.bias is None else y + layer.bias.double(), layer.epilogue)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def relative_error(got, want) -> float:
    return float((got.detach().double() - want).norm() / want.norm())


def make_layer(k=192, n=48, weight_dtype="e4m3", bias=True, dtype=torch.bfloat16, **kw):
    linear = nn.Linear(k, n, bias=bias, dtype=dtype)
    return sparsegen.ScaledSparse24Linear.from_dense(linear, weight_dtype, **kw), linear


@pytest.mark.parametrize("weight_dtype", sorted(WEIGHT_DTYPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5)])
def test_forward_matches_float64(weight_dtype, dtype, shape):
    layer, _ = make_layer(weight_dtype=weight_dtype, dtype=dtype)
    x = torch.randn(*shape, 192, dtype=dtype) * 3
    y = layer(x)
    assert y.dtype == dtype and y.shape == (*shape, 48)
    assert relative_error(y, reference(layer, x)) < 1e-2


@pytest.mark.parametrize("weight_dtype", sorted(WEIGHT_DTYPES))
def test_quantization_error_against_the_bf16_layer_is_small(weight_dtype):
    layer, linear = make_layer(weight_dtype=weight_dtype, bias=False)
    dense = sparsegen.Sparse24Linear.from_dense(linear)
    x = torch.randn(16, 192, dtype=torch.bfloat16)
    want = x.double() @ dense.to_dense_weight().double().t()
    assert relative_error(layer(x), want) < (0.08 if weight_dtype == "e4m3" else 0.03)


def test_static_input_scale_and_saturation():
    layer, _ = make_layer(weight_dtype="int8", input_scale=0.01)
    x = torch.randn(9, 192, dtype=torch.bfloat16)
    x[0, :5] = 100.0  # past 127 * 0.01: saturates, as the reference does
    assert relative_error(layer(x), reference(layer, x)) < 1e-2
    assert "static" in repr(layer)


def test_zero_rows_give_the_bias():
    layer, _ = make_layer()
    y = layer(torch.zeros(2, 192, dtype=torch.bfloat16))
    assert torch.equal(y, layer.bias.to(y.dtype).expand(2, -1))


def test_weights_are_quantized_per_output_channel_after_pruning():
    layer, linear = make_layer(weight_dtype="int8")
    pruned = linear.weight.detach().float() * semi24.magnitude_mask(linear.weight.detach())
    assert torch.allclose(layer.weight_scale, pruned.abs().amax(-1) / 127)
    assert (layer.to_dense_weight() - pruned).abs().max() <= layer.weight_scale.max() / 2 + 1e-7


def test_state_dict_round_trip_and_checked_metadata():
    layer, _ = make_layer()
    twin, _ = make_layer()
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(4, 192, dtype=torch.bfloat16)
    assert torch.equal(twin(x), layer(x))
    bad = layer.state_dict()
    bad["metadata"] = torch.full_like(bad["metadata"], -1)  # 0xF nibbles: no valid selection
    with pytest.raises(InputError, match="metadata"):
        twin.load_state_dict(bad)
    assert torch.equal(twin(x), layer(x))


def test_casting_the_model_keeps_the_stored_bytes_and_scales():
    layer, _ = make_layer(input_scale=0.05)
    values, scale = layer.values.clone(), layer.weight_scale.clone()
    model = nn.Sequential(layer).to(torch.float16)
    assert layer.values.dtype == torch.float8_e4m3fn and torch.equal(layer.values.view(torch.uint8),
                                                                      values.view(torch.uint8))
    assert torch.equal(layer.weight_scale, scale) and layer.input_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.float16
    x = torch.randn(3, 192, dtype=torch.float16)
    assert relative_error(model(x), reference(layer, x)) < 1e-2


def test_factory_and_patch_build_scaled_layers():
    layer = sparsegen.linear(128, 64, sparsity="2:4", weight_dtype="int8", dtype=torch.bfloat16)
    assert isinstance(layer, sparsegen.ScaledSparse24Linear) and layer.values.dtype == torch.int8
    model = nn.Sequential(nn.Linear(128, 64, dtype=torch.bfloat16), nn.ReLU(), nn.Linear(64, 32, dtype=torch.bfloat16))
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    dense = model(x).double()
    assert sparsegen.patch(model, {"0": {"sparsity": "2:4", "weight_dtype": "e4m3"}}) == ["0"]
    assert isinstance(model[0], sparsegen.ScaledSparse24Linear) and type(model[2]) is nn.Linear
    assert relative_error(model(x), dense) < 0.8  # (pruning half the weights moves a random layer this much)


@pytest.mark.parametrize("epilogue", ["relu", "gelu_tanh", "silu", "swiglu", "geglu"])
@pytest.mark.parametrize("weight_dtype", sorted(WEIGHT_DTYPES))
def test_fused_epilogues_match_float64(epilogue, weight_dtype):
    layer, _ = make_layer(weight_dtype=weight_dtype)
    layer.fuse(epilogue)
    x = torch.randn(2, 3, 192, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (2, 3, layer.output_features) and epilogue in repr(layer)
    assert relative_error(y, reference(layer, x)) < 1e-2


class GatedMLP(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden=128, inner=256):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.down_proj, self.act_fn = nn.Linear(inner, hidden, bias=False), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("weight_dtype", sorted(WEIGHT_DTYPES))
def test_patch_fuses_a_gated_mlp_into_one_scaled_layer(weight_dtype):
    """gate and up become one scaled layer with the swiglu epilogue; each projection keeps its
    own per-channel scales, so the fused model computes what the unfused one does."""
    torch.manual_seed(0)
    fused = nn.Sequential(GatedMLP()).to(torch.bfloat16)
    unfused = nn.Sequential(GatedMLP()).to(torch.bfloat16)
    unfused.load_state_dict(fused.state_dict())
    rule = {r".*proj": {"sparsity": "2:4", "weight_dtype": weight_dtype}}
    sparsegen.patch(fused, rule)
    sparsegen.patch(unfused, rule, fuse=False)
    gate_up = fused[0].gate_up
    assert isinstance(gate_up, sparsegen.ScaledSparse24Linear) and gate_up.epilogue == "swiglu"
    assert isinstance(unfused[0].gate_proj, sparsegen.ScaledSparse24Linear)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    # the unfused MLP rounds silu(gate) and the product to bf16 before down_proj quantizes them,
    # the fused epilogue rounds once: an element that lands across an e4m3 rounding step (3
    # mantissa bits) moves by 1/16
    assert relative_error(fused(x), unfused(x).double()) < (5e-2 if weight_dtype == "e4m3" else 2e-2)


@pytest.mark.parametrize("weight_dtype", sorted(WEIGHT_DTYPES))
@pytest.mark.parametrize("bias", [False, True])
def test_gated_layer_keeps_each_projections_bytes_and_scales(weight_dtype, bias):
    gate, _ = make_layer(weight_dtype=weight_dtype, bias=bias)
    up, _ = make_layer(weight_dtype=weight_dtype, bias=bias)
    fused = sparsegen.ScaledSparse24Linear.gated(gate, up)
    assert fused.epilogue == "swiglu" and fused.output_features == 48
    want = epilogues.interleave_rows(gate.to_dense_weight(), up.to_dense_weight())
    assert torch.equal(fused.to_dense_weight(), want)  # the stored bytes, positions and scales
    x = torch.randn(7, 192, dtype=torch.bfloat16)
    g, u = reference(gate, x), reference(up, x)
    assert relative_error(fused(x), torch.nn.functional.silu(g) * u) < 1e-2


@pytest.mark.parametrize("weight_dtype", sorted(WEIGHT_DTYPES))
def test_layers_of_own_parts_pass_the_checks_of_parts_from_outside(weight_dtype):
    """from_dense and gated skip __init__'s checks (their parts are made here): what they make
    must pass them - a layer built by the checking constructor from the same parts is equal."""
    gate, _ = make_layer(k=256, n=32, weight_dtype=weight_dtype, input_scale=0.02)
    up, _ = make_layer(k=256, n=32, weight_dtype=weight_dtype, input_scale=0.02)
    for layer in (gate, sparsegen.ScaledSparse24Linear.gated(gate, up, "geglu_tanh")):
        checked = sparsegen.ScaledSparse24Linear(layer.values, layer.metadata, layer.weight_scale, layer.bias,
                                                 layer.input_scale)
        assert torch.equal(checked.to_dense_weight(), layer.to_dense_weight())
        assert {n: t.dtype for n, t in checked.state_dict().items()} == {n: t.dtype for n, t in layer.state_dict().items()}


def test_gated_layer_refuses_projections_that_differ():
    gate, _ = make_layer(weight_dtype="int8")
    with pytest.raises(InputError, match="gate and up of one shape"):
        sparsegen.ScaledSparse24Linear.gated(gate, make_layer(weight_dtype="e4m3")[0])
    with pytest.raises(InputError, match="gate and up of one shape"):
        sparsegen.ScaledSparse24Linear.gated(gate, make_layer(weight_dtype="int8", input_scale=0.1)[0])


@pytest.mark.parametrize("call, message", [
    (lambda: sparsegen.linear(128, 64, sparsity="2:4", weight_dtype="fp4"), "weight_dtype one of"),
    (lambda: sparsegen.linear(128, 64, weight_dtype="int8"), "sparsity='block' takes: block, density, layout. Got also weight_dtype"),
    (lambda: sparsegen.linear(96, 64, sparsity="2:4", weight_dtype="int8"), "columns of 64"),
    (lambda: make_layer()[0](torch.randn(2, 192, dtype=torch.float64)), "an input in"),
    (lambda: make_layer()[0](torch.randn(2, 190, dtype=torch.bfloat16)), r"input of shape \(\.\.\., 192\)"),
])
def test_bad_input_errors(call, message):
    with pytest.raises(InputError, match=message):
        call()


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "swiglu"])
@pytest.mark.parametrize("weight_dtype", sorted(WEIGHT_DTYPES))
def test_input_gradient_passes_the_quantization_straight_through(epilogue, weight_dtype, mode):
    """Layers around a frozen scaled layer train: x's gradient is dP W (W dequantized, dP the
    epilogue's gradient at the quantized product), the layer's own tensors get none."""
    layer, _ = make_layer(weight_dtype=weight_dtype)
    layer.fuse(epilogue)
    x = torch.randn(2, 5, 192, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 5, layer.output_features, dtype=torch.float64)
    (layer if mode == "eager" else torch.compile(layer, fullgraph=True))(x).backward(dy.to(torch.bfloat16))
    product = reference(make_unfused(layer), x.detach()).requires_grad_()
    d_product, = torch.autograd.grad(epilogues.reference(product, epilogue), product, dy)
    want = d_product @ layer.to_dense_weight().double()
    assert relative_error(x.grad, want) < 2e-2
    assert all(t is None or not t.requires_grad for t in (layer.values, layer.weight_scale, layer.bias))


def make_unfused(layer):
    return sparsegen.ScaledSparse24Linear(layer.values, layer.metadata, layer.weight_scale, layer.bias,
                                          layer.input_scale)


def test_eager_cuda_calls_take_the_compiled_graphs_launcher_with_the_layers_operands(monkeypatch):
    """The lean eager path hands the launcher registered for sp24_scaled_linear x's rows,
    the layer's tensors and a fresh Y of the epilogue's width, and gives Y x's leading dims
    (here a recording launcher computes the reference into Y: this machine has no GPU; the
    GPU suites run the real one). A CPU input never takes it."""
    from sparsegen.jit import registry
    from sparsegen.semi24 import scaled

    layer = sparsegen.ScaledSparse24Linear.from_dense(nn.Linear(64, 48).to(torch.bfloat16), "int8").fuse("swiglu")
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    seen = []

    def launcher(x2, values, metadata, w_scale, bias, input_scale, epilogue, out_dtype, *, out):
        seen.append((tuple(x2.shape), values is layer.values, metadata is layer.metadata, epilogue, out_dtype,
                     tuple(out.shape)))
        out.copy_(scaled._scaled_linear(x2, values, metadata, w_scale, bias, input_scale, epilogue, out_dtype))

    monkeypatch.setitem(registry._LAUNCHERS, "sp24_scaled_linear", launcher)
    assert not scaled._launches_as_compiled(x, layer.values, layer.bias, 64)  # (a CPU input)
    with torch.no_grad():
        want = layer(x)  # the checked path
        assert seen == []
        asked = []
        monkeypatch.setattr(scaled, "_launches_as_compiled", lambda *args: asked.append(args) or True)
        got = layer(x)  # as a CUDA input would
    assert asked == [(x, layer.values, layer.bias, 64)]
    assert seen == [((10, 64), True, True, "swiglu", torch.bfloat16, (10, 24))]
    assert got.shape == (2, 5, 24) and torch.equal(got, want)


def test_the_registered_launcher_of_the_scaled_product_is_compiled_graphs_one():
    from sparsegen.jit import registry
    from sparsegen.semi24 import compiled

    assert registry.launcher("sp24_scaled_linear") is compiled.sp24_scaled_linear_into
