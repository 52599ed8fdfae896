"""Host time of one launch, by the ways a compiled decode step can make it: a planned 2:4
product launched by cuLaunchKernelEx (PackedLaunch.run) and by cuLaunchKernel (the general
path), the whole launcher a compiled graph calls (FP8 quantizing product, the 16-bit one and
the block-sparse one), and torch.mm into a given output (what Inductor's graph calls for a
dense linear); then whole eager layer calls (nn.Linear, ScaledSparse24Linear, Sparse24Linear:
what an eager model pays). Each is timed in bursts from an idle GPU to the last launch
queued; median over rounds that alternate the ways (the host's speed drifts). Usage (GPU):
    PYTHONPATH=. python tools/probe_launch.py [--tokens 16] [--width 4096]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import sparsegen
from sparsegen.bsr import compiled as bsr_compiled
from sparsegen.semi24 import compiled, ops

BURST, ROUNDS = 200, 7


def host_us(call) -> float:
    """Microseconds of host time per call over one burst of BURST calls."""
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(BURST):
        call()
    spent = time.perf_counter() - begin
    torch.cuda.synchronize()
    return spent / BURST * 1e6


def ways(tokens: int, width: int) -> dict:
    """{name: a call making one launch}, every one run once (plans made, kernels loaded)."""
    linear = nn.Linear(width, width, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    fp8 = sparsegen.ScaledSparse24Linear.from_dense(linear, "e4m3")
    bf16 = sparsegen.Sparse24Linear.from_dense(linear).requires_grad_(False)
    block = sparsegen.BlockSparseLinear.from_dense(linear, block=(128, 128), density=0.25).requires_grad_(False)
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(tokens, width, device="cuda", dtype=torch.bfloat16)

    def fp8_launcher():
        compiled.sp24_scaled_linear_into(x, fp8.values, fp8.metadata, fp8.weight_scale, fp8.bias, None, "none",
                                         torch.bfloat16, out=y)

    def bf16_launcher():
        compiled.sp24_dds_into(x, bf16.values, bf16.metadata, bf16.bias, width, "none", out=y)

    def bsr_launcher():  # block 128, density 0.25 (bench_models' b128d0.25)
        bsr_compiled.bsr_dds_into(x, block.values, block.bias, block.row_offsets, block.col_indices, block.flat_index,
                                  128, 128, width, "none", out=y)

    bf16_launcher()
    launch = ops.sp24_lean_plan(x, bf16.values, bf16.metadata, width).launch  # (the launcher's kept plan)
    chosen = dict(fp8_launcher=fp8_launcher, bf16_launcher=bf16_launcher, bsr_launcher=bsr_launcher,
                  packed_launch_ex=launch.run,
                  packed_launch_kernel=lambda: launch.kern.launch_array(launch.grid, launch.array),
                  torch_mm_out=lambda: torch.mm(x, linear.weight.t(), out=y),
                  torch_addmm_out=lambda: torch.addmm(linear.bias, x, linear.weight.t(), out=y),
                  # whole eager layer calls, module call and output allocation included
                  linear_module=lambda: linear(x), fp8_module=lambda: fp8(x), bf16_module=lambda: bf16(x))
    for call in chosen.values():
        call()
    torch.cuda.synchronize()
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    calls = ways(args.tokens, args.width)
    times = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            times[name].append(host_us(call))
    print(f"{torch.cuda.get_device_name()}: host us per launch, {args.tokens} x {args.width} -> {args.width}, "
          f"median of {ROUNDS} bursts of {BURST}")
    print("| way | host us |\n|---|---|")
    for name, spent in times.items():
        print(f"| {name} | {statistics.median(spent):.1f} |")


if __name__ == "__main__":
    main()
