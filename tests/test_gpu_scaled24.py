"""ScaledSparse24Linear on the GPU: the generated one-byte 2:4 kernels (e4m3 on sm_89+,
int8 on sm_80+) with the layer's per-token quantization, against the float64 product of the
same quantized operands (tests/test_scaled24.py's reference), eagerly, compiled and graphed."""
import pytest
import torch
from torch import nn

import sparsegen
from sparsegen.jit import epilogues
from sparsegen.semi24 import ops, scaled
from sparsegen.semi24.scaled import quantize, row_scales, scaled_reference
from test_scaled24 import reference, relative_error

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

ARCH = torch.cuda.get_device_capability()
WEIGHT_DTYPES = ["int8"] + (["e4m3"] if ARCH >= (8, 9) else [])
WEIGHT_DTYPES_BY_NAME = {"int8": torch.int8, "e4m3": torch.float8_e4m3fn}


def scaled_operands(m, k, n, weight_dtype, bias_dtype=None):
    """Fresh one-byte operands and float32 scales of a scaled 2:4 product, on the GPU."""
    linear = nn.Linear(k, n, bias=bias_dtype is not None, device="cuda", dtype=bias_dtype or torch.bfloat16)
    layer = sparsegen.ScaledSparse24Linear.from_dense(linear, weight_dtype)
    x = torch.randn(m, k, device="cuda") * 2
    x_scale = row_scales(x, layer.values.dtype) * torch.rand(m, device="cuda").add(0.5)  # not only amax-derived
    return quantize(x, x_scale, layer.values.dtype), layer, x_scale


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("m, k, n, splits, instr", [
    (1, 4096, 1024, None, None), (7, 640, 336, None, None), (7, 1024, 464, 4, None),  # decode: K split
    (77, 1024, 2048, None, None), (333, 512, 1040, None, None), (4133, 256, 208, None, None),
    (45, 512, 272, None, "mma")])  # mma.sp on Hopper too (int8 only: sm_90 has no fp8 mma.sync)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "swiglu"])
def test_scaled_kernel_applies_scales_bias_and_epilogue(weight_dtype, m, k, n, splits, instr, out_dtype, epilogue):
    """The kernel's epilogue: x_scale[t] w_scale[f] sum + bias[f], then the activation, rounded
    once into Y - against float64, Y poisoned first."""
    if instr == "mma" and weight_dtype == "e4m3" and ARCH >= (9, 0):
        pytest.skip("e4m3 runs on wgmma.sp alone on sm_90")
    xq, layer, x_scale = scaled_operands(m, k, n, weight_dtype, out_dtype)
    out = torch.full((m, epilogues.output_features(epilogue, n)), float("nan"), device="cuda", dtype=out_dtype)
    ops.sp24_scaled_dds(xq, layer.values, layer.metadata, x_scale, layer.weight_scale, layer.bias, n, out_dtype,
                        out=out, splits=splits, instr=instr, epilogue=epilogue)
    want = scaled_reference(xq, layer.values, layer.metadata, x_scale, layer.weight_scale, layer.bias, epilogue)
    assert not out.isnan().any()
    assert relative_error(out, want) < 5e-3


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, n", [(64, 16), (4160, 48), (17920, 32)])
def test_from_dense_on_the_gpu_gives_the_cpu_conversions_bytes_and_scales(weight_dtype, dtype, k, n):
    """The GPU's conversion (pruning kernel, then sp24_quantize on the kept values) against the
    CPU's PyTorch ops on the same weight: the same kept bytes, scales and metadata; an all-zero
    row and an outlier included."""
    linear = nn.Linear(k, n, dtype=dtype)
    with torch.no_grad():
        linear.weight.mul_(torch.rand(n, 1) * 10)
        linear.weight[1] = 0.0
        linear.weight[2, 5] = 300.0
    on_cpu = sparsegen.ScaledSparse24Linear.from_dense(linear, weight_dtype)
    torch.full((n, k), float("nan"), device="cuda")  # freed: the outputs' memory next
    on_gpu = sparsegen.ScaledSparse24Linear.from_dense(linear.cuda(), weight_dtype)
    assert torch.equal(on_gpu.values.view(torch.uint8).cpu(), on_cpu.values.view(torch.uint8))
    assert torch.equal(on_gpu.weight_scale.cpu(), on_cpu.weight_scale)
    assert torch.equal(on_gpu.metadata.cpu(), on_cpu.metadata)


def gpu_layer(k, n, weight_dtype, dtype=torch.bfloat16, **kw):
    linear = nn.Linear(k, n, dtype=dtype, device="cuda")
    return sparsegen.ScaledSparse24Linear.from_dense(linear, weight_dtype, **kw)


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 4096, 1024), (7, 640, 336), (133, 1024, 2048), (4133, 512, 1040)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_forward_matches_float64(weight_dtype, m, k, n, dtype):
    layer = gpu_layer(k, n, weight_dtype, dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype) * 2
    y = layer(x)
    assert y.dtype == dtype and not y.isnan().any()
    assert relative_error(y, reference(layer, x)) < 1e-2


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_static_scale_and_batch_dims(weight_dtype):
    layer = gpu_layer(1024, 512, weight_dtype, input_scale=0.02)
    x = torch.randn(3, 5, 1024, device="cuda", dtype=torch.bfloat16)
    assert relative_error(layer(x), reference(layer, x)) < 1e-2


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_and_graphed_match_eager(weight_dtype, mode):
    model = nn.Sequential(nn.Linear(1024, 2048), nn.SiLU(), nn.Linear(2048, 1024)).to("cuda", torch.bfloat16)
    sparsegen.patch(model, {r"\d": {"sparsity": "2:4", "weight_dtype": weight_dtype}})
    compiled = torch.compile(model, mode=mode)
    for m in (8, 8, 64, 8):  # replays, a new shape, a replay again
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        eager = model(x)
        got = compiled(x).clone()
        assert relative_error(got, eager.double()) < 2e-2


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_compiled_layer_quantizes_a_graph_input_as_eager_mode_does(weight_dtype, static):
    """X straight from the graph's input: the compiled launcher's planned sp24_quantize gives
    eager mode's bytes, so the same output bit for bit, over shapes and poisoned memory."""
    layer = gpu_layer(1024, 512, weight_dtype, input_scale=0.02 if static else None)
    compiled = torch.compile(layer)
    for m in (8, 3, 8, 64):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        torch.full((8 * m, 1024), float("nan"), device="cuda")  # freed: the buffers' memory next
        with torch.no_grad():
            assert torch.equal(compiled(x), layer(x))


def test_checkpoint_layers_run_on_the_gpu(tmp_path):
    """A loaded FP8 checkpoint (tests/test_compressed.py builds it) moved to the GPU."""
    from test_compressed import checkpoint, decompressed, logits, tiny_llama
    kind = "fp8" if ARCH >= (8, 9) else "int8"
    folder = checkpoint(tmp_path, kind)
    model = tiny_llama(2)
    sparsegen.load_compressed(model, folder)
    ids = torch.randint(0, 311, (2, 40))
    cpu = logits(model, ids)
    gpu = logits(model.cuda(), ids.cuda()).cpu()
    # float32 sums (GPU) against float64 ones (CPU), then each layer's activations quantized
    # again: an element across an e4m3 rounding step (3 mantissa bits) moves by 1/16
    assert relative_error(gpu, cpu) < (5e-2 if kind == "fp8" else 2e-2)
    dense = logits(decompressed(folder), ids)
    assert relative_error(gpu, dense) < 0.1


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, k", [(1, 64), (7, 4160), (333, 192), (2048, 14336)])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_kernel_gives_pytorchs_bytes_and_scales(weight_dtype, dtype, m, k, static):
    """sp24_quantize (eager mode's one pass) against scaled.py's PyTorch ops on the same GPU:
    the same scales and bytes, outliers saturating, all-zero rows; outputs poisoned first."""
    byte = WEIGHT_DTYPES_BY_NAME[weight_dtype]
    x = torch.randn(m, k, device="cuda").mul_(torch.rand(m, 1, device="cuda") * 10).to(dtype)
    x[0, -1] = 300.0  # one outlier: its row's scale, and past the static scale's range
    x[m // 2] = 0.0
    fixed = torch.tensor(0.03, device="cuda") if static else None
    torch.full((m, k + 4), float("nan"), device="cuda", dtype=torch.float32)  # freed: the outputs' memory next
    xq, scales = ops.sp24_quantize(x, byte, fixed)
    want_scales = fixed.expand(m) if static else row_scales(x, byte)
    assert torch.equal(scales, want_scales)
    assert torch.equal(xq.view(torch.uint8), quantize(x, want_scales, byte).view(torch.uint8))


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("mode", ["eager", "default", "reduce-overhead"])
def test_patched_gated_mlp_runs_fused_in_every_mode(weight_dtype, mode):
    """A Llama MLP patched with one-byte weights: gate and up as one scaled layer with the
    swiglu epilogue, eagerly and compiled and graphed (Inductor's quantization in its norm or
    copy kernels, the launcher's sp24_quantize after an extern kernel), against the same model
    unfused."""
    from test_scaled24 import GatedMLP
    fused = nn.Sequential(GatedMLP(1024, 2048)).to("cuda", torch.bfloat16)
    unfused = nn.Sequential(GatedMLP(1024, 2048)).to("cuda", torch.bfloat16)
    unfused.load_state_dict(fused.state_dict())
    rule = {r".*proj": {"sparsity": "2:4", "weight_dtype": weight_dtype}}
    sparsegen.patch(fused, rule)
    sparsegen.patch(unfused, rule, fuse=False)
    assert fused[0].gate_up.epilogue == "swiglu"
    run = fused if mode == "eager" else torch.compile(fused, mode=mode)
    for m in (5, 5, 64):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        got = run(x).clone()
        assert relative_error(got, unfused(x).double()) < (5e-2 if weight_dtype == "e4m3" else 2e-2)


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("mode", ["eager", "default"])
def test_input_gradient_on_the_gpu_matches_the_cpu(weight_dtype, mode):
    """A training step around a frozen scaled layer (swiglu fused): x's straight-through
    gradient from the GPU kernels against the CPU's float64 path."""
    layer = gpu_layer(1024, 512, weight_dtype).fuse("swiglu")
    x = torch.randn(37, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
    run = layer if mode == "eager" else torch.compile(layer)
    run(x).backward(dy)
    cpu_x = x.detach().cpu().requires_grad_()
    layer.cpu()(cpu_x).backward(dy.cpu())
    assert relative_error(x.grad.cpu(), cpu_x.grad.double()) < 5e-2


QUANTIZING = ARCH == (9, 0)  # Hopper's wgmma.sp kernels quantize X themselves (a few tokens)


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, k, n", [(1, 4096, 1024), (5, 192, 48), (8, 14336, 4096), (16, 640, 336),
                                     (13, 4160, 208), (17, 1024, 464)])
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
@pytest.mark.parametrize("static", [False, True])
def test_quantizing_product_gives_the_two_launch_result_bit_for_bit(weight_dtype, dtype, m, k, n, epilogue, static):
    """A decode step's product that quantizes X itself: the bytes and scales of sp24_quantize,
    so the same Y as sp24_quantize then sp24_scaled_dds, bit for bit, and float64's within
    rounding; an outlier, an all-zero row, Y poisoned first. Elsewhere than on Hopper the
    layer keeps the two launches."""
    layer = gpu_layer(k, n, weight_dtype, dtype, input_scale=0.03 if static else None)
    x = torch.randn(m, k, device="cuda").mul_(torch.rand(m, 1, device="cuda") * 10).to(dtype)
    x[0, -1] = 300.0
    x[m // 2 if m > 1 else 0, : k // 2] = 0.0
    values, metadata, w_scale = layer.values, layer.metadata, layer.weight_scale
    quantizing = QUANTIZING and m <= ops.QUANTIZING_ROWS
    assert ops.quantizes_in_product(x, values, metadata) == quantizing
    xq, x_scale = ops.sp24_quantize(x, values.dtype, layer.input_scale)
    two = ops.sp24_scaled_dds(xq, values, metadata, x_scale, w_scale, layer.bias, n, dtype, epilogue=epilogue)
    assert torch.equal(scaled.scaled_linear(x, values, metadata, w_scale, layer.bias, layer.input_scale, epilogue,
                                            dtype), two)
    out = torch.full_like(two, float("nan"))
    if quantizing:
        ops.sp24_quantized_dds(x, values, metadata, w_scale, layer.bias, layer.input_scale, n, epilogue, out=out)
        assert torch.equal(out, two)
    out = two
    want = scaled_reference(xq, values, metadata, x_scale, w_scale, layer.bias, epilogue)
    assert relative_error(out, want) < 5e-3


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_compiled_decode_layer_is_one_launch(weight_dtype):
    """Under plain torch.compile a decode step's one-byte layer whose X comes from outside the
    graph's kernels runs one kernel (Hopper: it quantizes X itself), and gives eager's Y."""
    layer = gpu_layer(2048, 1024, weight_dtype)
    compiled = torch.compile(layer)
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        compiled(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y = compiled(x)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert torch.equal(y, layer(x))
    quantizing = [name for name in kernels if "_xquantize1" in name]
    assert (len(quantizing), len(kernels)) == ((1, 1) if QUANTIZING else (0, 2)), kernels


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("epilogue, static", [("none", None), ("swiglu", None), ("none", 0.03)])
def test_eager_calls_give_the_checked_paths_bytes(weight_dtype, dtype, epilogue, static):
    """An eager call takes the lean path (scaled_lean.py: its signature planned once; one launch
    up to QUANTIZING_ROWS tokens, then quantize and product) where its input allows, the compiled
    graphs' launcher (ScaledSparse24Linear._launched) for a strided input or one 2 bytes off
    alignment: at token counts on both sides of QUANTIZING_ROWS, repeated with inputs at new
    addresses, Y has the bytes the checked path (scaled_product) gives and is near the float64
    product. A float32 input, refused by both, still runs (the checked path)."""
    layer = gpu_layer(640, 336, weight_dtype, dtype, input_scale=static)
    if epilogue != "none":
        layer.fuse(epilogue)
    paths = traced_paths(layer)
    base = torch.randn(80 * 641 + 1, device="cuda", dtype=dtype)
    inputs = [torch.randn(m, 640, device="cuda", dtype=dtype) * 2 for m in (1, 16, 17, 33, 64, 16, 1)]
    inputs += [torch.randn(3, 11, 640, device="cuda", dtype=dtype)]
    odd = [torch.randn(640, 24, device="cuda", dtype=dtype).t(),  # strided
           base[1:1 + 24 * 640].view(24, 640)]                    # 2 bytes past an aligned start
    for x in inputs + odd:
        with torch.no_grad():
            y = layer(x)
        assert torch.equal(y, checked(layer, x)), (tuple(x.shape), x.stride())
        assert relative_error(y, reference(layer, x)) < 2e-2
    assert paths == ["lean"] * len(inputs) + ["launcher"] * len(odd)
    paths.clear()
    with torch.no_grad():
        y = layer(inputs[0].float())
    assert paths == [] and y.dtype == torch.float32


def traced_paths(layer) -> list:
    """The paths the layer's calls take from now ("lean", "launcher"), in order."""
    paths = []

    def traced(name, fn):
        def call(x):
            y = fn(x)
            if y is not None:
                paths.append(name)
            return y
        return call
    layer._lean_forward = traced("lean", layer._lean_forward)
    layer._launched = traced("launcher", layer._launched)
    return paths


def checked(layer, x):
    return scaled.scaled_product(x, layer.values, layer.metadata, layer.weight_scale, layer.bias,
                                 layer.input_scale, layer.epilogue)


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("m", [4, 40])
@torch.no_grad()
def test_lean_calls_read_the_scales_the_layer_holds_now(weight_dtype, m):
    """A planned signature's calls use the scales as they are at the call: changed in place,
    reassigned, or loaded from a state_dict; and the values a load brings."""
    layer = gpu_layer(640, 336, weight_dtype, input_scale=0.03)
    paths = traced_paths(layer)
    x = torch.randn(m, 640, device="cuda", dtype=torch.bfloat16)
    layer(x)
    layer.input_scale.fill_(0.05)
    assert torch.equal(layer(x), checked(layer, x))
    layer.weight_scale = layer.weight_scale * 2
    assert torch.equal(layer(x), checked(layer, x))
    other = gpu_layer(640, 336, weight_dtype, input_scale=0.02)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer(x), checked(other, x))
    assert paths == ["lean"] * 4
