"""Which block-ELL kernel serves a call: one per (block, dtype, device, rowblocks, small batch,
epilogue), loaded once."""
from __future__ import annotations

import functools

import torch

from .. import calls, runtime
from .specs import forward_spec

SMALL_ROWS = 64  # M up to this takes the 64-row tile (no work on padding rows)


@functools.lru_cache(maxsize=None)
def forward_kernel(block: tuple[int, int], dtype: torch.dtype, device_index: int, rowblocks: int, small: bool,
                   epilogue: str = "none", tile=None, instr=None, acc: str = "f32") -> runtime.Kernel:
    arch = runtime.device_arch(torch.device("cuda", device_index))
    spec = forward_spec(block, calls.DTYPE_NAMES[dtype], arch, rowblocks, rows=1 if small else None,
                        epilogue=epilogue, tile=tile, instr=instr, acc=acc)
    return runtime.kernel(spec, device_index)
