"""What sparsegen allocates beyond a call's output - split-K workspaces, dense copies of
weights, a plan's aligned copies - says so when the GPU runs out of memory.

The error stays PyTorch's OutOfMemoryError (callers that catch it keep working); its message
starts with what sparsegen was allocating and how big it was. Nothing is kept from a failed
allocation: the workspace list, the dense-copy table and the plan caches are only written
after their tensor exists, so the same call succeeds once memory is freed.
"""
from __future__ import annotations

import contextlib

import torch

_PREFIX = "sparsegen ran out of GPU memory"


@contextlib.contextmanager
def allocating(what: str, nbytes: int | None = None):
    """Run the block; an OutOfMemoryError from it is raised again naming `what` (and its size)."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        if str(error).startswith(_PREFIX):
            raise  # already named by an inner allocation
        size = "" if nbytes is None else f" ({nbytes / 2**20:.1f} MiB)"
        raise torch.OutOfMemoryError(f"{_PREFIX} allocating {what}{size}; nothing of it was kept, "
                                     f"so the call can be repeated once memory is freed.\n{error}") from error
