"""Block-CSR layouts: random masks, index tensors, dense <-> values, top-norm pruning."""
import itertools

import pytest
import torch

import sparsegen
from sparsegen.bsr import format as bsr

GRIDS = [(1, 1), (1, 9), (7, 13), (5, 3), (16, 16)]
DENSITIES = [0.0, 0.01, 0.13, 0.5, 0.77, 1.0]


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("density", DENSITIES)
def test_random_mask_rounds_density_to_whole_blocks(grid, density):
    rows, cols = grid
    mask = bsr.random_mask(grid, density)
    assert mask.dtype == torch.bool and tuple(mask.shape) == grid
    wanted = round(density * rows * cols)
    if density > 0:
        wanted = max(wanted, rows)  # every block row keeps at least one block
    assert int(mask.sum()) == wanted


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("density", DENSITIES[1:])
def test_random_mask_rows_are_balanced_and_never_empty(grid, density):
    per_row = bsr.random_mask(grid, density).sum(dim=1)
    assert per_row.min() >= 1
    assert per_row.max() - per_row.min() <= 1


def test_random_mask_follows_its_generator():
    draw = lambda seed: bsr.random_mask((9, 11), 0.4, torch.Generator().manual_seed(seed))
    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4))


def test_random_mask_spreads_over_columns():
    # Over many draws every column of a row must be picked sometimes (no fixed pattern).
    hits = sum(bsr.random_mask((4, 10), 0.3).int() for _ in range(200))
    assert (hits > 0).all()


@pytest.mark.parametrize("density", [-0.1, 1.5, float("nan")])
def test_random_mask_rejects_bad_density(density):
    with pytest.raises(sparsegen.InputError, match="Expected density"):
        bsr.random_mask((4, 4), density)


def mask_with_empty_rows(rows=9, cols=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, cols, generator=g) < 0.4
    mask[0] = False
    mask[rows // 2] = False
    mask[-1] = True
    return mask


def test_indices_describe_the_mask():
    mask = mask_with_empty_rows()
    row_offsets, col_indices = bsr.indices(mask)
    assert row_offsets.dtype == col_indices.dtype == torch.int32
    assert row_offsets[0] == 0 and row_offsets[-1] == mask.sum() == len(col_indices)
    rebuilt = torch.zeros_like(mask)
    for r in range(mask.shape[0]):
        cols = col_indices[row_offsets[r]:row_offsets[r + 1]].long()
        assert torch.all(cols[1:] > cols[:-1])  # sorted, no repeats
        rebuilt[r, cols] = True
    assert torch.equal(rebuilt, mask)


def test_indices_of_an_empty_mask():
    row_offsets, col_indices = bsr.indices(torch.zeros(3, 4, dtype=torch.bool))
    assert row_offsets.tolist() == [0, 0, 0, 0] and col_indices.numel() == 0


def brute_force_values(dense, mask, block):
    bm, bk = block
    return torch.stack([dense[r * bm:(r + 1) * bm, c * bk:(c + 1) * bk]
                        for r, c in itertools.product(*map(range, mask.shape)) if mask[r, c]])


@pytest.mark.parametrize("block", [(3, 5), (1, 7), (6, 1), (16, 32)], ids=str)
def test_dense_values_round_trip(block):
    mask = mask_with_empty_rows(5, 4, seed=block[0])
    dense = torch.randn(5 * block[0], 4 * block[1], dtype=torch.float64)
    values = bsr.dense_to_values(dense, mask, block)
    assert torch.equal(values, brute_force_values(dense, mask, block))
    keep = mask.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    assert torch.equal(bsr.values_to_dense(values, mask, block), dense * keep)
    assert torch.equal(bsr.dense_to_values(bsr.values_to_dense(values, mask, block), mask, block),
                       values)


def brute_force_top_blocks(dense, block, density):
    bm, bk = block
    rows, cols = dense.shape[0] // bm, dense.shape[1] // bk
    norms = {(r, c): dense[r * bm:(r + 1) * bm, c * bk:(c + 1) * bk].double().norm().item()
             for r in range(rows) for c in range(cols)}
    keep = max(1, round(density * rows * cols))
    return set(sorted(norms, key=norms.get, reverse=True)[:keep])


@pytest.mark.parametrize("density", [0.01, 0.25, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_top_norm_mask_keeps_the_largest_blocks(density, dtype):
    block = (4, 6)
    dense = torch.randn(7 * block[0], 5 * block[1]).to(dtype)
    mask = bsr.top_norm_mask(dense, block, density)
    assert set(map(tuple, mask.nonzero().tolist())) == brute_force_top_blocks(dense, block, density)


def test_top_norm_mask_rejects_bad_density():
    with pytest.raises(sparsegen.InputError, match="Expected density"):
        bsr.top_norm_mask(torch.randn(8, 8), (4, 4), 0.0)


@pytest.mark.parametrize("which", ["out_features", "in_features"])
@pytest.mark.parametrize("features, side", [(100, 32), (33, 16), (130, 64)])
def test_grid_shape_names_the_multiple_needed(which, features, side):
    sizes = {"out_features": 2 * side, "in_features": 2 * side, which: features}
    with pytest.raises(sparsegen.InputError) as info:
        bsr.grid_shape(sizes["out_features"], sizes["in_features"], (side, side))
    lower, upper = features // side * side, -(-features // side) * side
    message = str(info.value)
    side_name = "rows" if which == "out_features" else "columns"
    assert f"{which} ({features})" in message and f"multiple of the block's {side_name} ({side})" in message
    assert f"{lower} and {upper}" in message


def test_features_smaller_than_the_block_suggest_only_the_block():
    with pytest.raises(sparsegen.InputError, match="nearest valid size is 16") as info:
        bsr.grid_shape(15, 32, (16, 16))
    assert " 0 " not in str(info.value)


def test_check_mask_rejects_wrong_shape_and_dtype():
    with pytest.raises(sparsegen.InputError, match=r"layout of shape \(3, 4\).*Got \(4, 3\)"):
        bsr.check_mask(torch.ones(4, 3, dtype=torch.bool), (3, 4))
    with pytest.raises(sparsegen.InputError, match="torch.bool.*Got torch.int64"):
        bsr.check_mask(torch.ones(3, 4, dtype=torch.long), (3, 4))


@pytest.mark.parametrize("group", [1, 2, 4])
def test_sdd_work_items_cover_every_stored_block_once(group):
    """The Hopper dW kernel's work items: each starts at a stored block and takes the next
    ones of the same block row, up to `group` (the kernel's own rule, modelled here); the
    padded list from sdd_item_starts must cover every stored block exactly once."""
    from sparsegen.bsr import ops as bsr_ops

    torch.manual_seed(group)
    for _ in range(50):
        rows, cols = torch.randint(1, 9, (2,)).tolist()
        flat = bsr.flat_index(torch.rand(rows, cols) < torch.rand(()))
        starts = bsr_ops.sdd_item_starts(flat, cols, rows, group)
        covered = []
        for start in starts.tolist():
            if start < 0:
                continue
            run = 0
            while run < group and start + run < flat.numel() and flat[start + run] // cols == flat[start] // cols:
                run += 1
            covered += range(start, start + run)
        assert sorted(covered) == list(range(flat.numel()))


@pytest.mark.parametrize("grid", [(5, 7), (6, 1), (1, 4), (4, 9), (9, 12)])
@pytest.mark.parametrize("transpose", [False, True])
def test_pair_index_lists_each_pairs_union_and_its_blocks(grid, transpose):
    """bsr.pair_index (the pairs kernel's walk) against a plain loop: the pairs cover every
    block row once (an odd one out with the row past the end); per pair, every column
    either row has, once, in order, with each row's stored block there (through perm for
    W^T's index) or -1."""
    mask = torch.rand(grid) < 0.4
    mask[min(1, grid[0] - 1)] = False  # an empty row
    if transpose:
        row_offsets, col_indices, perm = bsr.transposed(mask)
        rows_mask = mask.t()
    else:
        (row_offsets, col_indices), perm, rows_mask = bsr.indices(mask), None, mask
    stored = {}  # (row, col) -> the values' index of that block
    for r in range(rows_mask.shape[0]):
        for i in range(int(row_offsets[r]), int(row_offsets[r + 1])):
            stored[r, int(col_indices[i])] = int(perm[i]) if perm is not None else i
    pair_offsets, cols, halves, pair_rows = bsr.pair_index(row_offsets, col_indices, perm)
    n = rows_mask.shape[0]
    assert sorted(pair_rows.flatten().tolist()) == list(range(n + n % 2))
    assert pair_offsets.numel() == pair_rows.shape[0] + 1
    for p, rows in enumerate(pair_rows.tolist()):
        span = range(int(pair_offsets[p]), int(pair_offsets[p + 1]))
        union = sorted({c for (r, c) in stored if r in rows})
        assert [int(cols[i]) for i in span] == union
        for i, c in zip(span, union):
            assert halves[i].tolist() == [stored.get((r, c), -1) for r in rows]


def test_overlap_pairs_matches_the_rows_that_share_most():
    """Rows 0 and 3 share four columns, 1 and 2 three; neighbours share none. A fifth row
    with nothing in common pairs with the row past the end."""
    mask = torch.zeros(5, 8, dtype=torch.bool)
    mask[0, :4] = mask[3, :4] = True
    mask[1, 4:7] = mask[2, 4:7] = True
    mask[4, 7] = True
    rows, cols = mask.nonzero().unbind(1)
    assert bsr.overlap_pairs(rows, cols, 5, 8).tolist() == [[0, 3], [1, 2], [4, 5]]


@pytest.mark.parametrize("grid", [(5, 7), (1, 1), (6, 3)])
def test_block_slots_inverts_flat_index(grid):
    """bsr.block_slots (the scatter kernel's map): each stored block's position names its
    index in the values, every other position -1; an empty row too."""
    mask = torch.rand(grid) < 0.5
    mask[0] = False
    row_offsets, col_indices = bsr.indices(mask)
    slot = bsr.block_slots(row_offsets, col_indices, grid[1])
    want = torch.full((mask.numel(),), -1, dtype=torch.int32)
    want[bsr.flat_index(mask)] = torch.arange(int(mask.sum()), dtype=torch.int32)
    assert torch.equal(slot, want)
