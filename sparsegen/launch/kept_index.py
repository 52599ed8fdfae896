"""Copies of index tensors, to tell a rewrite with the same values from a real change.

DistributedDataParallel's default (broadcast_buffers=True) rewrites every buffer in place
before each forward, with the values it already has: each index's version moves, its
address stays. What a layer derived from an index (calls.per_layout, the 2:4 transposable
answer) stays valid then; a load or an edit in place changes the values and needs deriving
again. Comparing each index with its copy when its layer runs cost a host sync per layer
and step; here the first check after a rewrite compares every moved index at once (one
sync per device), and the later layers of that step find theirs verified.

Each copy is a generation: what was derived holds the generation it was derived against,
and stays valid while that generation is still the index's (a real change ends it).
"""
from __future__ import annotations

import functools
import itertools

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import outside_graphs


class Generation:
    """An index's values as copied (`copy`), and the (address, version) at which the index
    last held them."""

    __slots__ = ("copy", "stamp")

    def __init__(self, copy: torch.Tensor, stamp: tuple[int, int]):
        self.copy, self.stamp = copy, stamp


_GENERATIONS = WeakIdKeyDictionary()  # index tensor -> its current Generation


def stamp_of(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t._version


def generation(t: torch.Tensor) -> Generation:
    """t's current generation, a copy of it made now where its values are not the kept ones
    (the copy outside any CUDA graph's memory pool: it outlives the call)."""
    kept = current(t)
    if kept is None:
        copy = outside_graphs.run(_copy, (t,), t.device)
        kept = _GENERATIONS[t] = Generation(copy, stamp_of(t))
    return kept


def current(t: torch.Tensor) -> Generation | None:
    """t's generation if t still holds its values (checked, with every other index a rewrite
    moved, where t's version moved), else None. During a CUDA graph capture nothing can be
    read: None where t moved."""
    kept = _GENERATIONS.get(t)
    if kept is None or kept.stamp == stamp_of(t):
        return kept
    if kept.stamp[0] != t.data_ptr() or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    _check_every_moved_index()
    return _GENERATIONS.get(t)


def _check_every_moved_index() -> None:
    """Each moved index at its old address compared with its copy, one sync per device: equal
    ones keep their generation at their new version, the others lose it."""
    moved = [(t, kept) for t, kept in list(_GENERATIONS.items()) if kept.stamp != stamp_of(t)]
    for t, kept in moved:
        if not _comparable(t, kept):
            del _GENERATIONS[t]
    comparable = [(t, kept) for t, kept in moved if _comparable(t, kept)]
    for device in {t.device for t, _ in comparable}:
        here = [(t, kept) for t, kept in comparable if t.device == device]
        for (t, kept), changed in zip(here, _differing(here)):
            if changed:
                del _GENERATIONS[t]
            else:
                kept.stamp = stamp_of(t)


def _differing(pairs: list[tuple[torch.Tensor, Generation]]) -> list[bool]:
    """Whether each index (on one device) differs from its copy, in a few launches whatever
    their number: every index and every copy as bytes in one vector each, compared at once,
    the differing bytes counted per index from a running sum. (One by one, a DDP step's
    check took two launches per index, each paid in host time: the block-sparse
    Llama-1B-shaped model's step moves 66 buffers.)"""
    now = torch.cat([_bytes(t) for t, _ in pairs])
    then = torch.cat([_bytes(kept.copy) for _, kept in pairs])
    running = torch.cat([now.new_zeros(1, dtype=torch.int64), (now != then).cumsum(0)])
    starts, ends = _bounds(tuple(t.numel() * t.element_size() for t, _ in pairs), now.device)
    return (running[ends] != running[starts]).tolist()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@functools.lru_cache(maxsize=64)  # a DDP step moves the same indices every time: their bounds once
def _bounds(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, end) byte offsets of each of these consecutive sizes, as index tensors on device."""
    ends = list(itertools.accumulate(sizes))
    starts = [end - size for end, size in zip(ends, sizes)]
    return (torch.tensor(starts, dtype=torch.int64).to(device), torch.tensor(ends, dtype=torch.int64).to(device))


def _comparable(t: torch.Tensor, kept: Generation) -> bool:
    copy = kept.copy
    return kept.stamp[0] == t.data_ptr() and t.shape == copy.shape and t.dtype == copy.dtype and t.device == copy.device


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()
