"""Block grids, shared by every block layout: a block shape's check and the grid of blocks a
weight's features make (with the nearest valid sizes when they do not divide)."""
from __future__ import annotations

import math

from .errors import expect, positive_int
from .jit.spec import BLOCK_SIDES


def check_divisible(count: int, divisor: int, what: str, divisor_name: str) -> None:
    """`what` (count) a multiple of `divisor_name` (divisor), else an InputError naming both
    and the nearest valid counts."""
    lower, upper = count // divisor * divisor, math.ceil(count / divisor) * divisor
    nearest = f"sizes are {lower} and {upper}" if lower > 0 else f"size is {upper}"
    expect(count % divisor == 0,
           f"{what} ({count}) to be a multiple of {divisor_name} ({divisor}); nearest valid {nearest}",
           f"{count} % {divisor} = {count % divisor}")


def check_block(block) -> tuple[int, int]:
    """(rows, cols), each a side the kernels take (BLOCK_SIDES): the one check the layers,
    `precompile` and `tune` share (KernelSpec's), so the CPU path refuses what the GPU would."""
    sides = tuple(block) if isinstance(block, (tuple, list)) else None
    expect(sides is not None and len(sides) == 2, "block as (rows, cols)", repr(block))
    sides = tuple(positive_int(side, "a block side") for side in sides)
    expect(all(side in BLOCK_SIDES for side in sides), f"block sides each one of {BLOCK_SIDES}", repr(block))
    return sides


def grid_shape(out_features: int, in_features: int, block: tuple[int, int]) -> tuple[int, int]:
    check_divisible(out_features, block[0], "out_features", "the block's rows")
    check_divisible(in_features, block[1], "in_features", "the block's columns")
    return out_features // block[0], in_features // block[1]
