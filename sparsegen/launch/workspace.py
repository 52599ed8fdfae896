"""Scratch memory that kernels hand back as they found it: all zeros.

Split-K kernels write each split's float32 partial sums to its own slice of a workspace and
count arrivals per tile; the last split of a tile adds the slices in order, writes Y and
zeroes the slices and its count again (templates/sg_split_k.cuh). So the workspace is zeroed
once, when it is allocated, and never by a launch of its own.

One workspace per (device, stream): kernels on one stream run in order, so they never share
it at the same time (graphs replayed at once on two streams must not share one: capture
them on their own streams). It only grows, and a smaller one it replaces is kept: a CUDA
graph captured earlier still points into it.
"""
from __future__ import annotations

import torch

from .memory import allocating

_WORKSPACES: dict[tuple[int, int], list[torch.Tensor]] = {}


def zeroed(device: torch.device, stream: int, floats: int, allocate) -> torch.Tensor:
    """A float32 workspace of at least `floats` zeros on `device` for `stream`; `allocate(n,
    device)` makes a new one (outside any CUDA graph's memory pool: see ops)."""
    held = _WORKSPACES.setdefault((device.index or 0, stream), [])
    if held and held[-1].numel() >= floats:
        return held[-1]
    size = max(floats, 2 * held[-1].numel() if held else 0)  # doubling: few generations kept
    with allocating("a split-K workspace (float32 partial sums)", 4 * size):
        held.append(allocate(size, device))
    return held[-1]


def current(device: torch.device, stream: int) -> torch.Tensor | None:
    """The workspace kept for (device, stream), if any."""
    held = _WORKSPACES.get((device.index or 0, stream))
    return held[-1] if held else None
