"""Inference of a sparse Llama under tensor parallelism against its dense twin under the same
plan: each decoder layer's MLP split over the ranks by sparsegen.parallel's styles (gate and
up column-wise - one fused gate_up layer where sparsegen fused them - and down row-wise;
nn.Linear layers get torch's own), attention replicated. Prefill and decode steps of
bench_models' cases, eager or compiled.

GPU: PYTHONPATH=. torchrun --nproc_per_node=2 tools/bench_tp.py [--cases llama8b_prefill,llama8b_decode1]
     [--variants dense,2:4,b128d0.25,fp8-2:4] [--modes eager,compile] [--reps 10] [--json FILE]
CPU smoke (gloo, tiny shapes): torchrun --nproc_per_node=2 tools/bench_tp.py --smoke
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import bench_models  # tools/ is on sys.path when run as a script
import ranks
from bench_record import Table, write
from sparsegen.parallel import ColwiseParallel, RowwiseParallel


def mlp_plan(model) -> dict:
    """The MLPs' first projections column-wise, their last row-wise."""
    fused = any(name.endswith("mlp.gate_up") for name, _ in model.named_modules())
    first = ["gate_up"] if fused else ["gate_proj", "up_proj"]
    plan = {f"model.layers.*.mlp.{name}": ColwiseParallel() for name in first}
    plan["model.layers.*.mlp.down_proj"] = RowwiseParallel()
    return plan


def step_ms(case, variant: str, mode: str, mesh, device, reps: int) -> float:
    model = bench_models.patched(case.make_model(), case.family, variant)
    parallelize_module(model, mesh, mlp_plan(model))
    step, _ = bench_models.warmed_up(case, case.make_step(bench_models.in_mode(model, mode)))
    with torch.no_grad():
        return bench_models.timed_ms(step, device, reps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="llama8b_prefill,llama8b_decode1,llama8b_decode8")
    parser.add_argument("--variants", default="dense,2:4,b128d0.25,fp8-2:4")
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, on whatever device there is")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rank, world, device = ranks.joined()
    cuda = device.type == "cuda"
    mesh = init_device_mesh(device.type, (world,))
    variants = [v for v in args.variants.split(",") if v != "dense" and (cuda or not v.startswith("fp8"))]
    table = Table("Whole models", f"Tensor parallelism over {world} GPUs: each MLP split, attention replicated",
                  [("model", ""), ("mode", ""), ("dense ms", ".3f")] + [(v, "x") for v in variants],
                  "tools/bench_tp.py under torchrun: median step time on rank 0; the dense twin runs the same "
                  "plan (torch's styles on nn.Linear). Speedup: the dense twin's time over the variant's.")
    for case in bench_models.cases(args.cases.split(","), device, args.smoke):
        for mode in args.modes.split(","):
            ms = {v: step_ms(case, v, mode, mesh, device, args.reps) for v in ["dense", *variants]}
            if rank == 0:  # recorded row by row: a run stopped at its time limit keeps what it measured
                table.add(case.name, mode, ms["dense"], *[ms["dense"] / ms[v] for v in variants])
                write(args.json, "bench_tp.py", sys.argv[1:], [table],
                      launcher=f"PYTHONPATH=. torchrun --nproc_per_node={world}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
