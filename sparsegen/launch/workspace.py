"""Scratch memory of split-K launches: float32 partial sums and int32 tile counters.

Split-K kernels write each split's float32 partial sums to its own slice of `sums` and count
arrivals per tile in `counts`; the last split of a tile adds the slices in split order,
writes Y and puts its counter back to zero (templates/common/sg_split_k.cuh). Every split
writes its whole slice before any split reads it, so `sums` may hold anything between
launches; `counts` must be zeros, and is: zeroed once when allocated, and reset by the
kernels. Counters have a tensor of their own so that no launch of another shape finds its
counters where an earlier launch left sums.

One workspace per (device, stream): kernels on one stream run in order, so they never share
it at the same time (graphs replayed at once on two streams must not share one: capture
them on their own streams). It only grows, and a smaller one it replaces is kept: a CUDA
graph captured earlier still points into it.
"""
from __future__ import annotations

import dataclasses

import torch

from .memory import allocating


@dataclasses.dataclass(frozen=True)
class SplitWorkspace:
    sums: torch.Tensor    # float32, a slice of M x N per split; any contents between launches
    counts: torch.Tensor  # int32 arrival counters, one per output tile; zeros between launches
    sizes: tuple[int, int] = dataclasses.field(init=False)  # (sums, counts) elements, read per launch

    def __post_init__(self):
        object.__setattr__(self, "sizes", (self.sums.numel(), self.counts.numel()))

    def holds(self, floats: int, counters: int) -> bool:
        return self.sizes[0] >= floats and self.sizes[1] >= counters


_WORKSPACES: dict[tuple[int, int], list[SplitWorkspace]] = {}


def held(device: torch.device, stream: int, floats: int, counters: int, allocate) -> SplitWorkspace:
    """A workspace on `device` for `stream` of at least `floats` sums and `counters` zeroed
    counters; `allocate(n, dtype, device)` makes a zeroed tensor (outside any CUDA graph's
    memory pool: see semi24.ops)."""
    kept = _WORKSPACES.setdefault((device.index or 0, stream), [])
    if kept and kept[-1].holds(floats, counters):
        return kept[-1]
    return _grown(kept, device, floats, counters, allocate)


def kept_for(device_index: int, stream: int, floats: int, counters: int) -> SplitWorkspace | None:
    """held's answer where the workspace kept already holds this much, else None (then call
    held): a planned launch's lookup, without a torch.device."""
    kept = _WORKSPACES.get((device_index, stream))
    if kept:
        sizes = kept[-1].sizes
        if sizes[0] >= floats and sizes[1] >= counters:
            return kept[-1]
    return None


def _grown(kept: list, device: torch.device, floats: int, counters: int, allocate) -> SplitWorkspace:
    # doubling: few generations kept
    floats = max(floats, 2 * kept[-1].sums.numel() if kept else 0)
    counters = max(counters, 2 * kept[-1].counts.numel() if kept else 0)
    with allocating("a split-K workspace (float32 partial sums, int32 tile counters)", 4 * (floats + counters)):
        kept.append(SplitWorkspace(allocate(floats, torch.float32, device), allocate(counters, torch.int32, device)))
    return kept[-1]


def current(device: torch.device, stream: int) -> SplitWorkspace | None:
    """The workspace kept for (device, stream), if any."""
    kept = _WORKSPACES.get((device.index or 0, stream))
    return kept[-1] if kept else None
