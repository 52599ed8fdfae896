"""A patched model's kernels, built before its first forward needs them: patch() asks each new
layer which kernels its forward likely takes (`likely_specs(arch, sm_count)`: its dtype,
epilogue and the batch sizes a model sees, from decode to prefill) and starts building them,
deduplicated across layers of one shape, on background threads (jit.cache.build_soon). A
forward that needs one waits only for what is left of its build. Needs a GPU to know the
arch; SPARSEGEN_WARM=0 turns it off (kernels are then built at first use, as before)."""
from __future__ import annotations

import torch
from torch import nn

from . import env
from .errors import SparsegenError
from .jit import cache


def warm(layers: list[nn.Module], gpu: tuple[int, int] | None = None) -> int:
    """Start building the kernels `layers` likely need on `gpu` ((arch, SM count); default the
    current GPU's); returns how many builds were started (0 without a GPU or when off)."""
    if not env.warm_kernels():
        return 0
    if gpu is None:
        if not torch.cuda.is_available():
            return 0
        from .launch import runtime

        index = torch.cuda.current_device()
        gpu = runtime.device_arch(torch.device("cuda", index)), runtime.sm_count(index)
    return cache.build_soon(likely_specs(layers, *gpu))


def likely_specs(layers: list[nn.Module], arch: int, sm_count: int) -> list:
    specs = []
    for layer in layers:
        specs += _asked(layer, arch, sm_count)
    return list(dict.fromkeys(specs))


def _asked(layer: nn.Module, arch: int, sm_count: int) -> list:
    """The layer's likely kernels, or none where it has no answer - or one that names a kernel
    no spec allows (a block shape without kernels on this arch, say): building ahead is a head
    start, never a reason for patch to fail; the forward meets any such error itself."""
    ask = getattr(layer, "likely_specs", None)
    if not callable(ask):
        return []
    try:
        return list(ask(arch, sm_count))
    except SparsegenError:
        return []
