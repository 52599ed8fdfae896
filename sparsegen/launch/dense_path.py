"""The dense path: cuBLAS on a dense copy of a sparse layer's weight, where this GPU's
crossover table (crossovers.py) says the sparse kernel would lose at the call's shape and
token count - small layers, few tokens, high densities.

The copy is built on the first call that wants it and kept while the weight stays as it
is (data pointer and version). A weight that keeps changing is being trained: after
TRAINED_AFTER changes the layer stops keeping a copy and runs its sparse kernels (a copy
rebuilt every step would cost more than it saves). The copy costs memory: the weight's
dense size, per layer that takes this path (`held_bytes`), so the path is off unless asked
for (SPARSEGEN_DENSE_FALLBACK=1): a sparse layer keeps its memory saving by default.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import crossovers, outside_graphs, runtime
from .memory import allocating
from .. import env

TRAINED_AFTER = 2
_enabled = [True]


@contextlib.contextmanager
def disabled():
    """Every call takes the sparse kernels (sparsegen tune measures them this way)."""
    _enabled.append(False)
    try:
        yield
    finally:
        _enabled.pop()


def wanted(layout: str, device_index: int, n: int, k: int, m: int, block=(0, 0), density: float = 1.0) -> bool:
    """Whether a call of this shape should take the dense path (decided once per launch plan)."""
    if not (_enabled[-1] and env.dense_fallback()):
        return False
    return crossovers.dense_wins(runtime.device_name(device_index), layout, n, k, m, block, density)


@dataclass
class _Copy:
    stamp: tuple[int, int]          # the weight's (data pointer, version) when built
    weight: torch.Tensor | None     # None: the weight is being trained
    changes: int
    captured: torch.Tensor | None = None  # the copy a CUDA graph reads: never freed, rebuilt in place


_COPIES = WeakIdKeyDictionary()  # a layout's key tensor (its index or metadata) -> _Copy
# values -> (its _Copy, build, inputs), for copies a graph reads: rebuilt after optimizer steps
_AFTER_STEP = WeakIdKeyDictionary()


def copy_of(key: torch.Tensor, values: torch.Tensor, build, *inputs) -> torch.Tensor | None:
    """The dense weight build(*inputs) makes from `values`, kept per layout while `values` stays
    the same; None once the weight has been seen changing (trained), inside a CUDA graph
    capture with no current copy (the capture then records the sparse kernels), or for values
    that are not a layer's parameter: a cast made per call (autocast) can come back at the same
    address and version with other contents, so a copy keyed by it would go stale.

    A copy a graph captured stays where it is for good (the graph reads that memory): a call
    that finds its weight changed rebuilds it in place, and so does every optimizer step over
    the weight - recorded into a captured training step too - so an eval graph replayed after
    training steps reads the trained weight."""
    if not isinstance(values, torch.nn.Parameter):
        return None  # a temporary (an autocast cast): its pointer and version do not follow the weight
    stamp, entry = (values.data_ptr(), values._version), _COPIES.get(key)
    if key.is_cuda and torch.cuda.is_current_stream_capturing():
        return _captured(entry, stamp, values, build, inputs)
    if entry is not None and entry.stamp == stamp:
        return entry.weight
    changes = 0 if entry is None else entry.changes + 1
    captured = None if entry is None else entry.captured
    if captured is not None:  # a graph reads it: rebuilt where it is, even once trained
        with torch.no_grad():
            captured.copy_(_built(build, inputs, values, key.device))
    weight = None if changes >= TRAINED_AFTER else captured if captured is not None else \
        _built(build, inputs, values, key.device)
    if entry is None:  # (written once the copy exists: a failed build leaves no entry)
        _COPIES[key] = _Copy(stamp, weight, changes)
    else:  # (updated in place: the optimizer hook holds the entry of a captured copy)
        entry.stamp, entry.weight, entry.changes = stamp, weight, changes
    return weight


_CUBLAS_READY = threading.local()


def _cublas_ready(device: torch.device) -> None:
    """This thread's cuBLAS handle for `device`, created now, outside any capture: a warm-up
    call may run the sparse kernel while the captured call takes cuBLAS on this copy, and
    cuBLAS cannot create its handle inside a capture (CUBLAS_STATUS_NOT_INITIALIZED)."""
    ready = _CUBLAS_READY.__dict__.setdefault("devices", set())
    if device.index not in ready:
        with torch.cuda.device(device):
            torch.cuda.current_blas_handle()
        ready.add(device.index)


def _captured(entry: _Copy | None, stamp, values, build, inputs: tuple) -> torch.Tensor | None:
    """Inside a capture: the current copy, if there is one, marked as read by a graph."""
    if entry is None or entry.stamp != stamp or entry.weight is None:
        return None
    if entry.captured is None:
        entry.captured = entry.weight
        _AFTER_STEP[values] = (entry, build, inputs)
        _watch_optimizer_steps()
    return entry.weight


@functools.lru_cache(maxsize=1)
def _watch_optimizer_steps() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_after_optimizer_step)


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    """Rebuild the graph-read copies of the weights this step updated, on the current stream
    (inside a captured training step: recorded with it)."""
    if not _AFTER_STEP:
        return  # (every copy a graph read is gone: the step costs no lookups)
    for group in optimizer.param_groups:
        for values in group["params"]:
            held = _AFTER_STEP.get(values)
            if held is not None:
                entry, build, inputs = held
                with torch.no_grad():
                    entry.captured.copy_(build(*inputs))
                entry.stamp = (values.data_ptr(), values._version)


def _built(build, inputs: tuple, values: torch.Tensor, device: torch.device) -> torch.Tensor:
    what = (f"the dense copy of a sparse weight (stored values {list(values.shape)} {values.dtype}), and the "
            "workspace of the cuBLAS that runs it where this GPU's crossover table says the kernel loses; unset "
            "SPARSEGEN_DENSE_FALLBACK turns it off")
    with allocating(what):  # (the handle's workspace too: a first cuBLAS call on a full GPU fails making it)
        if device.type == "cuda":
            _cublas_ready(device)
        return outside_graphs.run(_without_grad, (build, *inputs), device)


def _without_grad(build, *inputs):
    """build(*inputs) recording no autograd graph (on the builder thread grad mode is its own)."""
    with torch.no_grad():
        return build(*inputs)


def linear_into(y: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """Y = X W^T (+ bias) by cuBLAS, into y (returned)."""
    if bias is None:
        return torch.mm(x2, weight.t(), out=y)
    return torch.addmm(bias, x2, weight.t(), out=y)


def held_bytes() -> int:
    """Bytes of the dense copies kept."""
    return sum(c.weight.numel() * c.weight.element_size() for c in _COPIES.values() if c.weight is not None)
