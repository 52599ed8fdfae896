"""GPU time of a one-byte 2:4 decode product that quantizes X itself (one launch) against
sp24_quantize then the scaled product (two), per layer shape: each way captured 50 times in a
CUDA graph and replayed, so the host's speed does not enter. Usage (GPU):
    PYTHONPATH=. python tools/probe_quantizing.py [--dtype e4m3|int8] [--shapes M,K,N ...]
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import sparsegen
from sparsegen.semi24 import ops

CALLS = 50
# Llama-3-8B's q/o (4096 x 4096), down (14336 -> 4096) and gate+up (4096 -> 2 x 14336) at decode sizes
SHAPES = ["1,4096,4096", "8,4096,4096", "8,14336,4096", "8,4096,28672", "16,14336,4096"]


def graphed_us(call) -> float:
    """Microseconds per call of `call`, replayed from a CUDA graph of CALLS calls."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * CALLS)


def probe(m: int, k: int, n: int, weight_dtype: str) -> str:
    layer = sparsegen.ScaledSparse24Linear.from_dense(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16),
                                                      weight_dtype)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    values, metadata, w_scale, bias = layer.values, layer.metadata, layer.weight_scale, layer.bias

    def two():
        xq, x_scale = ops.sp24_quantize(x, values.dtype)
        return ops.sp24_scaled_dds(xq, values, metadata, x_scale, w_scale, bias, n, torch.bfloat16)

    def one():
        return ops.sp24_quantized_dds(x, values, metadata, w_scale, bias, None, n, "none")

    assert torch.equal(one(), two())
    t_two, t_one = graphed_us(two), graphed_us(one)
    return f"| {m} x {k} -> {n} | {t_two:.1f} | {t_one:.1f} | {t_two / t_one:.2f}x |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="e4m3", choices=("e4m3", "int8"))
    parser.add_argument("--shapes", nargs="*", default=SHAPES, help="M,K,N each")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, GPU us per call (CUDA graph of {CALLS})")
    print("| M x K -> N | quantize + product | quantizing product | speedup |\n|---|---|---|---|")
    for shape in args.shapes:
        print(probe(*map(int, shape.split(",")), args.dtype), flush=True)


if __name__ == "__main__":
    main()
