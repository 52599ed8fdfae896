"""Block grids, shared by every block layout: a block shape's check and the grid of blocks a
weight's features make (with the nearest valid sizes when they do not divide)."""
from __future__ import annotations

import math

from .errors import expect, positive_int


def check_divisible(features: int, side: int, what: str) -> None:
    lower, upper = features // side * side, math.ceil(features / side) * side
    nearest = f"sizes are {lower} and {upper}" if lower > 0 else f"size is {upper}"
    expect(features % side == 0,
           f"{what} ({features}) to be a multiple of the block's {side}; nearest valid {nearest}",
           f"{features} % {side} = {features % side}")


def check_block(block) -> tuple[int, int]:
    """(rows, cols) of positive ints; the kernels' own limits are checked by their specs."""
    sides = tuple(block) if isinstance(block, (tuple, list)) else None
    expect(sides is not None and len(sides) == 2, "block as (rows, cols)", repr(block))
    return tuple(positive_int(side, "a block side") for side in sides)


def grid_shape(out_features: int, in_features: int, block: tuple[int, int]) -> tuple[int, int]:
    check_divisible(out_features, block[0], "out_features")
    check_divisible(in_features, block[1], "in_features")
    return out_features // block[0], in_features // block[1]
