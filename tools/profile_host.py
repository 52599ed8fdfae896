"""Where host time goes: a forward call of each layer kind with its kernel loaded (eager and
inside a compiled graph), and a cached kernel in a new process.
Run on a GPU: PYTHONPATH=. python tools/profile_host.py"""
import cProfile
import io
import pstats
import subprocess
import sys

import torch
from torch import nn

import sparsegen

COLD = """
import cProfile, pstats, io, time, torch
torch.zeros(1, device='cuda'); torch.cuda.synchronize()
prof = cProfile.Profile(); t = time.perf_counter(); prof.enable()
from sparsegen import runtime, spec
runtime.kernel(spec.forward_spec((64, 64), 'bf16', 90), 0)
prof.disable(); print('cold ready ms', (time.perf_counter() - t) * 1e3)
out = io.StringIO(); pstats.Stats(prof, stream=out).sort_stats('cumulative').print_stats(25); print(out.getvalue()[-6000:])
"""

LAYERS = {"BlockSparseLinear b64 d0.5": lambda: sparsegen.linear(1024, 1024, block=(64, 64), density=0.5),
          "Sparse24Linear": lambda: sparsegen.linear(1024, 1024, sparsity="2:4"),
          "nn.Linear": lambda: nn.Linear(1024, 1024)}


def forward_profile(name: str, compiled: bool, calls: int = 2000) -> None:
    layer = LAYERS[name]().to(device="cuda", dtype=torch.bfloat16)
    run = torch.compile(layer) if compiled else layer
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(100):
            run(x)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            run(x)
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    print(f"==== {name}, {'compiled' if compiled else 'eager'} ({calls} calls)\n" + out.getvalue()[-3500:])


if __name__ == "__main__":
    subprocess.run([sys.executable, "-c", COLD], check=True)  # fills the disk cache
    subprocess.run([sys.executable, "-c", COLD], check=True)
    for name in LAYERS:
        for compiled in (False, True):
            forward_profile(name, compiled)
