"""2:4 format on the CPU: pruning methods, compression, the mma.sp metadata layout checked
element by element against a CPU model of how the instruction reads it, and bad input."""
import pytest
import torch

import sparsegen
from sparsegen.errors import InputError
from sparsegen.semi24 import format as semi24

DTYPES = [torch.bfloat16, torch.float16]


def groups_kept(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape(mask.shape[0], -1, 4).sum(-1)


@pytest.mark.parametrize("method", ["magnitude", "transposable", "mvue"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (32, 160)])
def test_round_trip_keeps_two_of_four(method, dtype, shape):
    w = torch.randn(shape, dtype=dtype)
    sparse = sparsegen.to_sparse24(w, method)
    assert sparse.values.shape == (shape[0], shape[1] // 2)
    assert sparse.metadata.shape == (shape[0] // 16, shape[1] // 32, 16)
    assert (groups_kept(sparse.mask) == 2).all()
    dense = sparse.to_dense()
    assert (groups_kept(dense != 0) <= 2).all()
    if method != "mvue":
        assert torch.equal(dense, w * sparse.mask)


@pytest.mark.parametrize("seed", range(3))
def test_metadata_matches_the_cpu_model_element_by_element(seed):
    """Every stored element: the (row, group) nibble that the lane model of mma.sp reads from
    the packed words names exactly the positions the value came from."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 96, generator=gen).to(torch.bfloat16)
    sparse = sparsegen.to_sparse24(w)
    positions = semi24.unpack_metadata(sparse.metadata)       # lane by lane, word_nibbles
    for row in range(32):
        for group in range(24):
            kept = torch.nonzero(sparse.mask[row, 4 * group:4 * group + 4]).flatten().tolist()
            assert positions[row, group].tolist() == kept, (row, group)
            want = w[row, [4 * group + p for p in kept]]
            assert torch.equal(sparse.values[row, 2 * group:2 * group + 2], want)


def test_each_lane_word_covers_its_rows_and_half():
    seen = {}
    for lane in range(32):
        for (row, group), _ in semi24.word_nibbles(0, lane).items():
            assert (row, group) not in seen
            seen[(row, group)] = lane
    assert len(seen) == 16 * 8  # every (row, group) of the 16 x 32 tile exactly once


def test_magnitude_keeps_the_two_largest():
    w = torch.tensor([[1.0, -4.0, 3.0, 2.0] * 8] * 16, dtype=torch.float16)
    mask = sparsegen.to_sparse24(w).mask
    assert mask[0, :4].tolist() == [False, True, True, False]


def test_transposable_mask_is_24_both_ways_and_beats_nothing_worse():
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    sparse = sparsegen.to_sparse24(w, "transposable")
    assert (groups_kept(sparse.mask) == 2).all() and (groups_kept(sparse.mask.t().contiguous()) == 2).all()
    wt = sparse.t()
    assert torch.equal(wt.to_dense(), sparse.to_dense().t())
    # no transposable pattern keeps more magnitude in any 4x4 tile than the chosen one
    patterns = semi24._transposable_patterns()
    assert patterns.shape == (90, 16)
    tiles = w.abs().float().reshape(16, 4, 16, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    chosen = sparse.mask.float().reshape(16, 4, 16, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    assert torch.allclose((tiles * chosen).sum(-1), (tiles @ patterns.t()).max(-1).values)


def test_mvue_is_unbiased():
    """The mean of many draws converges to the input: |mean - w| within 5 standard errors."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=gen)
    draws = torch.stack([semi24.mvue(w, gen) for _ in range(4000)])
    assert (groups_kept(draws[0] != 0) <= 2).all()
    stderr = draws.std(0) / 4000 ** 0.5
    assert ((draws.mean(0) - w).abs() <= 5 * stderr + 1e-6).all()


def test_user_mask_is_validated():
    w = torch.randn(16, 32, dtype=torch.float16)
    mask = torch.zeros(16, 32, dtype=torch.bool)
    mask[:, ::2] = True
    assert torch.equal(sparsegen.to_sparse24(w, mask=mask).mask, mask)
    mask[3, 5] = True  # three kept in the group at row 3, columns 4..7
    with pytest.raises(InputError, match="row 3, columns 4..7"):
        sparsegen.to_sparse24(w, mask=mask)
    with pytest.raises(InputError, match="boolean"):
        sparsegen.to_sparse24(w, mask=mask.float())
    with pytest.raises(InputError, match="shape"):
        sparsegen.to_sparse24(w, mask=mask[:8])


def test_sparser_user_mask_stores_zeros():
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    mask = torch.zeros(16, 32, dtype=torch.bool)
    mask[:, 0] = True  # one kept per first group, none elsewhere
    dense = sparsegen.to_sparse24(w, mask=mask).to_dense()
    assert torch.equal(dense, w * mask)


def test_transpose_of_a_row_only_mask_is_a_clear_error():
    w = torch.zeros(32, 32, dtype=torch.bfloat16)
    w[:4, 0] = 1.0  # column 0 keeps 4 of rows 0..3
    with pytest.raises(InputError, match="2:4 along columns"):
        sparsegen.to_sparse24(w).t()


@pytest.mark.parametrize("bad, match", [
    (torch.randn(16, 30, dtype=torch.float16), "positive multiple of 16 and columns of 32"),
    (torch.randn(0, 32, dtype=torch.float16), "positive multiple"),
    (torch.randn(16, 0, dtype=torch.bfloat16), "positive multiple"),
    (torch.randn(8, 32, dtype=torch.float16), "multiple of 16"),
    (torch.randn(2, 16, 32, dtype=torch.float16), "2-D"),
    (torch.randint(0, 5, (16, 32), dtype=torch.int8), "columns of 64"),
    (torch.randint(0, 5, (16, 64), dtype=torch.int16), "dtype in"),
    (torch.randn(16, 64).to(torch.float8_e5m2), "dtype in"),
])
def test_bad_tensors_are_clear_errors(bad, match):
    with pytest.raises(InputError, match=match):
        sparsegen.to_sparse24(bad)


def test_unknown_method():
    with pytest.raises(InputError, match="method"):
        sparsegen.to_sparse24(torch.randn(16, 32, dtype=torch.float16), "random")


def test_weight_memory_is_at_most_057_of_dense():
    w = torch.randn(4096, 1024, dtype=torch.bfloat16)
    sparse = sparsegen.to_sparse24(w)
    assert sparse.nbytes() / (w.numel() * w.element_size()) <= 0.57


@pytest.mark.parametrize("m, n, narrow", [(128, 4096, True), (128, 8192, True), (128, 11008, False), (100, 8448, False),
                                          (64, 14336, True), (33, 8192, True), (32, 4096, False), (1000, 4096, False)])
def test_33_to_128_tokens_take_narrow_tiles_unless_wide_ones_fill_the_gpu(m, n, narrow, monkeypatch):
    from sparsegen.launch import runtime
    from sparsegen.semi24 import dispatch as sp24_dispatch
    from sparsegen.semi24.specs import sp24_spec
    from sparsegen.jit.spec import TileConfig

    monkeypatch.setattr(runtime, "sm_count", lambda index: 132)
    assert sp24_dispatch.narrow_tiles(m, n, 0) == narrow
    tile = sp24_spec("bf16", 90, rows=sp24_dispatch.rows_bucket(m), narrow=narrow).tile
    assert (tile == TileConfig(64, 4, 1, 8)) == narrow
    if 64 < m <= 128 and not narrow:
        assert tile == TileConfig(128, 8, 1, 6)


@pytest.mark.parametrize("m, n, k, splits", [(1, 4096, 4096, 4), (16, 11008, 4096, 1), (16, 8192, 8192, 2),
                                             (64, 4096, 4096, 1), (64, 4096, 11008, 2), (128, 14336, 4096, 1)])
def test_decode_k_splits_fill_the_sms_once(m, n, k, splits, monkeypatch):
    """Decode launches split K until one block per SM runs, 33-128 tokens in splits of 3072
    of K at least (the H100 sweep's best choices for these weights)."""
    from sparsegen.launch import runtime
    from sparsegen.semi24 import dispatch as sp24_dispatch
    from sparsegen.semi24.specs import sp24_spec

    monkeypatch.setattr(runtime, "sm_count", lambda index: 132)
    spec = sp24_spec("bf16", 90, rows=sp24_dispatch.rows_bucket(m), narrow=sp24_dispatch.narrow_tiles(m, n, 0))
    grid, _ = sp24_dispatch.grid(spec, m, k, n, 0, None)
    assert grid[2] == splits


def test_compress_operands_keep_a_transposed_view_in_place():
    """The compress kernel reads W^T views where they lie (dX's weight); other layouts are
    made contiguous, and a mask is brought to the weight's strides."""
    from sparsegen.semi24 import ops as sp24_ops

    w = torch.randn(64, 32, dtype=torch.bfloat16)
    mask = torch.rand(64, 32) < 0.5
    view, view_mask, row_step, col_step = sp24_ops._rows_or_columns(w.t(), mask.t().contiguous())
    assert view.data_ptr() == w.data_ptr() and (row_step, col_step) == (1, 32)
    assert view_mask.stride() == view.stride() and torch.equal(view_mask, mask.t())
    plain, _, row_step, col_step = sp24_ops._rows_or_columns(w, None)
    assert plain.data_ptr() == w.data_ptr() and (row_step, col_step) == (32, 1)
    sliced, _, row_step, col_step = sp24_ops._rows_or_columns(w[:, ::2], None)
    assert sliced.is_contiguous() and torch.equal(sliced, w[:, ::2]) and (row_step, col_step) == (16, 1)


@pytest.mark.parametrize("m, k, n", [(1, 4096, 4096), (16, 11008, 4096), (200, 160, 336), (300, 4096, 4096),
                                     (7, 32, 16)])
def test_sp24_grid_splits_k_into_whole_stages_that_cover_it(m, k, n, monkeypatch):
    from sparsegen.launch import runtime
    from sparsegen.semi24 import dispatch as sp24_dispatch
    from sparsegen.semi24.specs import sp24_spec

    monkeypatch.setattr(runtime, "sm_count", lambda index: 132)
    spec = sp24_spec("bf16", 90, rows=sp24_dispatch.rows_bucket(m))
    (slots, one, splits), k_split = sp24_dispatch.grid(spec, m, k, n, 0, None)
    # wgmma.sp blocks walk work items (`cluster` neighbouring tiles, one per block of a
    # cluster): one item each when K is split, else at most one block per SM
    c = spec.tile.cluster
    items = -(-n // (sparsegen.semi24.specs.w_rows(spec) * c)) * -(-m // spec.tile.tile_m)
    assert one == 1 and slots % c == 0 and slots // c == (items if splits > 1 else min(items, 132 // c))
    assert k_split % sp24_dispatch.SP24_STAGE_K == 0 and k_split * (splits - 1) < k <= k_split * splits
    if m > 256:
        assert splits == 1
    assert sp24_dispatch.grid(spec, m, k, n, 0, 3)[0][2] <= 3


def test_f_linear_accepts_a_sparse24_weight():
    import torch.nn.functional as F

    w = torch.randn(32, 64, dtype=torch.float64)
    sparse = sparsegen.to_sparse24(w)
    x, bias = torch.randn(3, 5, 64, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    torch.testing.assert_close(F.linear(x, sparse, bias), x @ sparse.to_dense().t() + bias)
    torch.testing.assert_close(F.linear(x, sparse), x @ sparse.to_dense().t())
    with pytest.raises(InputError, match=r"shape \(\.\.\., 64\)"):
        F.linear(torch.randn(2, 60, dtype=torch.float64), sparse)


def test_magnitude_ties_keep_the_first_and_positions_cover_every_pattern():
    import itertools

    w = torch.ones(16, 32, dtype=torch.bfloat16)  # all equal: the first two of each group
    assert semi24.magnitude_mask(w)[0, :4].tolist() == [True, True, False, False]
    for bits in itertools.product([False, True], repeat=4):
        if sum(bits) > 2:
            continue
        mask = torch.tensor([list(bits) * 8] * 16)
        positions = semi24.kept_positions(mask)[0, 0].tolist()
        kept = [i for i in range(4) if bits[i]]
        assert positions == sorted(positions) and set(kept) <= set(positions) and len(set(positions)) == 2


BYTE_DTYPES = [torch.int8, torch.float8_e4m3fn]


def random_bytes(shape, dtype, generator=None):
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator)
    return (torch.randn(shape, generator=generator) * 8).to(dtype)


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
@pytest.mark.parametrize("method", ["magnitude", "transposable"])
def test_byte_round_trip_keeps_the_two_largest_bit_for_bit(dtype, method):
    w = random_bytes((48, 192), dtype)
    sparse = sparsegen.to_sparse24(w, method)
    assert sparse.values.dtype == dtype and sparse.values.shape == (48, 96)
    assert (groups_kept(sparse.mask) == 2).all()
    raw, dense = w.view(torch.uint8), sparse.to_dense().view(torch.uint8)
    assert torch.equal(dense[sparse.mask], raw[sparse.mask]) and (dense[~sparse.mask] == 0).all()
    wide = sparsegen.to_sparse24(w.double(), method)  # the same values as float64: the same choice
    assert torch.equal(sparse.metadata, wide.metadata)


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
def test_byte_f_linear_on_cpu_matches_float64(dtype):
    import torch.nn.functional as F

    w, x = random_bytes((32, 128), dtype), random_bytes((2, 5, 128), dtype)
    sparse = sparsegen.to_sparse24(w)
    want = x.double() @ sparse.to_dense().double().t()
    y = F.linear(x, sparse)
    assert y.dtype == (torch.int32 if dtype == torch.int8 else torch.bfloat16) and y.shape == (2, 5, 32)
    if dtype == torch.int8:
        assert torch.equal(y.double(), want)
        bias = torch.randint(-9, 9, (32,), dtype=torch.int32)
        assert torch.equal(F.linear(x, sparse, bias).double(), want + bias.double())
    else:
        torch.testing.assert_close(y.double(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
def test_byte_weights_reject_bad_inputs_clearly(dtype):
    import torch.nn.functional as F

    sparse = sparsegen.to_sparse24(random_bytes((16, 64), dtype))
    out = "torch.int32" if dtype == torch.int8 else "torch.bfloat16"
    with pytest.raises(InputError, match=r"MVUE"):
        sparsegen.to_sparse24(random_bytes((16, 64), dtype), "mvue")
    with pytest.raises(InputError, match=rf"input dtype {dtype}.*Got torch.float16"):
        F.linear(torch.randn(3, 64, dtype=torch.float16), sparse)
    with pytest.raises(InputError, match=rf"bias of shape \(16,\), {out}"):
        F.linear(random_bytes((3, 64), dtype), sparse, torch.zeros(16, dtype=torch.float16))
    with pytest.raises(InputError, match=r"float8_e4m3fn: sparsegen.to_sparse24 for inference"):
        sparsegen.linear(64, 16, sparsity="2:4", dtype=dtype)


@pytest.mark.parametrize("dtype, name", [(torch.int8, "int8"), (torch.float8_e4m3fn, "e4m3"), (torch.bfloat16, "bf16")])
def test_kernels_are_chosen_for_one_byte_and_16_bit_dtypes(dtype, name, monkeypatch):
    """The forward's and the pruning kernels' specs name the tensor's dtype (no GPU: the
    kernel is the spec it would load)."""
    from sparsegen.launch import runtime
    from sparsegen.semi24 import dispatch as sp24_dispatch

    monkeypatch.setattr(runtime, "device_arch", lambda device: 90)
    monkeypatch.setattr(runtime, "kernel", lambda spec, index: spec)
    sp24_dispatch.forward_kernel.cache_clear()
    sp24_dispatch.prune_kernel.cache_clear()
    try:
        forward = sp24_dispatch.forward_kernel(dtype, 0, None)
        prune = sp24_dispatch.prune_kernel("sp24_compress", dtype, 0)
    finally:
        sp24_dispatch.forward_kernel.cache_clear()
        sp24_dispatch.prune_kernel.cache_clear()
    assert (forward.op, forward.dtype) == ("sp24_dds", name)
    assert (prune.op, prune.dtype) == ("sp24_compress", name)


def test_transpose_kernel_refuses_a_weight_whose_transpose_has_no_2_4_form():
    """W^T [K, N] needs N a multiple of 32 (its rows' groups of 32) and the words of W [N, K]:
    refused before anything reaches a kernel."""
    from sparsegen.semi24 import ops as sp24_ops

    values, metadata = torch.zeros(48, 32), torch.zeros(3, 2, 16, dtype=torch.int32)  # W [48, 64]
    with pytest.raises(sparsegen.InputError, match="N a multiple of 32"):
        sp24_ops.sp24_transpose(values, metadata, 48)
    with pytest.raises(sparsegen.InputError, match="its metadata words"):
        sp24_ops.sp24_transpose(torch.zeros(64, 32), metadata, 64)
