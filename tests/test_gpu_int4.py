"""Int4Sparse24Linear on the GPU: the generated sp24_w4 kernels (mma.sp, values dequantized in
registers) against a float64 product of the dequantized weight, Y poisoned first; the layer
eager, compiled, in CUDA graphs and patched into a transformers model."""
import pytest
import torch
from torch import nn

import sparsegen
from sparsegen.jit import epilogues
from sparsegen.semi24 import int4, int4_nn
from sparsegen.semi24.int4_nn import (PREFILL_ROWS, Int4Sparse24Linear, prefill_on_16_bit, sp24_w4, w4_reference,
                                      w4_values)
from sparsegen.jit.spec import TileConfig

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)


def relative_error(got, want) -> float:
    return float((got.detach().double() - want).norm() / want.norm())


def layer_of(k: int, n: int, dtype, group_size=128, bias=True) -> Int4Sparse24Linear:
    linear = nn.Linear(k, n, bias=bias, device="cuda", dtype=dtype)
    with torch.no_grad():  # outlier rows and a zero row: scales far apart
        linear.weight[1] *= 40
        linear.weight[2] = 0
    return Int4Sparse24Linear.from_dense(linear, group_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, k, n, splits, tile, kwarps", [
    (1, 4096, 1024, None, None, None), (7, 640, 336, None, None, None), (5, 1024, 464, 4, None, None),  # K split
    (33, 4096, 2048, None, None, None), (77, 1152, 2048, None, None, None), (333, 512, 1040, None, None, None),
    (2049, 768, 208, None, None, None), (45, 512, 272, None, TileConfig(64, 1, 2, 2), None),
    # k-warps: a stage's instruction steps shared by 2 warps (odd stage counts: 5, 7, 9), with and without splits
    (3, 640, 336, 2, TileConfig(16, 4, 1, 6), 2), (13, 1152, 464, None, TileConfig(16, 2, 1, 6), 2),
    (29, 896, 272, 3, TileConfig(32, 4, 1, 4), 2), (60, 640, 400, None, TileConfig(64, 2, 2, 4), 2),
    # 8-token decode tiles (the probe's), with and without k-warps and splits
    (1, 4096, 1024, None, TileConfig(8, 4, 1, 6), None), (7, 1152, 464, 3, TileConfig(8, 2, 1, 8), 2),
    (5, 640, 336, None, TileConfig(8, 4, 1, 5), 2)])
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("epilogue", ["none", "gelu_tanh", "swiglu"])
def test_kernel_dequantizes_and_applies_bias_and_epilogue(dtype, m, k, n, splits, tile, kwarps, group_size, epilogue):
    layer = layer_of(k, n, dtype, group_size)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    out = torch.full((m, epilogues.output_features(epilogue, n)), float("nan"), device="cuda", dtype=dtype)
    sp24_w4(x, layer.qweight, layer.metadata, layer.scales, layer.bias, layer.group_size, n, epilogue,
            out=out, splits=splits, tile=tile, kwarps=kwarps)
    want = w4_reference(x, layer.qweight, layer.metadata, layer.scales, layer.bias, layer.group_size, epilogue)
    assert not out.isnan().any()
    assert relative_error(out, want) < 5e-3


def test_dequantized_values_are_exact_bit_for_bit():
    """One-hot inputs pick single columns of W: Y is then each dequantized weight itself
    (one product, no sum), so the kernel's in-register dequantization must equal
    int4.dequantize exactly, for both 16-bit types."""
    for dtype in (torch.bfloat16, torch.float16):
        layer = layer_of(256, 64, dtype, bias=False)
        x = torch.eye(256, device="cuda", dtype=dtype)[:64 * 4:4].contiguous()
        y = layer(x)
        assert torch.equal(y, layer.to_dense_weight()[:, :64 * 4:4].t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [128, -1])
def test_values_for_the_16_bit_kernels_are_the_dequantized_ones_bit_for_bit(dtype, group_size):
    layer = layer_of(1152, 336, dtype, group_size)
    want = int4.dequantize(int4.unpack(layer.qweight), layer.scales, layer.group_size)
    assert torch.equal(w4_values(layer.qweight, layer.scales, layer.group_size), want)


def test_prefill_takes_the_16_bit_kernel_on_hopper_and_the_4_bit_one_elsewhere():
    layer = layer_of(512, 256, torch.bfloat16)
    x = torch.randn(PREFILL_ROWS + 1, 512, device="cuda", dtype=torch.bfloat16)
    assert prefill_on_16_bit(x.shape[0], 0) == (torch.cuda.get_device_capability() >= (9, 0))
    assert not prefill_on_16_bit(PREFILL_ROWS, 0)
    want = w4_reference(x, layer.qweight, layer.metadata, layer.scales, layer.bias, layer.group_size, "none")
    by_tile = sp24_w4(x, layer.qweight, layer.metadata, layer.scales, layer.bias, layer.group_size, 256,
                      tile=TileConfig(64, 2, 2, 2))  # (a tile given: the 4-bit kernel whatever the arch)
    assert relative_error(layer(x), want) < 5e-3 and relative_error(by_tile, want) < 5e-3


@pytest.mark.parametrize("mode", ["compile", "reduce-overhead"])
def test_compiled_and_graphed_layers_give_the_eager_output(mode):
    model = nn.Sequential(layer_of(512, 256, torch.bfloat16), nn.GELU(), layer_of(256, 128, torch.bfloat16))
    compiled = torch.compile(model, mode=None if mode == "compile" else mode, fullgraph=True)
    for m in (1, 9, 1, 9, 160):  # fresh inputs each call; graphs replayed; 160: Hopper's prefill route
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(compiled(x).clone(), model(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 77, 128])
@pytest.mark.parametrize("k, widths, group_size", [(4096, (1024, 256, 256), 128), (640, (512, 128), 128),
                                                    (896, (256, 128, 384), -1), (1024, (8192, 512, 512), 128)])
def test_grouped_launch_writes_each_weights_columns(dtype, m, k, widths, group_size):
    """One sp24_w4 launch over 2-3 weights of one X (a compiled graph's q, k and v): Y's columns
    weight after weight, each against float64 of its own dequantized weight, Y poisoned first."""
    layers = [layer_of(k, n, dtype, group_size, bias=False) for n in widths]
    weights = [(layer.qweight, layer.metadata, layer.scales) for layer in layers]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    assert int4_nn.w4_group_plan(x, weights, layers[0].group_size) is not None  # (the grouped kernel, no fallback)
    out = torch.full((m, sum(widths)), float("nan"), device="cuda", dtype=dtype)
    int4_nn.sp24_w4_group_into(x, *(t for weight in weights for t in weight), layers[0].group_size, out=out)
    at = 0
    for layer, n in zip(layers, widths):
        want = w4_reference(x, layer.qweight, layer.metadata, layer.scales, None, layer.group_size, "none")
        assert relative_error(out[:, at:at + n], want) < 5e-3, (at, n)
        at += n


def test_grouped_launch_falls_back_where_a_weight_ends_inside_a_tile():
    """A first weight of 144 rows ends inside a 128- or 256-row tile: each product into its columns."""
    layers = [layer_of(512, n, torch.bfloat16, bias=False) for n in (144, 128)]
    weights = [(layer.qweight, layer.metadata, layer.scales) for layer in layers]
    x = torch.randn(9, 512, device="cuda", dtype=torch.bfloat16)
    assert int4_nn.w4_group_plan(x, weights, 128) is None
    out = torch.full((9, 272), float("nan"), device="cuda", dtype=torch.bfloat16)
    int4_nn.sp24_w4_group_into(x, *(t for weight in weights for t in weight), 128, out=out)
    want = torch.cat([w4_reference(x, *w, None, 128, "none") for w in weights], dim=1)
    assert relative_error(out, want) < 5e-3


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_attention_projections_run_as_one_grouped_launch(mode):
    """q, k and v of a norm's output in a compiled graph: one grouped launch (the generated code
    calls it), outputs as eager mode's within the norm's rounding, graphs replayed."""
    from torch._inductor.utils import run_and_get_code

    class Projections(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(1024, device="cuda", dtype=torch.bfloat16)
            self.q, self.k, self.v = (layer_of(1024, n, torch.bfloat16, bias=False) for n in (1024, 256, 256))

        def forward(self, x):
            y = self.norm(x)
            return self.q(y), self.k(y), self.v(y)

    model = Projections()
    torch._dynamo.reset()
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    with torch.no_grad():
        x = torch.randn(2, 1, 1024, device="cuda", dtype=torch.bfloat16)
        got, sources = run_and_get_code(compiled, x)
        assert any("sparsegen_sp24_w4_group(" in source for source in sources), sources
        for tokens in (1, 8, 1, 8):  # (fresh inputs; graphs replayed)
            x = torch.randn(2, tokens, 1024, device="cuda", dtype=torch.bfloat16)
            for out, want in zip(compiled(x), model(x)):
                torch.testing.assert_close(out.clone(), want, atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("mode", ["eager", "default"])
def test_input_gradient_on_the_gpu_matches_the_cpu(mode):
    """A training step around a frozen 4-bit layer (swiglu fused, QLoRA-style): x's gradient
    from the GPU kernels against the CPU's float64 path."""
    layer = layer_of(1024, 512, torch.bfloat16).fuse("swiglu")
    x = torch.randn(37, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
    (layer if mode == "eager" else torch.compile(layer))(x).backward(dy)
    cpu_x = x.detach().cpu().requires_grad_()
    layer.cpu()(cpu_x).backward(dy.cpu())
    assert relative_error(x.grad.cpu(), cpu_x.grad.double()) < 2e-2


def test_a_patched_llama_model_follows_its_dense_copy_and_generates():
    import transformers  # (a test dependency: its absence is an error, not a skip)
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    sparsegen.patch(model, {r"layers\.\d+\.(self_attn|mlp)\.\w+_proj": {"sparsity": "2:4", "weight_dtype": "int4"}})
    assert sum(isinstance(m, Int4Sparse24Linear) for m in model.modules()) == 2 * 6  # gate and up fused
    twin = sparsegen.dense_copy(model)
    ids = torch.randint(0, 1000, (2, 37), device="cuda")
    with torch.no_grad():
        got, want = model(ids).logits, twin(ids).logits
    assert relative_error(got, want.double()) < 2e-2
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 45)


@torch.no_grad()
def test_repeated_calls_take_the_lean_path_and_follow_the_weights(monkeypatch):
    """No-grad calls launch their signature's plan (no sp24_w4 call), Y poisoned first and right
    against float64; in-place new weights are read, a new scales tensor plans again, and float32
    inputs take the checked path."""
    full = []
    real = int4_nn.sp24_w4
    monkeypatch.setattr(int4_nn, "sp24_w4", lambda *a, **k: full.append(1) or real(*a, **k))
    layer, other = layer_of(640, 336, torch.bfloat16), layer_of(640, 336, torch.bfloat16)
    x = torch.randn(3, 5, 640, device="cuda", dtype=torch.bfloat16)

    def error_of_call() -> float:
        want = w4_reference(x.reshape(-1, 640), layer.qweight, layer.metadata, layer.scales, layer.bias,
                            layer.group_size, "none")
        torch.full((3, 5, 336), float("nan"), device="cuda", dtype=torch.bfloat16)  # the allocator's next block
        return relative_error(layer(x).reshape(-1, 336), want)

    layer(x)
    full.clear()
    assert error_of_call() < 5e-3 and not full
    for name in ("qweight", "metadata", "scales"):
        getattr(layer, name).copy_(getattr(other, name))  # in place: the planned addresses hold new weights
    assert error_of_call() < 5e-3 and not full
    layer.scales = other.scales * 2  # a new tensor: planned again (a stale plan would read the old scales)
    assert error_of_call() < 5e-3
    full.clear()
    layer(x.float())
    assert full
