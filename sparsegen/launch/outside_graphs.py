"""Building tensors that outlive a call, outside any CUDA graph's memory pool.

torch.compile's CUDA graphs (reduce-overhead) run their warm-up with every allocation of the
calling thread routed into the graphs' memory pool, where a tensor kept past the call breaks
the next recording ("tensors in the cudagraph pool not tracked as outputs"). Another thread
allocates from the ordinary pool: layers build what they keep (index tensors, workspaces,
dense copies of weights) there.
"""
from __future__ import annotations

import concurrent.futures
import functools
import threading

import torch

_BUILDER_NAME = "sparsegen-index"


def run(build, inputs: tuple, device: torch.device):
    """build(*inputs) on the builder thread. The caller's stream is synchronized first (the
    inputs may be being written on it) and the builder's after (the result is read on the
    caller's). Not during a capture: synchronizing a capturing stream is an error."""
    if device.type != "cuda" or threading.current_thread().name.startswith(_BUILDER_NAME):
        return build(*inputs)  # (on the builder itself: waiting for it would never end)
    torch.cuda.current_stream(device).synchronize()
    return _builder().submit(_build_and_sync, build, inputs, device).result()


def _build_and_sync(build, inputs: tuple, device: torch.device):
    with torch.cuda.device(device):
        result = build(*inputs)
        torch.cuda.current_stream(device).synchronize()
    return result


@functools.lru_cache(maxsize=1)
def _builder() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=_BUILDER_NAME)
