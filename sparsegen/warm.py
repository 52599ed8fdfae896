"""A patched model's kernels, built before its first forward needs them: patch() asks each new
layer which kernels its forward likely takes (`likely_specs(arch, sm_count)`: its dtype,
epilogue and the batch sizes a model sees, from decode to prefill) and starts building them,
deduplicated across layers of one shape, on background threads (jit.cache.build_soon). A
forward that needs one waits only for what is left of its build. Needs a GPU to know the
arch; SPARSEGEN_WARM=0 turns it off (kernels are then built at first use, as before).

Two costs of a cold first call come before any kernel is known, and are paid on short
background threads instead (same switch): loading NVRTC, from `import sparsegen` on, while the
user builds or loads a model (sparsegen/__init__.py), and setting up cuBLAS for the dense layers a
patched model keeps, during patch (warm_cublas: the head would otherwise set it up in the middle
of the first forward, where the dense model sets it up in its first layer)."""
from __future__ import annotations

import threading

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


def warm_packing(conversions: list[tuple]) -> int:
    """Start building the kernels patch's conversions will launch - each (face, rule settings,
    dense weight)'s `face.packing` - before anything else patch does: the first layer's
    conversion then waits for what is left of their compile, not all of it. Returns how many
    builds were started."""
    if not env.warm_kernels():
        return 0
    specs = [spec for face, settings, weight in conversions if weight.is_cuda
             for spec in _packed_by(face, settings, weight)]
    return cache.build_soon(list(dict.fromkeys(specs))) if specs else 0


def _packed_by(face, settings: dict, weight: torch.Tensor) -> list:
    try:
        return list(face.packing(settings, weight))
    except SparsegenError:  # (a head start only: the conversion meets any such error itself)
        return []


def warm_cublas(model: nn.Module, skip: set[str] = frozenset()) -> threading.Thread | None:
    """Set up cuBLAS for the model's dense linear layers on CUDA (nn.Linear and its subclasses,
    nn.MultiheadAttention's out_proj say; sparsegen's layers are not ones) - those not named in `skip`
    (the ones patch replaces) - on a short thread: one small product per (device, dtype), with
    and without a bias (cuBLAS and cuBLASLt). None when there are none or warming is off. torch
    keeps a pool of cuBLAS handles per device: a thread's goes back to it when the thread ends,
    and the next thread to ask - the forward's - takes it set up, its workspace with it."""
    kinds = {(m.weight.device, m.weight.dtype) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name not in skip and m.weight.is_cuda and m.weight.dtype.is_floating_point}
    if not kinds or not env.warm_kernels():
        return None
    thread = threading.Thread(target=_products, args=(sorted(kinds, key=str),), name="sparsegen-cublas", daemon=True)
    thread.start()
    return thread


def _products(kinds: list) -> None:
    try:
        with torch.no_grad():
            for device, dtype in kinds:
                with torch.cuda.device(device):
                    x, w = (torch.zeros(n, 64, device=device, dtype=dtype) for n in (8, 64))
                    torch.nn.functional.linear(x, w)
                    torch.nn.functional.linear(x, w, w[0])
    except Exception:  # (a full GPU, say: a head start only; the forward meets any error itself)
        pass
