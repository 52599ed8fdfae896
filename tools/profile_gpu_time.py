"""Where a whole model's GPU time goes: torch.profiler over steps of a bench_models case, its
kernels summed by kind, per variant. With the linears' share of the dense model and the
sparse linears' speed, it bounds what a variant can gain on that model (Amdahl).

Inference cases: sparsegen's kernels, cuBLAS GEMMs, attention, Inductor's Triton, the rest.
Training cases (gpt2_train, llama_train*): forward products, dX, dW, compression and masks,
optimizer, attention, the rest. A product is a forward one outside autograd's backward; in
a backward node with two matmuls the first is dX and the second dW (autograd's order), a
lone one is dW where it sums over the step's tokens; sparsegen's kernels say which by
name (bsr_sdd is dW, the dds kernels products).
GPU: PYTHONPATH=. python tools/profile_gpu_time.py [--case llama_train8k] [--mode eager]
     [--top 20] [variant ...]"""
import argparse
import collections
import gc
import sys
from pathlib import Path

import torch

import bench_models  # tools/ is on sys.path when run as a script
from bench_record import Table, write

KINDS = (("sparsegen", ("bsr_", "sp24_")), ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
         ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")), ("Triton (Inductor)", ("triton",)))
TRAIN_KINDS = ("forward products", "dX", "dW", "compression/masks", "optimizer", "attention", "other")
COMPRESSION = ("sp24_compress", "sp24_mask", "sp24_expand", "sp24_gather", "bsr_scatter", "sp24_prune")
MATMULS = ("aten::mm", "aten::addmm", "aten::matmul")
NAME_WIDTH = 100  # of a kernel's name, in the lists


def kind_of(kernel: str) -> str:
    """A kernel's kind by its name. Inductor's Triton kernels first: their names list the ops
    they fuse, which may be ours (`triton_poi_fused_..._sp24_dds_...` reads a product's output)."""
    name = kernel.lower()
    if name.startswith("triton_"):
        return "Triton (Inductor)"
    return next((kind for kind, marks in KINDS if any(mark in name for mark in marks)), "other")


def _ancestors(event):
    while event is not None:
        yield event
        event = event.cpu_parent


def train_kind(kernel: str, op, tokens: int) -> str:
    """The training kind of a kernel launched under CPU op `op` (None: unknown)."""
    name, kind, chain = kernel.lower(), kind_of(kernel), list(_ancestors(op))
    names = " ".join(e.name.lower() for e in chain)
    if any(mark in name for mark in COMPRESSION):
        return "compression/masks"
    if "optimizer" in names or "adam" in name or "multi_tensor" in name:
        return "optimizer"
    if kind == "attention":
        return "attention"
    if "bsr_sdd" in name:
        return "dW"
    if kind not in ("sparsegen", "GEMM"):
        return "other"
    if "backward" not in names:
        return "forward products"
    return "dW" if _is_weight_grad(chain, tokens) else "dX"


def _is_weight_grad(chain, tokens: int) -> bool:
    """Whether the matmul in `chain` is a dW. A backward node with two matmuls computes the
    input's gradient first and the weight's second (autograd's mm, sparsegen's Functions);
    a lone one is dW when it sums over the step's tokens."""
    for below, node in zip(chain, chain[1:]):
        if "backward" in node.name.lower() and below.name in MATMULS:
            products = [e for e in node.cpu_children if e.name in MATMULS]
            if len(products) == 2:
                return below is products[1]
            break
    shapes = next(([s for s in (e.input_shapes or []) if len(s) == 2] for e in chain if e.name in MATMULS), [])
    return len(shapes) >= 2 and shapes[-2][1] == tokens and shapes[-1][0] == tokens


def gpu_ms_by_kind(case, variant: str, mode: str, steps: int = 3, top: int = 0, ops: int = 0) -> dict:
    """GPU ms per step of each kernel kind, for the case's model with `variant` in `mode`."""
    step = bench_models.variant_step(case, variant, mode)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.set_grad_enabled(case.training), torch.profiler.profile(activities=activities,
                                                                        record_shapes=case.training or ops > 0) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for event in prof.events():
        for kernel in event.kernels:
            kind = train_kind(kernel.name, event, case.tokens) if case.training else kind_of(kernel.name)
            totals[kind] += kernel.duration / 1e3 / steps
    if ops:  # which operators launch the time, with their input shapes (3 steps)
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_device_time_total", row_limit=ops,
                                                                 max_name_column_width=60, max_shapes_column_width=90))
    if top:
        print_top_kernels(f"{variant}, {mode}", *kernels_per_step(prof, steps), top)
    return dict(totals)


def kernels_per_step(prof, steps: int) -> tuple[collections.Counter, collections.Counter]:
    """(GPU ms, launches) per step of each kernel (names cut to NAME_WIDTH) in a profile of `steps` steps."""
    kernels, launches = collections.Counter(), collections.Counter()
    for event in prof.events():
        for kernel in event.kernels:
            kernels[kernel.name[:NAME_WIDTH]] += kernel.duration / 1e3 / steps
            launches[kernel.name[:NAME_WIDTH]] += 1 / steps
    return kernels, launches


def print_top_kernels(title: str, kernels: collections.Counter, launches: collections.Counter, top: int) -> None:
    print(f"\n{title}: {sum(kernels.values()):.3f} GPU ms and {sum(launches.values()):.0f} launches per step; "
          f"top kernels (GPU ms, launches per step)")
    for name, ms in kernels.most_common(top):
        print(f"  {ms:8.3f} {launches[name]:5.0f}  {name}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="llama_prefill")
    parser.add_argument("--mode", default="compile", help="eager or compile (reduce-overhead runs the same kernels)")
    parser.add_argument("--top", type=int, default=0, help="also list the top kernels of each variant")
    parser.add_argument("--ops", type=int, default=0, help="also list the top operators (with input shapes)")
    parser.add_argument("--json", type=Path, help="record the table here (tools/benchmarks_md.py renders it)")
    parser.add_argument("variants", nargs="*", default=["dense", "2:4", "b128d0.25"])
    args = parser.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 64
    case = bench_models.cases([args.case], torch.device("cuda"), False)[0]
    kinds = list(TRAIN_KINDS) if case.training else [kind for kind, _ in KINDS] + ["other"]
    table = Table("Training" if case.training else "Whole models",
                  f"GPU ms per step by kernel kind: {case.name}, {args.mode}",
                  [("variant", "")] + [(kind, ".1f") for kind in kinds] + [("total", ".1f")],
                  "torch.profiler over 3 steps after the warm-up; kernels summed by kind (tools/profile_gpu_time.py "
                  "says how a kernel's kind is told).")
    for variant in args.variants:
        ms = gpu_ms_by_kind(case, variant, args.mode, top=args.top, ops=args.ops)
        table.add(variant, *[ms.get(kind, 0.0) for kind in kinds], sum(ms.values()))
        gc.collect()  # the last variant's model and optimizer state (autograd keeps cycles)
        torch.cuda.empty_cache()
    write(args.json, "profile_gpu_time.py", sys.argv[1:] if argv is None else argv, [table])


if __name__ == "__main__":
    main()
