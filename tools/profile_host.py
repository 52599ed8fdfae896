"""Where host time goes: a forward call with its kernel loaded, and a cached kernel in a
new process. Run on a GPU: PYTHONPATH=. python tools/profile_host.py"""
import cProfile
import io
import pstats
import subprocess
import sys

import torch
from bench import tiny_layer_and_input  # tools/ is on sys.path when run as a script

COLD = """
import cProfile, pstats, io, time, torch
torch.zeros(1, device='cuda'); torch.cuda.synchronize()
prof = cProfile.Profile(); t = time.perf_counter(); prof.enable()
from sparsegen import runtime, spec
runtime.kernel(spec.forward_spec((64, 64), 'bf16', 90), 0)
prof.disable(); print('cold ready ms', (time.perf_counter() - t) * 1e3)
out = io.StringIO(); pstats.Stats(prof, stream=out).sort_stats('cumulative').print_stats(25); print(out.getvalue()[-6000:])
"""


def forward_profile() -> None:
    layer, x = tiny_layer_and_input()
    with torch.no_grad():
        for _ in range(100):
            layer(x)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            layer(x)
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
    print(out.getvalue()[-5000:])


if __name__ == "__main__":
    subprocess.run([sys.executable, "-c", COLD], check=True)  # fills the disk cache
    subprocess.run([sys.executable, "-c", COLD], check=True)
    forward_profile()
