"""2:4 semi-structured kernels on the GPU against float64 references (pytest -m gpu)."""
import pytest
import torch

import sparsegen
from sparsegen.semi24 import tensor as sparse24

from sparsegen.jit.spec import TileConfig
from sparsegen.semi24 import format as semi24
from sparsegen.semi24 import ops as sp24_ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
DTYPES = [torch.bfloat16, torch.float16]


def relative_error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poisoned(m, n, dtype):
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 7, 64, 65, 200, 1000, 2049])
@pytest.mark.parametrize("n, k", [(16, 32), (128, 128), (336, 160), (1024, 4096), (11008, 256)])
@pytest.mark.parametrize("method", ["magnitude", "transposable"])
def test_sp24_forward_matches_float64(dtype, m, n, k, method):
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    sparse = sparsegen.to_sparse24(w, method)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    out = poisoned(m, n, dtype)
    sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, bias, n, out=out)
    want = x.double() @ sparse.to_dense().double().t() + bias.double()
    assert not out.isnan().any()
    assert relative_error(out, want) < TOLERANCE[dtype]


def test_sp24_metadata_layout_element_by_element():
    """One stored element at a time: a weight with a single nonzero reproduces exactly the
    column of X that the metadata names, so a wrong nibble or lane shows up as a wrong
    position, not as a small error."""
    n, k = 16, 32
    torch.manual_seed(0)
    mask = semi24.magnitude_mask(torch.randn(n, k))
    x = torch.eye(k, device="cuda", dtype=torch.bfloat16)  # Y = W^T row by row
    for row in range(n):
        w = torch.zeros(n, k)
        w[row] = torch.arange(1, k + 1, dtype=torch.float32)
        sparse = sparsegen.to_sparse24((w * mask).to("cuda", torch.bfloat16), mask=mask.cuda())
        y = sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, None, n)
        assert torch.equal(y.t()[row].float().cpu(), (w * mask)[row]), f"row {row}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_forward_with_batch_dims_and_one_token(dtype):
    layer = sparsegen.linear(256, 96, sparsity="2:4", device="cuda", dtype=dtype)
    weight = layer.to_dense_weight().double()
    for shape in [(3, 77, 256), (1, 256), (256,)]:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        out = layer(x)
        assert out.shape == (*shape[:-1], 96)
        want = x.double() @ weight.t() + layer.bias.double()
        assert relative_error(out, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method, out_features, kernel_dx", [("magnitude", 160, False), ("transposable", 160, True),
                                                              ("transposable", 176, False)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_layer_gradients_match_float64(dtype, method, out_features, kernel_dx, compiled, monkeypatch):
    """Fixed-mask training: dX on the 2:4 kernel over W^T where the mask is transposable (and
    out_features a multiple of 32), else cuBLAS on the expanded W; dW gathered at the mask.
    A compiled layer's backward runs the same kernels (through the sparsegen ops)."""
    from sparsegen.semi24 import autograd as autograd24

    layer = sparsegen.Sparse24Linear(320, out_features, device="cuda", dtype=dtype, method=method)
    x = torch.randn(2, 333, 320, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 333, out_features, device="cuda", dtype=dtype)
    transposed = []
    real = sp24_ops.sp24_transpose
    monkeypatch.setattr(sp24_ops, "sp24_transpose", lambda *args: transposed.append(args[2]) or real(*args))
    (torch.compile(layer, fullgraph=True) if compiled else layer)(x).backward(dy)
    assert bool(transposed) == kernel_dx == autograd24.stored_transposable(layer.metadata, out_features, 320)
    weight = layer.to_dense_weight().double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    (x64 @ weight.t() + layer.bias.detach().double()).backward(dy.double())
    assert relative_error(x.grad, x64.grad) < TOLERANCE[dtype]
    assert relative_error(layer.values.grad.flatten(), weight.grad[layer.mask]) < TOLERANCE[dtype]
    assert relative_error(layer.bias.grad, dy.double().sum((0, 1))) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (336, 160), (1024, 4096)])
def test_expand_and_gather_kernels_match_the_layout(dtype, n, k):
    """sp24_expand writes every element of the dense W (poisoned first: zeros where nothing
    is stored); sp24_gather reads a dense tensor at exactly the stored positions."""
    sparse = sparsegen.to_sparse24(torch.randn(n, k, device="cuda", dtype=dtype))
    poisoned(n, k, dtype)  # freed at once: the allocator hands this block to the kernel's output next
    dense = sp24_ops.sp24_expand(sparse.values, sparse.metadata, n)
    assert torch.equal(dense, semi24.decompress(sparse.values, sparse.metadata, (n, k)))
    grad = torch.randn(n, k, device="cuda", dtype=dtype)
    poisoned(n, k // 2, dtype)
    assert torch.equal(sp24_ops.sp24_gather(grad, sparse.metadata), semi24.gather_kept(grad, sparse.metadata))
    assert torch.equal(sp24_ops.sp24_gather(dense, sparse.metadata), sparse.values)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, k", [(32, 32), (96, 160), (224, 4128), (2048, 5632), (11264, 2048)])
def test_transpose_kernel_gives_the_transposed_weights_2_4_form(dtype, n, k):
    """sp24_transpose's W^T decompresses to exactly W's transpose and stores W's positions
    (outputs poisoned first), W's mask transposable; stored zeros and groups of W^T with one
    nonzero (first or last of its 4) included; shapes not multiples of a block's 64 x 128
    piece; its words feed the 2:4 kernel."""
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    w[:, :8] = 0  # W^T's first rows: whole groups of zeros
    w[torch.arange(n, device="cuda") % 4 != 3, 8:16] = 0  # one nonzero per group of 4, the last
    w[torch.arange(n, device="cuda") % 4 != 0, 16:24] = 0  # ... and the first
    sparse = sparsegen.to_sparse24(w, "transposable")
    poisoned(k, n // 2, dtype)
    torch.full((k // 16, n // 32, 16), -1, device="cuda", dtype=torch.int32)
    values_t, metadata_t = sp24_ops.sp24_transpose(sparse.values, sparse.metadata, n)
    assert values_t.shape == (k, n // 2) and metadata_t.shape == (k // 16, n // 32, 16)
    assert torch.equal(semi24.decompress(values_t, metadata_t, (k, n)), sparse.to_dense().t())
    assert torch.equal(sparse24.Sparse24Tensor(values_t, metadata_t, (k, n)).mask, sparse.mask.t())
    dy = torch.randn(77, n, device="cuda", dtype=dtype)
    dx = sp24_ops.sp24_dds(dy, values_t, metadata_t, None, k)
    assert relative_error(dx, dy.double() @ sparse.to_dense().double()) < TOLERANCE[dtype]


def test_autocast_and_float32_parameters():
    layer = sparsegen.linear(128, 64, sparsity="2:4", device="cuda")  # float32 parameters
    x = torch.randn(50, 128, device="cuda")
    want = x.double() @ layer.to_dense_weight().double().t() + layer.bias.double()
    assert relative_error(layer(x), want) < 1e-5   # float32 runs the reference
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16 and relative_error(out, want) < TOLERANCE[torch.bfloat16]


def test_torch_compile_matches_eager_on_gpu():
    layer = sparsegen.linear(256, 128, sparsity="2:4", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    assert relative_error(compiled(x), layer(x).double()) < 1e-3


def test_transposable_weight_transposes_on_gpu():
    w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    sparse = sparsegen.to_sparse24(w, "transposable")
    wt = sparse.t()
    x = torch.randn(100, 256, device="cuda", dtype=torch.bfloat16)
    out = sp24_ops.sp24_dds(x, wt.values, wt.metadata, None, 128)
    assert relative_error(out, x.double() @ sparse.to_dense().double()) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("m, n", [(100, 8448), (128, 16896), (40, 1024)])
def test_sp24_forward_tiles_for_small_batches(m, n):
    """33-128 tokens: 128-row blocks for weights tall enough to fill the GPU, 64-row ones
    (and K splits) otherwise - both against float64."""
    k = 96
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    sparse = sparsegen.to_sparse24(w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = poisoned(m, n, torch.bfloat16)
    sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, None, n, out=out)
    want = x.double() @ sparse.to_dense().double().t()
    assert not out.isnan().any()
    assert relative_error(out, want) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="wgmma.sp kernels are sm_90 only")
@pytest.mark.parametrize("tile", [None, TileConfig(256, 8, 1, 5), TileConfig(256, 8, 1, 4, cluster=4)],
                         ids=["default", "single blocks", "clusters of 4"])
@pytest.mark.parametrize("m, n, k", [(1000, 336, 160), (2049, 1024, 4096), (300, 16, 32), (200, 384, 512),
                                     (700, 1040, 4128)])
def test_sp24_hopper_kernels_match_float64(tile, m, n, k):
    """The wgmma.sp kernel, forced: odd M, N not a multiple of the W tile (nor of a
    cluster's tiles: a block past N), K a single k32 tile, split K (M = 200)."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    sparse = sparsegen.to_sparse24(w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = poisoned(m, n, torch.bfloat16)
    sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, bias, n, out=out, instr="tma", tile=tile)
    want = x.double() @ sparse.to_dense().double().t() + bias.double()
    assert not out.isnan().any()
    assert relative_error(out, want) < TOLERANCE[torch.bfloat16]


def distinct_magnitudes(n, k, dtype):
    """Each group of 4 holds magnitudes 1, 1.25, 1.5, 1.75 in random order and sign: no ties."""
    order = torch.rand(n * k // 4, 4).argsort(-1).float()
    signs = torch.randint(0, 2, (n * k // 4, 4)) * 2 - 1
    return ((1 + order / 4) * signs).reshape(n, k).to("cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (512, 1024)])
def test_gpu_compress_kernel_matches_the_pytorch_path(dtype, n, k):
    """The generated sp24_compress kernel (opt-in through SPARSEGEN_COMPRESS_KERNEL) packs
    exactly what the PyTorch path packs."""
    w = distinct_magnitudes(n, k, dtype)
    values, metadata = sp24_ops.sp24_compress(w)
    want_values, want_meta = semi24.compress(w.cpu(), semi24.magnitude_mask(w.cpu()))
    assert torch.equal(values.cpu(), want_values) and torch.equal(metadata.cpu(), want_meta)
    mask = torch.rand(n, k) < 0.3
    mask &= semi24._groups(mask).cumsum(-1).reshape(n, k) <= 2  # at most 2 kept, some groups fewer
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    values, metadata = sp24_ops.sp24_compress(w, mask.cuda())
    want_values, want_meta = semi24.compress(w.cpu(), mask)
    assert torch.equal(values.cpu(), want_values) and torch.equal(metadata.cpu(), want_meta)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, k", [(32, 16), (96, 48), (1024, 272)])
def test_gpu_compress_kernel_reads_a_transposed_view_in_place(dtype, n, k):
    """W^T compressed from the transposed view (strided reads, as dX's) packs exactly what
    compressing a contiguous copy does, with and without a mask."""
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    mask = sp24_ops.sp24_transposable_mask(w)
    for args in [(), (mask.t(),)]:
        got = sp24_ops.sp24_compress(w.t(), *args)
        want = sp24_ops.sp24_compress(w.t().contiguous(), *(a.contiguous() for a in args))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_gpu_kernels_launch_from_a_thread_with_no_cuda_context_yet():
    """Autograd runs backward on its own thread; a generated kernel may be the first CUDA
    work there (dX of Sparse24TrainingLinear is), before any context is current."""
    import threading

    w = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    want, got = sp24_ops.sp24_compress(w), []
    thread = threading.Thread(target=lambda: got.append(sp24_ops.sp24_compress(w)))
    thread.start()
    thread.join()
    assert len(got) == 1 and torch.equal(got[0][0], want[0]) and torch.equal(got[0][1], want[1])


def tile_scores(w, mask):
    """|w| kept per 4 x 4 tile, in float64."""
    n, k = w.shape
    kept = (w.abs().double() * mask).reshape(n // 4, 4, k // 4, 4)
    return kept.sum((1, 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (272, 160), (1024, 2048)])
def test_gpu_transposable_mask_kernel_picks_the_best_pattern(dtype, n, k):
    """The sp24_mask kernel's mask is 2:4 along rows and columns and keeps as much |w| per
    4 x 4 tile as the CPU's exhaustive search (the same pattern but for exact ties)."""
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    mask = sp24_ops.sp24_transposable_mask(w)
    want = semi24.transposable_mask(w.cpu())
    assert (semi24._groups(mask).sum(-1) == 2).all() and (semi24._groups(mask.t()).sum(-1) == 2).all()
    torch.testing.assert_close(tile_scores(w, mask).cpu(), tile_scores(w.cpu(), want), rtol=1e-6, atol=0)
    assert (mask.cpu() != want).float().mean() < 1e-3  # ties aside, the very same patterns


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_mvue_kernel_is_unbiased(dtype):
    """Mean of 4000 MVUE samples from the sp24_compress kernel within 5 standard errors of w
    everywhere (each element is sign(a) (|a| + |b|) with probability |a| / (|a| + |b|))."""
    w = torch.randn(32, 64, device="cuda", dtype=dtype)
    w[0, :4] = 0  # a zero pair stays zero
    draws = 4000
    total = torch.zeros(32, 64, device="cuda", dtype=torch.float64)
    for _ in range(draws):
        sample = sparsegen.to_sparse24(w, "mvue").to_dense()
        assert (semi24._groups(sample != 0).sum(-1) <= 2).all()
        total += sample.double()
    pairs = w.double().abs().reshape(32, 32, 2)
    size = pairs.sum(-1, keepdim=True).expand(-1, -1, 2).reshape(32, 64)
    variance = (size * w.double().abs() - w.double() ** 2).clamp_min(0)
    error = (total / draws - w.double()).abs()
    # plus the rounding of |a| + |b| to the dtype: a bias of at most half an ulp
    assert (error <= 5 * (variance / draws).sqrt() + 2**-8 * size).all()
    assert torch.equal(total[0, :4], torch.zeros(4, device="cuda", dtype=torch.float64))


def test_gpu_mvue_kernel_follows_the_generator():
    w = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    samples = [sparsegen.to_sparse24(w, "mvue", generator=torch.Generator().manual_seed(seed)).to_dense()
               for seed in (1, 1, 2)]
    assert torch.equal(samples[0], samples[1]) and not torch.equal(samples[0], samples[2])


@pytest.mark.parametrize("kernel", ["0", "1"])
@pytest.mark.parametrize("method", ["magnitude", "transposable", "mvue"])
def test_to_sparse24_on_gpu_is_24_and_round_trips(method, kernel, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_COMPRESS_KERNEL", kernel)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    sparse = sparsegen.to_sparse24(w, method)
    dense = sparse.to_dense()
    assert ((dense != 0).reshape(256, -1, 4).sum(-1) <= 2).all()
    if method != "mvue":
        assert torch.equal(dense, w * sparse.mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_features", [192, 176])  # 176: dX falls back to cuBLAS (not a multiple of 32)
def test_training_layer_matches_float64(dtype, out_features):
    layer = sparsegen.Sparse24TrainingLinear(256, out_features, device="cuda", dtype=dtype)
    x = torch.randn(3, 111, 256, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 111, out_features, device="cuda", dtype=dtype)
    out = layer(x)
    sparse = (layer.weight.detach() * layer.mask).double()
    x64 = x.detach().double()
    assert relative_error(out, x64 @ sparse.t() + layer.bias.detach().double()) < TOLERANCE[dtype]
    out.backward(dy)
    assert relative_error(x.grad, dy.double() @ sparse) < TOLERANCE[dtype]
    dw = dy.double().reshape(-1, out_features).t() @ x64.reshape(-1, 256)
    assert relative_error(layer.weight.grad, dw) < TOLERANCE[dtype]


@pytest.mark.parametrize("tokens", [96, 90])  # 96: dW on the 2:4 kernel; 90: MVUE + cuBLAS
def test_gpu_dw_sparse_is_an_unbiased_estimate(tokens, weight_grad_draws):
    """dw_sparse: the mean of 300 draws of dW is within 5 standard errors (plus bf16
    rounding) of dY^T X everywhere, and a single draw is not the exact product."""
    layer = sparsegen.Sparse24TrainingLinear(64, 32, device="cuda", dtype=torch.bfloat16, dw_sparse=True)
    x = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, 32, device="cuda", dtype=torch.bfloat16)
    grads = weight_grad_draws(layer, x, dy, 300)
    exact = dy.double().t() @ x.double()
    stderr = grads.std(0) / 300 ** 0.5
    assert ((grads.mean(0) - exact).abs() <= 5 * stderr + 2e-2 * exact.abs() + 1e-2).all()
    assert relative_error(grads[0], exact) > 1e-2


def test_training_layer_under_autocast():
    layer = sparsegen.Sparse24TrainingLinear(128, 64, device="cuda")
    x = torch.randn(40, 128, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    want = x.double() @ (layer.weight.detach() * layer.mask).double().t() + layer.bias.detach().double()
    assert out.dtype == torch.bfloat16 and relative_error(out, want) < TOLERANCE[torch.bfloat16]
    out.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32


def test_f_linear_with_a_sparse24_weight_on_gpu():
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    sparse = sparsegen.to_sparse24(w)
    x = torch.randn(2, 99, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.nn.functional.linear(x, sparse)
    assert relative_error(out, x.double() @ sparse.to_dense().double().t()) < TOLERANCE[torch.bfloat16]


# One-byte 2:4 products (mma.sp m16n8k64): int8 -> int32 (exact), float8_e4m3fn -> bfloat16.
BYTE_DTYPES = [torch.int8, torch.float8_e4m3fn]


def random_bytes(shape, dtype):
    """int8 over its whole range; e4m3 normals scaled to reach its larger exponents."""
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, device="cuda", dtype=torch.int8)
    return (torch.randn(shape, device="cuda") * 8).to(dtype)


def byte_output_poisoned(m, n, dtype):
    if dtype == torch.int8:
        return torch.full((m, n), -2**31, device="cuda", dtype=torch.int32)
    return poisoned(m, n, torch.bfloat16)


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 7, 65, 1000, 4100])
@pytest.mark.parametrize("n, k", [(16, 64), (336, 192), (1024, 4096)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_byte_sp24_forward_matches_float64(dtype, m, n, k, with_bias):
    if torch.cuda.get_device_capability() < (8, 9) and dtype != torch.int8:
        pytest.skip("fp8 tensor cores need sm_89")
    sparse = sparsegen.to_sparse24(random_bytes((n, k), dtype))
    x = random_bytes((m, k), dtype)
    out_dtype = sp24_ops.sp24_output_dtype(dtype)
    bias = None
    if with_bias:
        bias = (torch.randint(-1000, 1000, (n,), device="cuda", dtype=torch.int32) if dtype == torch.int8
                else torch.randn(n, device="cuda", dtype=out_dtype))
    out = byte_output_poisoned(m, n, dtype)
    sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, bias, n, out=out)
    want = x.double() @ sparse.to_dense().double().t() + (0 if bias is None else bias.double())
    if dtype == torch.int8:
        assert torch.equal(out.double(), want)  # exact: int32 sums of int8 products
    else:
        assert not out.isnan().any()
        assert relative_error(out, want) < 1e-2


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
def test_byte_sp24_metadata_layout_element_by_element(dtype):
    """As for 16-bit: one nonzero row at a time, X = I, so each kept value must come out at
    exactly its column (k64 products: mma.sp for int8, wgmma.sp for e4m3 on sm_90). The
    values differ within every group of 4 and are exact in both types."""
    if torch.cuda.get_device_capability() < (8, 9) and dtype != torch.int8:
        pytest.skip("fp8 tensor cores need sm_89")
    n, k = 16, 128
    torch.manual_seed(0)
    mask = semi24.magnitude_mask(torch.randn(n, k))
    x = torch.eye(k, device="cuda").to(dtype)
    cols = torch.arange(k)
    row_values = (cols % 127 + 1.0) if dtype == torch.int8 else (cols % 4 + 1.0) * 2.0 ** ((cols // 4) % 8 - 4)
    for row in range(n):
        w = torch.zeros(n, k)
        w[row] = row_values
        sparse = sparsegen.to_sparse24((w * mask).to("cuda", dtype), mask=mask.cuda())
        y = sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, None, n)
        assert torch.equal(y.t()[row].float().cpu(), (w * mask)[row]), f"row {row}"


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
def test_f_linear_with_a_byte_sparse24_weight_and_batch_dims(dtype):
    if torch.cuda.get_device_capability() < (8, 9) and dtype != torch.int8:
        pytest.skip("fp8 tensor cores need sm_89")
    w = random_bytes((128, 256), dtype)
    sparse = sparsegen.to_sparse24(w, method="transposable")
    x = random_bytes((2, 3, 256), dtype)
    y = torch.nn.functional.linear(x, sparse)
    want = sparse24.byte_reference(x.cpu(), sparse.values.cpu(), sparse.metadata.cpu(), None, 128)
    assert y.shape == (2, 3, 128) and y.dtype == sp24_ops.sp24_output_dtype(dtype)
    if dtype == torch.int8:
        assert torch.equal(y.cpu(), want)
    else:
        assert relative_error(y.cpu().float(), want.double()) < 1e-2
    xt = random_bytes((5, 128), dtype)
    yt = torch.nn.functional.linear(xt, sparse.t())  # W^T is 2:4 too
    want_t = xt.double() @ sparse.to_dense().double()
    assert yt.shape == (5, 256) and relative_error(yt, want_t) < 1e-2


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
@pytest.mark.parametrize("n, k", [(16, 64), (48, 192), (512, 1024)])
def test_gpu_byte_compress_kernel_matches_the_pytorch_path(dtype, n, k):
    """sp24_compress on raw bytes (ties included: int8 has many) packs exactly what the
    PyTorch path packs, by magnitude and by mask, from a contiguous weight and a transposed view."""
    w = random_bytes((n, k), dtype)
    values, metadata = sp24_ops.sp24_compress(w)
    want_values, want_meta = semi24.compress(w.cpu(), semi24.magnitude_mask(w.cpu()))
    assert values.dtype == dtype and torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(metadata.cpu(), want_meta)
    mask = torch.rand(n, k) < 0.3
    mask &= semi24._groups(mask).cumsum(-1).reshape(n, k) <= 2
    values, metadata = sp24_ops.sp24_compress(w, mask.cuda())
    want_values, want_meta = semi24.compress(w.cpu(), mask)
    assert torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(metadata.cpu(), want_meta)
    square = random_bytes((k, k), dtype)
    got, want = sp24_ops.sp24_compress(square.t()), sp24_ops.sp24_compress(square.t().contiguous())
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
@pytest.mark.parametrize("n, k", [(16, 64), (272, 192)])
def test_gpu_byte_transposable_mask_kernel_keeps_the_most(dtype, n, k):
    w = random_bytes((n, k), dtype)
    mask = sp24_ops.sp24_transposable_mask(w)
    want = semi24.transposable_mask(w.cpu())
    assert (semi24._groups(mask).sum(-1) == 2).all() and (semi24._groups(mask.t()).sum(-1) == 2).all()
    torch.testing.assert_close(tile_scores(w.float(), mask).cpu(), tile_scores(w.cpu().float(), want), rtol=1e-6, atol=0)


def test_to_sparse24_of_bytes_prunes_on_the_gpu_kernels(monkeypatch):
    """to_sparse24 on a CUDA int8 weight goes through the generated kernels."""
    calls = []
    real = sp24_ops.sp24_compress
    monkeypatch.setattr(sp24_ops, "sp24_compress", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    sparse = sparsegen.to_sparse24(random_bytes((32, 128), torch.int8), "transposable")
    assert calls and (semi24._groups(sparse.mask).sum(-1) == 2).all()


@pytest.mark.parametrize("m", [7, 300])
def test_int8_mma_sp_path_matches_float64_on_any_arch(m):
    """int8 takes wgmma.sp on sm_90 by default; the mma.sp m16n8k64 kernel (every other arch)
    is forced here so that an H100 run still checks it exactly."""
    n, k = 208, 320
    sparse = sparsegen.to_sparse24(random_bytes((n, k), torch.int8))
    x = random_bytes((m, k), torch.int8)
    bias = torch.randint(-1000, 1000, (n,), device="cuda", dtype=torch.int32)
    out = byte_output_poisoned(m, n, torch.int8)
    sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, bias, n, out=out, instr="mma")
    want = x.double() @ sparse.to_dense().double().t() + bias.double()
    assert torch.equal(out.double(), want)


def split_case(m, n, k, dtype=torch.bfloat16, bias=True):
    sparse = sparsegen.to_sparse24(torch.randn(n, k, device="cuda", dtype=dtype))
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    want = x.double() @ sparse.to_dense().double().t() + (b.double() if bias else 0)
    return sparse, x, b, want


def counters_are_zero() -> bool:
    from sparsegen.launch import runtime, workspace
    held = workspace.current(torch.device("cuda", 0), runtime.current_stream(0))
    return held is not None and not held.counts.any().item()


@pytest.mark.parametrize("instr", ["mma", "tma"])
@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("m, n, k, bias", [(1, 336, 896, True), (17, 1024, 1024, False), (200, 130 * 16, 640, True)])
def test_split_k_finishes_in_the_kernel_and_leaves_the_counters_zero(instr, splits, m, n, k, bias):
    """K splits write slices of a shared workspace; the last split of each tile adds them,
    writes Y (bias and rounding) and zeroes its counter: Y is right, the counters end all
    zeros, and the next call (another shape: its counters and sums over the earlier sums) on
    the same workspace is right too."""
    if instr == "tma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma.sp kernels are sm_90 only")
    for case in (split_case(m, n, k, bias=bias), split_case(m + 5, n // 32 * 16 + 16, k + 128, bias=not bias)):
        sparse, x, b, want = case
        out = poisoned(x.shape[0], want.shape[1], torch.bfloat16)
        sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, b, want.shape[1], out=out, splits=splits, instr=instr)
        assert not out.isnan().any()
        assert relative_error(out, want) < TOLERANCE[torch.bfloat16]
        assert counters_are_zero()


def test_split_k_inside_a_cuda_graph_captured_without_warm_up():
    """A split launch first seen during capture zeroes a workspace inside the graph; replays
    with new inputs are right, and so is an eager call on the stream's workspace after."""
    sparse, x, b, _ = split_case(8, 1024, 2048)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y = sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, b, 1024)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        graph.replay()
        want = x.double() @ sparse.to_dense().double().t() + b.double()
        assert relative_error(y, want) < TOLERANCE[torch.bfloat16]
    eager = sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, b, 1024)
    assert relative_error(eager, want) < TOLERANCE[torch.bfloat16]
    assert counters_are_zero()


@pytest.mark.parametrize("instr", ["mma", "tma"])
def test_split_k_reads_only_sums_written_by_the_same_launch(instr):
    """The sums are never zeroed: every split writes its whole slice before it counts itself
    in. With the workspace's sums poisoned (NaN) before each call, Y is still right."""
    from sparsegen.launch import runtime, workspace
    if instr == "tma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma.sp kernels are sm_90 only")
    for m, n, k in ((3, 1024, 4096), (9, 336, 2016)):
        sparse, x, b, want = split_case(m, n, k)
        sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, b, n, splits=5, instr=instr)  # sizes the workspace
        workspace.current(torch.device("cuda", 0), runtime.current_stream(0)).sums.fill_(float("nan"))
        out = sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, b, n, splits=5, instr=instr)
        assert relative_error(out, want) < TOLERANCE[torch.bfloat16]


def _recipe_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(sparsegen.Sparse24TrainingLinear(256, 512, device="cuda", mask_interval=3),
                               torch.nn.GELU(),
                               sparsegen.Sparse24TrainingLinear(512, 256, device="cuda", mask_interval=3)).cuda()


def _recipe_step(model, opt, x, y):
    """One whole step of the recipe: bf16 autocast forward, backward, masked decay, AdamW."""
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    sparsegen.masked_decay_(model, 1e-2)
    opt.step()
    return loss


def _graphed_recipe(model, opt, x, y, warmup: int = 2):
    """Run `warmup` steps eagerly on a side stream, then capture one step; returns the graph
    and its loss tensor (the replays' output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.zero_grad(set_to_none=True)
            _recipe_step(model, opt, x, y)
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = _recipe_step(model, opt, x, y)
    return graph, loss


def test_recipe_step_replays_as_a_cuda_graph_and_refreshes_on_schedule():
    """A captured training step (forward, backward, masked_decay_, capturable AdamW) of
    Sparse24TrainingLinear layers: each replay advances the device-side step, the mask
    changes at every 3rd step and only there (to the transposable mask of the weights the
    step saw), and the losses follow an eager twin's."""
    model = _recipe_model()
    twin = _recipe_model()
    twin.load_state_dict(model.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=torch.tensor(3e-2, device="cuda"), capturable=True)
            for m in (model, twin)]
    x, y = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
    graph, graph_loss = _graphed_recipe(model, opts[0], x, y)
    layer = model[0]
    for counter in range(2, 11):  # the warm-up ran steps 0 and 1; the capture executed nothing
        before_mask, weight_bf16 = layer.mask.clone(), layer.weight.detach().bfloat16()
        graph.replay()
        changed = not torch.equal(layer.mask, before_mask)
        if counter % 3 == 0:
            assert torch.equal(layer.mask, semi24.transposable_mask(weight_bf16)), counter
            assert changed, counter  # Adam moves every weight: a refresh changes the mask
        else:
            assert not changed, counter
    assert int(layer.step) == 11 and int(model[2].step) == 11
    losses = []
    for _ in range(11):
        opts[1].zero_grad(set_to_none=True)
        losses.append(float(_recipe_step(twin, opts[1], x, y)))
    assert abs(float(graph_loss) - losses[-1]) <= 2e-2 * abs(losses[-1]) + 1e-3


@pytest.mark.parametrize("counter, writes", [(0, False), (4, False), (6, True), (12, True)])
def test_mask_kernel_writes_only_on_a_due_step(counter, writes):
    w = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.ones(64, 128, dtype=torch.bool, device="cuda")  # poisoned: all kept, not 2:4
    step = torch.tensor(counter, device="cuda")
    sp24_ops.sp24_transposable_mask(w, out=out, step=step, interval=6)
    assert torch.equal(out, semi24.transposable_mask(w) if writes else torch.ones_like(out))


def test_training_steps_free_each_steps_compression():
    """Each recipe step compresses W (and W^T) afresh; the plans made for them go with them:
    memory after 30 steps is what it was after 3."""
    layer = sparsegen.Sparse24TrainingLinear(512, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def steps(count):
        for _ in range(count):
            layer.weight.grad = x.grad = None
            layer(x).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    settled = steps(3)
    assert steps(30) <= settled


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, n, k", [((65,), 336, 160), ((3, 37), 1024, 512), ((4096,), 5632, 2048)])
def test_fresh_weights_share_a_plan_and_each_call_reads_its_own(dtype, shape, n, k):
    """sp24_dds_fresh keeps one plan per signature and binds W per call: weights of one
    signature, all alive at once, each give their own product, by one plan."""
    made = len(sp24_ops._FRESH_PLANS._plans)
    weights = [sp24_ops.sp24_compress(torch.randn(n, k, device="cuda", dtype=dtype)) for _ in range(3)]
    bias = torch.randn(n, device="cuda", dtype=dtype)
    for values, metadata in weights * 2:
        x = torch.randn(*shape, k, device="cuda", dtype=dtype)
        out = sp24_ops.sp24_dds_fresh(x, values, metadata, bias, n)
        want = x.double() @ semi24.decompress(values, metadata, (n, k)).double().t() + bias.double()
        assert out.shape == (*shape, n) and relative_error(out, want) < TOLERANCE[dtype]
    assert len(sp24_ops._FRESH_PLANS._plans) <= made + 1


@pytest.mark.parametrize("tokens", [16, 1024, 4096])
def test_transposable_input_grad_makes_no_plan_per_step(tokens, monkeypatch):
    """dX = dY W for a transposable W: the kernel over a W^T transposed per call, by one plan
    per signature, or - where the crossover table gives the call to cuBLAS (1024 tokens on
    an H100) - cuBLAS on the expanded W, with no W^T compressed. Never a plan per call (one
    was made, whole, for every W^T cuBLAS should have taken). Numerics against float64, the
    output of each call fresh."""
    from sparsegen.launch import plans
    from sparsegen.semi24 import autograd
    torch.manual_seed(0)
    n, k = 2048, 5632
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    mask = semi24.transposable_mask(weight)
    values, metadata = sp24_ops.sp24_compress(weight, mask)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    autograd.input_grad(dy, values, metadata, n)  # (the signature's first call makes its plan)
    made, compressed, allocating, transpose = [], [], plans.allocating, sp24_ops.sp24_transpose
    monkeypatch.setattr(plans, "allocating", lambda what: made.append(what) or allocating(what))
    # (W^T comes from one sp24_transpose pass over W's values and metadata)
    monkeypatch.setattr(sp24_ops, "sp24_transpose", lambda *args: compressed.append(1) or transpose(*args))
    for _ in range(3):
        dx = autograd.input_grad(dy, values, metadata, n)
        assert relative_error(dx, dy.double() @ (weight * mask).double()) < TOLERANCE[torch.bfloat16]
    takes_dense = sp24_ops.fresh_takes_dense(tokens, n, k, torch.bfloat16, 0)
    assert made == [] and len(compressed) == (0 if takes_dense else 3)


@pytest.mark.parametrize("in_features, out_features", [(1024, 4096), (4096, 1024), (192, 96)])
def test_recipe_adamw_steps_follow_a_float64_twin(in_features, out_features):
    """Three fused-AdamW steps of a Sparse24TrainingLinear as a GPT-2 MLP trains (bias, fp32
    weights, bf16 autocast) against a float64 linear holding its masked weight, the pruned
    gradients zeroed: the kept weights, the bias and the outputs move alike, every step."""
    torch.manual_seed(0)
    layer = sparsegen.Sparse24TrainingLinear(in_features, out_features, device="cuda")
    weight64 = (layer.weight.detach() * layer.mask).double().requires_grad_()
    bias64 = layer.bias.detach().double().requires_grad_()
    starts = (weight64.detach().clone(), bias64.detach().clone())
    optimizers = (torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=True),
                  torch.optim.AdamW([weight64, bias64], lr=1e-3))
    for _ in range(3):
        x = torch.randn(4, 512, in_features, device="cuda")
        dy = torch.randn(4, 512, out_features, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x)
        want = x.double() @ weight64.t() + bias64
        assert relative_error(out, want.detach()) < TOLERANCE[torch.bfloat16]
        out.float().backward(dy)
        want.backward(dy.double())
        weight64.grad *= layer.mask
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    # Adam's first steps move each weight by about lr whatever its gradient's size: the moves
    # are compared (bf16 products flip the sign of the smallest gradients only).
    for trained, twin, start in zip(((layer.weight * layer.mask).detach(), layer.bias.detach()), (weight64, bias64),
                                    starts):
        assert relative_error(trained.double() - start, twin.detach() - start) < 0.1


def test_compiled_recipe_step_runs_the_kernels_and_follows_eager(monkeypatch):
    """A recipe model under torch.compile (Inductor) compresses at the mask on the GPU as
    often as eager mode does (each layer's forward, and dX where its input needs a gradient),
    refreshes its mask on schedule, and its losses follow the eager twin's."""
    model, twin = _recipe_model(), _recipe_model()
    compiled = torch.compile(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-2) for m in (model, twin)]
    x, y = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
    compressed, real = [], sp24_ops.sp24_compress
    monkeypatch.setattr(sp24_ops, "sp24_compress", lambda w, *a, **kw: compressed.append(w.shape) or real(w, *a, **kw))
    for _ in range(5):  # the mask refreshes at the 4th step (mask_interval 3)
        counts, losses = [], []
        for module, optimizer in zip((compiled, twin), optimizers):
            compressed.clear()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(_recipe_step(module, optimizer, x, y).detach()))
            counts.append(len(compressed))
        assert counts == [3, 3]  # two forwards, the second layer's dX
        assert abs(losses[0] - losses[1]) <= 2e-2 * abs(losses[1]) + 1e-3
    # (bf16 rounding moves a few weights across their group's threshold: most positions agree)
    assert int(model[0].step) == 5 and (model[0].mask == twin[0].mask).float().mean() > 0.9
    assert not torch.equal(model[0].mask, _recipe_model()[0].mask)  # refreshed
