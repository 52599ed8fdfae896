"""Block-diagonal layout: W [N, K] holds `nblocks` dense blocks [N / nblocks, K / nblocks] on
its diagonal, zeros elsewhere. Stored as the layout kit's tiles: values [N / bm, rowblocks,
bm, bk], block row r lying in diagonal block r // diagrows, where rowblocks = (K / nblocks)
/ bk and diagrows = (N / nblocks) / bm. Nothing else is stored: a tile's column is arithmetic.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..blocks import check_divisible
from ..errors import expect, positive_int

SIDES = (64, 32, 16)  # tile sides tried, largest first (the kernels' BLOCK_SIDES that pay)


class Shape(NamedTuple):
    nblocks: int
    block: tuple[int, int]   # the kernel's tile (bm, bk)
    rowblocks: int           # tiles in a block row: (K / nblocks) / bk
    diagrows: int            # block rows in a diagonal block: (N / nblocks) / bm


def plan_shape(out_features: int, in_features: int, nblocks, block=None) -> Shape:
    """The tiling of a block-diagonal [out, in] weight of `nblocks` blocks: `block` or the
    largest tile sides of SIDES that divide the diagonal blocks."""
    nblocks = positive_int(nblocks, "nblocks (diagonal blocks)")
    check_divisible(out_features, nblocks, "out_features", "nblocks")
    check_divisible(in_features, nblocks, "in_features", "nblocks")
    n, k = out_features // nblocks, in_features // nblocks
    block = tuple(block) if block is not None else (_largest_side(n, "out_features"), _largest_side(k, "in_features"))
    expect(len(block) == 2 and all(side in SIDES or side == 128 for side in block),
           "block sides each one of (16, 32, 64, 128)", repr(block))
    check_divisible(n, block[0], "a diagonal block's rows (out_features / nblocks)", "the block's rows")
    check_divisible(k, block[1], "a diagonal block's columns (in_features / nblocks)", "the block's columns")
    return Shape(nblocks, block, k // block[1], n // block[0])


def _largest_side(size: int, what: str) -> int:
    sides = [side for side in SIDES if size % side == 0]
    expect(bool(sides), f"{what} / nblocks a multiple of 16", size)
    return sides[0]


def tile(blocks: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Diagonal blocks [nblocks, n, k] as the kit's values [N / bm, rowblocks, bm, bk]."""
    nb, n, k = blocks.shape
    bm, bk = block
    tiles = blocks.reshape(nb, n // bm, bm, k // bk, bk).permute(0, 1, 3, 2, 4)
    return tiles.reshape(nb * (n // bm), k // bk, bm, bk)


def untile(values: torch.Tensor, nblocks: int) -> torch.Tensor:
    """The kit's values [N / bm, rowblocks, bm, bk] as diagonal blocks [nblocks, n, k]."""
    rows, rowblocks, bm, bk = values.shape
    diagrows = rows // nblocks
    blocks = values.reshape(nblocks, diagrows, rowblocks, bm, bk).permute(0, 1, 3, 2, 4)
    return blocks.reshape(nblocks, diagrows * bm, rowblocks * bk)


def to_dense(values: torch.Tensor, nblocks: int) -> torch.Tensor:
    """The dense W [N, K] (zeros off the diagonal blocks): differentiable, traceable."""
    return torch.block_diag(*untile(values, nblocks).unbind(0))


def diagonal_of(weight: torch.Tensor, nblocks: int) -> torch.Tensor:
    """The diagonal blocks [nblocks, n, k] of a dense [N, K] weight."""
    n, k = weight.shape[0] // nblocks, weight.shape[1] // nblocks
    return torch.stack([weight[d * n:(d + 1) * n, d * k:(d + 1) * k] for d in range(nblocks)])


def transposed(values: torch.Tensor, nblocks: int) -> torch.Tensor:
    """The tiles of W^T (block-diagonal, blocks transposed; tile (bk, bm))."""
    bm, bk = values.shape[2:]
    return tile(untile(values, nblocks).transpose(1, 2), (bk, bm))
