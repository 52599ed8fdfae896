"""The dense path: cuBLAS on a dense copy of a sparse layer's weight, where this GPU's
crossover table (crossovers.py) says the sparse kernel would lose at the call's shape and
token count - small layers, few tokens, high densities.

The copy is built on the first call that wants it and kept while the weight stays as it
is (data pointer and version). A weight that keeps changing is being trained: after
TRAINED_AFTER changes the layer stops keeping a copy and runs its sparse kernels (a copy
rebuilt every step would cost more than it saves). The copy costs memory: the weight's
dense size, per layer that takes this path (`held_bytes`); SPARSEGEN_DENSE_FALLBACK=0
turns the path off.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import crossovers, outside_graphs, runtime
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


_COPIES = WeakIdKeyDictionary()  # a layout's key tensor (its index or metadata) -> _Copy


def copy_of(key: torch.Tensor, values: torch.Tensor, build, *inputs) -> torch.Tensor | None:
    """The dense weight build(*inputs) makes from `values`, kept per layout while `values` stays
    the same; None once the weight has been seen changing (trained), inside a CUDA graph
    capture with no current copy (the capture then records the sparse kernels), or for values
    that are not a layer's parameter: a cast made per call (autocast) can come back at the same
    address and version with other contents, so a copy keyed by it would go stale."""
    if not isinstance(values, torch.nn.Parameter):
        return None  # a temporary (an autocast cast): its pointer and version do not follow the weight
    stamp, entry = (values.data_ptr(), values._version), _COPIES.get(key)
    if entry is not None and entry.stamp == stamp:
        return entry.weight
    if key.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    changes = 0 if entry is None else entry.changes + 1
    weight = None if changes >= TRAINED_AFTER else outside_graphs.run(_without_grad, (build, *inputs), key.device)
    _COPIES[key] = _Copy(stamp, weight, changes)
    return weight


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
