"""Inference of a sparse Llama under tensor parallelism against its dense twin under the same
plan: each decoder layer's MLP split over the ranks by sparsegen.parallel's styles (gate and
up column-wise - one fused gate_up layer where sparsegen fused them - and down row-wise;
nn.Linear layers get torch's own), attention replicated. Prefill and decode steps of
bench_models' cases, eager or compiled.

GPU: PYTHONPATH=. torchrun --nproc_per_node=2 tools/bench_tp.py [--cases llama8b_prefill,llama8b_decode1]
     [--variants dense,2:4,b128d0.25,fp8-2:4] [--modes eager,compile] [--reps 10] [--rounds 7] [--json FILE]
     [--profile llama8b_prefill:fp8-2:4:compile,...]
CPU smoke (gloo, tiny shapes): torchrun --nproc_per_node=2 tools/bench_tp.py --smoke
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import bench_models  # tools/ is on sys.path when run as a script
import ranks
from bench_record import Table, write
from profile_gpu_time import kernels_per_step, print_top_kernels
from sparsegen.parallel import ColwiseParallel, RowwiseParallel


def mlp_plan(model) -> dict:
    """The MLPs' first projections column-wise, their last row-wise."""
    fused = any(name.endswith("mlp.gate_up") for name, _ in model.named_modules())
    first = ["gate_up"] if fused else ["gate_proj", "up_proj"]
    plan = {f"model.layers.*.mlp.{name}": ColwiseParallel() for name in first}
    plan["model.layers.*.mlp.down_proj"] = RowwiseParallel()
    return plan


def tp_step(case, variant: str, mode: str, mesh):
    """The case's warmed-up step of `variant` with its MLPs split over the mesh, in `mode`."""
    model = bench_models.patched(case.make_model(), case.family, variant)
    parallelize_module(model, mesh, mlp_plan(model))
    return bench_models.warmed_up(case, case.make_step(bench_models.in_mode(model, mode)))[0]


def speedups_over_dense(case, variants: list[str], mode: str, mesh, device, reps: int, rounds: int):
    """({variant: median step ms}, {variant: speedup over dense}), variants[0] being "dense".
    The host's speed drifts during a run by more than the margins (a compiled decode cell read
    0.77x and 1.11x in two runs that timed the variants one after another), so steps are timed
    in turns (bench_models.round_times) and a speedup is the median of the rounds' own ratios.
    Eager: every variant's model in the same rounds. Compiled: each variant with a dense twin
    compiled beside it after a Dynamo reset, as bench_models --alone does."""
    with torch.no_grad():
        if mode == "eager":
            return paired({v: tp_step(case, v, mode, mesh) for v in variants}, device, reps, rounds)
        dense_ms, ms, speedups = [], {}, {}
        for variant in variants[1:]:
            torch._dynamo.reset()
            pair_ms, pair_speedups = paired({v: tp_step(case, v, mode, mesh) for v in ("dense", variant)},
                                            device, reps, rounds)
            dense_ms.append(pair_ms["dense"])
            ms[variant], speedups[variant] = pair_ms[variant], pair_speedups[variant]
        ms["dense"] = statistics.median(dense_ms) if dense_ms else float("nan")
        return ms, speedups


def paired(steps: dict, device, reps: int, rounds: int) -> tuple[dict, dict]:
    """Each step's median over rounds that take them in turn, and the median over rounds of
    the first step's time over each step's."""
    times = bench_models.round_times(list(steps.values()), device, reps, rounds)
    names = list(steps)
    ms = {name: statistics.median(row[at] for row in times) for at, name in enumerate(names)}
    return ms, {name: statistics.median(row[0] / row[at] for row in times) for at, name in enumerate(names)}


def profiled(case, variant: str, mode: str, mesh, top: int = 12) -> None:
    """Rank 0's GPU time per step by kernel (3 steps), printed: where a slow cell goes."""
    torch._dynamo.reset()
    step = tp_step(case, variant, mode, mesh)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                         if torch.cuda.is_available() else [])
    with torch.no_grad(), torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            getattr(step, "reset", lambda: None)()
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print_top_kernels(f"{case.name}, {variant}, {mode}", *kernels_per_step(prof, 3), top)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="llama8b_prefill,llama8b_decode1,llama8b_decode8")
    parser.add_argument("--variants", default="dense,2:4,b128d0.25,fp8-2:4")
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--reps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, on whatever device there is")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", default="", help="CASE:VARIANT:MODE,...: rank 0's top kernels of those "
                        "cells (CASE as in --cases), after the timed rows")
    args = parser.parse_args()
    rank, world, device = ranks.joined()
    cuda = device.type == "cuda"
    mesh = init_device_mesh(device.type, (world,))
    variants = [v for v in args.variants.split(",") if v != "dense" and (cuda or not v.startswith("fp8"))]
    table = Table("Whole models", f"Tensor parallelism over {world} GPUs: each MLP split, attention replicated",
                  [("model", ""), ("mode", ""), ("dense ms", ".3f")] + [(v, "x") for v in variants],
                  "tools/bench_tp.py under torchrun: median step time on rank 0; the dense twin runs the same "
                  "plan (torch's styles on nn.Linear). Steps timed in rounds that take them in turn (eager: every "
                  "variant; compiled: each variant with a dense twin, after a Dynamo reset); speedup: the "
                  "median over rounds of the dense twin's time over the variant's.")
    for case in bench_models.cases(args.cases.split(","), device, args.smoke):
        for mode in args.modes.split(","):
            ms, speedups = speedups_over_dense(case, ["dense", *variants], mode, mesh, device, args.reps,
                                               args.rounds)
            if rank == 0:  # recorded row by row: a run stopped at its time limit keeps what it measured
                table.add(case.name, mode, ms["dense"], *[speedups[v] for v in variants])
                write(args.json, "bench_tp.py", sys.argv[1:], [table],
                      launcher=f"PYTHONPATH=. torchrun --nproc_per_node={world}")
    for cell in filter(None, args.profile.split(",")):
        name, rest = cell.split(":", 1)  # (a variant may hold a colon: fp8-2:4)
        variant, mode = rest.rsplit(":", 1)
        profiled(bench_models.cases([name], device, args.smoke)[0], variant, mode, mesh)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
