"""Block-ELL layout: W [N, K] in blocks [bm, bk], each of the N / bm block rows keeping the
same number of blocks, `per_row`. The values are [N / bm, per_row, bm, bk] and the index is
cols [N / bm, per_row] (int32, each row's block columns in increasing order). No row
offsets: where a row starts is arithmetic, and every row is the same amount of work.
"""
from __future__ import annotations

import torch

from ..blocks import check_block, grid_shape  # noqa: F401 (this format's API)
from ..errors import expect, fraction, positive_int

INDEX_DTYPE = torch.int32


def check_per_row(per_row, grid: tuple[int, int], density: float = 0.5) -> int:
    """per_row, or (None) round(density x block columns), at least one."""
    if per_row is None:
        per_row = max(1, round(fraction(density, "density", zero=False) * grid[1]))
    per_row = positive_int(per_row, "per_row (blocks in each block row)")
    expect(per_row <= grid[1], f"per_row at most the {grid[1]} block columns", per_row)
    return per_row


def random_cols(grid: tuple[int, int], per_row: int, generator=None) -> torch.Tensor:
    """per_row distinct block columns in each block row, drawn at random, sorted."""
    scores = torch.rand(grid, generator=generator)
    return scores.topk(per_row, dim=1).indices.sort(dim=1).values.to(INDEX_DTYPE)


def top_norm_cols(weight: torch.Tensor, block: tuple[int, int], per_row: int) -> torch.Tensor:
    """In each block row, the per_row blocks of `weight` with the largest Frobenius norm."""
    norms = _blocks(weight.detach().float(), block).norm(dim=(2, 3))
    return norms.topk(per_row, dim=1).indices.sort(dim=1).values.cpu().to(INDEX_DTYPE)


def check_cols(cols, grid: tuple[int, int], per_row: int) -> torch.Tensor:
    """An index from anywhere (a caller, a checkpoint) before any kernel reads it: an integer
    tensor [rows, per_row], every entry a block column, increasing along each row (so no
    block is stored twice). Returns it as contiguous int32 on the CPU."""
    expect(isinstance(cols, torch.Tensor) and not cols.is_floating_point() and not cols.is_complex()
           and cols.dtype != torch.bool, "cols as an integer tensor", getattr(cols, "dtype", type(cols).__name__))
    expect(tuple(cols.shape) == (grid[0], per_row), f"cols of shape {(grid[0], per_row)} (block rows, per_row)",
           tuple(cols.shape))
    cols = cols.detach().cpu().long()
    expect(cols.numel() == 0 or (int(cols.min()) >= 0 and int(cols.max()) < grid[1]),
           f"block columns in [0, {grid[1]})", f"[{int(cols.min())}, {int(cols.max())}]" if cols.numel() else "none")
    expect(bool((cols[:, 1:] > cols[:, :-1]).all()), "each row's block columns increasing (no repeats)",
           "a row out of order or repeating a column")
    return cols.to(INDEX_DTYPE).contiguous()


def _blocks(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] as [N / bm, K / bk, bm, bk]."""
    (n, k), (bm, bk) = weight.shape, block
    return weight.reshape(n // bm, bm, k // bk, bk).transpose(1, 2)


def to_dense(values: torch.Tensor, cols: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The dense W [N, K] of stored blocks `values` (zeros elsewhere): the CPU reference,
    differentiable and traceable (static shapes)."""
    rows, per_row, bm, bk = values.shape
    grid = (shape[0] // bm, shape[1] // bk)
    dense = values.new_zeros(grid[0], grid[1], bm, bk)
    index = cols.to(values.device).long()[:, :, None, None].expand(rows, per_row, bm, bk)
    dense = dense.scatter(1, index, values)
    return dense.transpose(1, 2).reshape(shape)
