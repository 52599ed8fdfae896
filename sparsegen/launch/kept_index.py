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

A layer whose forward needs no answer yet (a 2:4 layer reads its transposable answer in the
backward) calls start_check: the comparison is launched then and its answers copied to host
memory behind an event, so the backward reads them without waiting for the GPU. (The sync
held a 2:4 MLP's first backward for 1.3 ms of a DDP step on the H100 host, torch.profiler.)
"""
from __future__ import annotations

import functools
import itertools
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import outside_graphs


class Generation:
    """An index's values as copied (`copy`), and the (address, version) at which the index
    last held them."""

    __slots__ = ("copy", "stamp", "__weakref__")

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
    if kept.stamp[0] != t.data_ptr() or _capturing(t):
        return None
    _settle(t.device)
    if _GENERATIONS.get(t) is kept and kept.stamp != stamp_of(t):  # (moved after the started check)
        _check_every_moved_index()
    return _GENERATIONS.get(t)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class _Started:
    """A comparison launched before its answers are needed: each index with the stamp it had
    and the generation it was compared with (both weakly: a started check keeps no layer's
    memory), the answers ("differs") in host memory, and the event after which they hold
    (None on the CPU: they hold at once)."""

    __slots__ = ("indices", "answers", "done", "stamps")

    def __init__(self, pairs: list, answers: torch.Tensor, done):
        self.indices = [(weakref.ref(t), stamp_of(t), weakref.ref(kept)) for t, kept in pairs]
        self.answers, self.done = answers, done
        self.stamps = {id(t): stamp_of(t) for t, _ in pairs}


_STARTED: dict[torch.device, _Started] = {}  # at most one per device: the latest


def start_check(t: torch.Tensor) -> None:
    """Where t moved since its copy, launch the comparison of every moved index on its device
    now and let current() read the answers later; nothing where t has not moved, a started
    check already covers t as it is, or a CUDA graph is being captured. (Every compiled 2:4
    forward calls it: with no index kept at all, as in 2:4 inference, it returns at once.)"""
    if not _GENERATIONS:
        return
    kept = _GENERATIONS.get(t)
    if kept is None or kept.stamp == stamp_of(t) or _capturing(t):
        return
    started = _STARTED.get(t.device)
    if started is not None and started.stamps.get(id(t)) == stamp_of(t):
        return
    pairs = [(x, k) for x, k in list(_GENERATIONS.items())
             if x.device == t.device and k.stamp != stamp_of(x) and _comparable(x, k)]
    if pairs:
        _STARTED[t.device] = _Started(pairs, *_answers_in_host_memory(_differing_on_device(pairs)))


def _answers_in_host_memory(differs: torch.Tensor) -> tuple[torch.Tensor, object]:
    if not differs.is_cuda:
        return differs, None
    answers = torch.empty(differs.shape, dtype=torch.bool, pin_memory=True)
    answers.copy_(differs, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(differs.device))  # (the stream the copy went on, whatever device is current)
    return answers, done


def _settle(device: torch.device) -> None:
    """The started check's answers taken (waiting for its event, long passed where a forward
    started it), for each index that still holds the stamp and generation it was compared at."""
    started = _STARTED.pop(device, None)
    if started is None:
        return
    if started.done is not None:
        started.done.synchronize()
    for (index_ref, stamp, kept_ref), differs in zip(started.indices, started.answers.tolist()):
        t, kept = index_ref(), kept_ref()
        if t is None or kept is None or stamp_of(t) != stamp or _GENERATIONS.get(t) is not kept:
            continue  # gone, or moved again since: a later check decides
        if differs:
            del _GENERATIONS[t]
        else:
            kept.stamp = stamp


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
    return _differing_on_device(pairs).tolist()


def _differing_on_device(pairs: list[tuple[torch.Tensor, Generation]]) -> torch.Tensor:
    """_differing's answers as a bool tensor on the indices' device (no sync)."""
    now = torch.cat([_bytes(t) for t, _ in pairs])
    then = torch.cat([_bytes(kept.copy) for _, kept in pairs])
    running = torch.cat([now.new_zeros(1, dtype=torch.int64), (now != then).cumsum(0)])
    starts, ends = _bounds(tuple(t.numel() * t.element_size() for t, _ in pairs), now.device)
    return running[ends] != running[starts]


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
