"""Where host time goes: a forward call of each layer kind with its kernel loaded (eager and
inside a compiled graph), and a cached kernel in a new process.
Run on a GPU: PYTHONPATH=. python tools/profile_host.py"""
import cProfile
import io
import pstats
import subprocess
import sys

import torch
from bench_models import HOST_KINDS, HOST_LAYERS, HOST_TOKENS, HOST_WIDTH, host_stack  # tools/ is on sys.path

COLD = """
import cProfile, pstats, io, time, torch
torch.zeros(1, device='cuda'); torch.cuda.synchronize()
prof = cProfile.Profile(); t = time.perf_counter(); prof.enable()
from sparsegen.launch import runtime
from sparsegen.bsr import specs as spec
runtime.kernel(spec.forward_spec((64, 64), 'bf16', 90), 0)
prof.disable(); print('cold ready ms', (time.perf_counter() - t) * 1e3)
out = io.StringIO(); pstats.Stats(prof, stream=out).sort_stats('cumulative').print_stats(25); print(out.getvalue()[-6000:])
"""

def warmed_stack(kind: str, compiled: bool):
    """(bench_models' host stack of `kind`, compiled or not, after 10 forwards; its input)."""
    stack = host_stack(kind, torch.device("cuda"))
    run = torch.compile(stack) if compiled else stack
    x = torch.randn(HOST_TOKENS, HOST_WIDTH, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(10):
            run(x)
    torch.cuda.synchronize()
    return run, x


def forward_profile(kind: str, compiled: bool, calls: int = 100) -> None:
    """cProfile of `calls` forwards of bench_models' host stack (24 layers of `kind`, 16 tokens)."""
    run, x = warmed_stack(kind, compiled)
    with torch.no_grad():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            run(x)
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    print(f"==== {kind}, {'compiled' if compiled else 'eager'} ({calls} x {HOST_LAYERS} calls)\n"
          + out.getvalue()[-3500:])


def gpu_profile(kind: str, compiled: bool, forwards: int = 10) -> None:
    """The kernels a forward of the host stack runs, and their GPU time (torch.profiler)."""
    run, x = warmed_stack(kind, compiled)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.no_grad():
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(forwards):
                run(x)
            torch.cuda.synchronize()
    print(f"==== GPU time: {kind}, {'compiled' if compiled else 'eager'} ({forwards} x {HOST_LAYERS} calls)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    if "--gpu-time" in sys.argv:
        for kind in HOST_KINDS:
            for compiled in (False, True):
                gpu_profile(kind, compiled)
        sys.exit()
    subprocess.run([sys.executable, "-c", COLD], check=True)  # fills the disk cache
    subprocess.run([sys.executable, "-c", COLD], check=True)
    for kind in HOST_KINDS:
        for compiled in (False, True):
            forward_profile(kind, compiled)
