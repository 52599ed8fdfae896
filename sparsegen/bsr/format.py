"""Block-CSR layout: a boolean block mask and the index tensors the kernels walk.

A weight W [N, K] with blocks [bm, bk] has a mask [N / bm, K / bk]. Its values are
stored as [nnz, bm, bk] in row-major mask order; row_offsets [N / bm + 1] and
col_indices [nnz] (int32) say where each block row's blocks are.
"""
from __future__ import annotations

import torch

from ..blocks import check_block, check_divisible, grid_shape  # noqa: F401 (this format's API)
from ..errors import expect


def random_mask(grid: tuple[int, int], density: float, generator=None) -> torch.Tensor:
    """density rounded to whole blocks, spread evenly over block rows (no row left empty
    unless density is 0), columns chosen at random within each row."""
    expect(0.0 <= density <= 1.0, "density in [0, 1]", density)
    rows, cols = grid
    total = round(density * rows * cols)
    if density > 0:
        total = max(total, rows)
    per_row = torch.full((rows,), total // rows, dtype=torch.long)
    per_row[torch.randperm(rows, generator=generator)[: total % rows]] += 1
    scores = torch.rand(rows, cols, generator=generator)
    ranks = scores.argsort(dim=1).argsort(dim=1)
    return ranks < per_row[:, None]


def check_mask(mask: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    expect(isinstance(mask, torch.Tensor) and mask.dtype == torch.bool,
           "layout to be a torch.bool tensor", getattr(mask, "dtype", type(mask)))
    expect(tuple(mask.shape) == tuple(grid), f"layout of shape {tuple(grid)} (out/bm, in/bk)",
           tuple(mask.shape))
    return mask.cpu().contiguous()


def indices(mask: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """row_offsets and col_indices (int32) of a block mask."""
    counts = mask.sum(dim=1)
    row_offsets = torch.zeros(mask.shape[0] + 1, dtype=torch.int32)
    row_offsets[1:] = counts.cumsum(0)
    col_indices = mask.nonzero()[:, 1].to(torch.int32)
    return row_offsets.to(device), col_indices.to(device)


def transposed(mask: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block-CSR index of W^T: its row_offsets and col_indices, and `perm` such that
    values[perm], each block transposed, are W^T's values in its own block order."""
    mask = mask.cpu()
    order = torch.full(mask.shape, -1, dtype=torch.long)
    order[mask] = torch.arange(int(mask.sum()))
    perm = order.t()[mask.t()]
    row_offsets, col_indices = indices(mask.t().contiguous(), device)
    return row_offsets, col_indices, perm.to(device)


def pair_index(row_offsets: torch.Tensor, col_indices: torch.Tensor, perm: torch.Tensor | None = None):
    """Block rows taken two at a time (matched by overlap_pairs; an odd one out pairs with
    an empty row past the end): per pair, the union of the two rows' columns, as a block-CSR
    index of its own (pair_offsets, cols); `halves` [union columns, 2] (int32): each row's
    stored block at that column - its position in the values, through `perm` when given -
    or -1 where the row has none; and `pair_rows` [pairs, 2] (int32): the two block rows.
    Reads the index on the host (once per layout: see ops)."""
    row_offsets, cols = row_offsets.cpu(), col_indices.long().cpu()
    rows, block_rows = stored_block_rows(row_offsets, cols.numel()), row_offsets.numel() - 1
    width = int(cols.max()) + 1 if cols.numel() else 1
    pair_rows = overlap_pairs(rows, cols, block_rows, width)
    pair_of, member = _pair_members(pair_rows)
    key = pair_of[rows] * width + cols
    order = torch.argsort(key, stable=True)
    union, item = torch.unique_consecutive(key[order], return_inverse=True)
    stored = order if perm is None else perm.long().cpu()[order]
    halves = torch.full((union.numel(), 2), -1, dtype=torch.int32)
    halves[item, member[rows[order]]] = stored.to(torch.int32)
    pair_offsets = torch.searchsorted(union // width, torch.arange(pair_rows.shape[0] + 1))  # first union column of each
    device = col_indices.device
    return (pair_offsets.to(torch.int32).to(device), (union % width).to(torch.int32).to(device),
            halves.to(device), pair_rows.to(torch.int32).to(device))


def stored_block_rows(row_offsets: torch.Tensor, stored: int) -> torch.Tensor:
    """Each stored block's block row, from the CSR row offsets (no host sync: `stored`, the
    number of stored blocks, is the output's size)."""
    rows = torch.arange(row_offsets.numel() - 1, device=row_offsets.device)
    return torch.repeat_interleave(rows, row_offsets.diff(), output_size=stored)


def block_slots(row_offsets: torch.Tensor, col_indices: torch.Tensor, block_cols: int) -> torch.Tensor:
    """Per block position of the grid (row-major), its stored block's index in the values,
    or -1 (int32): the inverse of flat_index."""
    block_rows = row_offsets.numel() - 1
    flat = stored_block_rows(row_offsets, col_indices.numel()) * block_cols + col_indices
    slot = torch.full((block_rows * block_cols,), -1, dtype=torch.int32, device=col_indices.device)
    slot[flat] = torch.arange(col_indices.numel(), dtype=torch.int32, device=slot.device)
    return slot


def _pair_members(pair_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block row (and the row past the end): its pair, and whether it is the pair's
    first (0) or second (1) row."""
    pair_of, member = torch.empty(pair_rows.numel(), dtype=torch.long), torch.empty(pair_rows.numel(), dtype=torch.long)
    pair_of[pair_rows.flatten()] = torch.arange(pair_rows.shape[0]).repeat_interleave(2)
    member[pair_rows.flatten()] = torch.tensor([0, 1]).repeat(pair_rows.shape[0])
    return pair_of, member


def overlap_pairs(rows: torch.Tensor, cols: torch.Tensor, n_rows: int, width: int, candidates: int = 16):
    """Block rows matched two by two, greedily by the columns they share, most first (over
    each row's `candidates` best partners; rows left over pair in order): a pair's kernel
    copies X once per column of the union, so sharing is what it saves. [ceil(n_rows / 2), 2]
    int64, each pair's lower row first, pairs by it; an odd one out pairs with n_rows (a row
    past the end). On random layouts at density 0.25 this cuts the union by 6% (64 x 172
    blocks) to 12% (172 x 64) against neighbouring rows."""
    mask = torch.zeros(n_rows, width)
    mask[rows, cols] = 1
    shared = (mask @ mask.T).fill_diagonal_(-1)
    best, partner = shared.topk(min(candidates, max(n_rows - 1, 1)), dim=1)
    order = torch.argsort(best.flatten(), descending=True, stable=True)
    free, pairs = [True] * n_rows, []
    for i, j in zip((order // best.shape[1]).tolist(), partner.flatten()[order].tolist()):
        if i != j and free[i] and free[j]:
            free[i] = free[j] = False
            pairs.append((min(i, j), max(i, j)))
    rest = [i for i in range(n_rows) if free[i]] + ([n_rows] if n_rows % 2 else [])
    pairs += list(zip(rest[::2], rest[1::2]))
    return torch.tensor(sorted(pairs), dtype=torch.long).reshape(-1, 2)


def transpose_values(values: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return values.index_select(0, perm).transpose(1, 2).contiguous()


def flat_index(mask: torch.Tensor, device=None) -> torch.Tensor:
    """For each stored block (row-major order), its position in the flattened block grid."""
    return mask.cpu().flatten().nonzero().squeeze(1).to(device)


def gather_blocks(dense: torch.Tensor, flat: torch.Tensor, block) -> torch.Tensor:
    """dense_to_values with a precomputed index: no data-dependent shapes (traceable)."""
    bm, bk = block
    return blocks_of(dense, block).reshape(-1, bm, bk).index_select(0, flat)


def scatter_blocks(values: torch.Tensor, flat: torch.Tensor, shape, block) -> torch.Tensor:
    """values_to_dense with a precomputed index."""
    (n, k), (bm, bk) = shape, block
    grid = values.new_zeros(n // bm * (k // bk), bm, bk).index_copy(0, flat, values)
    return grid.reshape(n // bm, k // bk, bm, bk).transpose(1, 2).reshape(n, k)


def blocks_of(dense: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[N, K] -> [N/bm, K/bk, bm, bk] view-like tensor of its blocks."""
    n, k = dense.shape
    bm, bk = block
    return dense.reshape(n // bm, bm, k // bk, bk).transpose(1, 2)


def dense_to_values(dense: torch.Tensor, mask: torch.Tensor, block) -> torch.Tensor:
    """The blocks of `dense` that `mask` keeps, in storage order: [nnz, bm, bk]."""
    return gather_blocks(dense, flat_index(mask, dense.device), block)


def values_to_dense(values: torch.Tensor, mask: torch.Tensor, block) -> torch.Tensor:
    """Boolean-mask version of scatter_blocks, kept as the tests' independent oracle."""
    rows, cols = mask.shape
    bm, bk = block
    grid = values.new_zeros(rows, cols, bm, bk)
    grid[mask.to(values.device)] = values
    return grid.transpose(1, 2).reshape(rows * bm, cols * bk)


def top_norm_mask(dense: torch.Tensor, block, density: float) -> torch.Tensor:
    """Keep the round(density * blocks) blocks of largest Frobenius norm."""
    expect(0.0 < density <= 1.0, "density in (0, 1]", density)
    norms = blocks_of(dense.detach().float(), block).pow(2).sum(dim=(2, 3)).cpu()
    keep = max(1, round(density * norms.numel()))
    mask = torch.zeros(norms.numel(), dtype=torch.bool)
    mask[norms.flatten().topk(keep).indices] = True
    return mask.reshape(norms.shape)
