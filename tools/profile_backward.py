"""Host time of a 2:4 training layer (transposable mask: dX on the 2:4 kernel over W^T) against
nn.Linear, forward and backward, and where the backward's goes: cProfile of the layer's
gradient function called in this thread (autograd runs a CUDA backward in a thread of its own,
which cProfile does not see). Few tokens, so the step is the host's.
GPU: PYTHONPATH=. python tools/profile_backward.py [--tokens 16] [--calls 300] [--top 30] [--shape 2048,5632]"""
import argparse
import cProfile
import io
import pstats
import time

import torch
from torch import nn

from sparsegen.semi24 import autograd
from sparsegen.semi24.nn import Sparse24Linear


def drained(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(step, calls: int, device: torch.device) -> float:
    """us per call of `step` over `calls` calls after 20 warm-up calls, the GPU drained before
    and after (its share is small at these token counts)."""
    for _ in range(20):
        step()
    drained(device)
    start = time.perf_counter()
    for _ in range(calls):
        step()
    drained(device)
    return (time.perf_counter() - start) / calls * 1e6


def layers(k: int, n: int, device: torch.device):
    torch.manual_seed(0)
    dense = nn.Linear(k, n, bias=False).to(device, torch.bfloat16)
    sparse = Sparse24Linear.from_dense(nn.Linear(k, n, bias=False), method="transposable")
    return dense, sparse.to(device, torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--shape", default="2048,5632", help="IN,OUT features of the layer")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the tool (PyTorch's 2:4 path)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    k, n = map(int, args.shape.split(","))
    dense, sparse = layers(k, n, device)
    x = torch.randn(args.tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(args.tokens, n, device=device, dtype=torch.bfloat16)
    for name, layer in (("nn.Linear", dense), ("Sparse24Linear transposable", sparse)):
        forward = host_us(lambda: layer(x), args.calls, device)
        both = host_us(lambda: layer(x).backward(dy), args.calls, device)
        print(f"{name}: forward {forward:.0f} us, forward + backward {both:.0f} us a call")
    values, metadata = sparse.values, sparse.metadata
    gradients = lambda: autograd._gradients(x, values, metadata, False, (True, True, False, False), dy)
    print(f"the 2:4 gradients alone (this thread): {host_us(gradients, args.calls, device):.0f} us a call")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        gradients()
    profile.disable()
    drained(device)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
