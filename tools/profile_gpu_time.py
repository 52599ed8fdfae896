"""Where a whole model's GPU time goes: torch.profiler over steps of a bench_models case, its
kernels summed by kind (sparsegen's, cuBLAS GEMMs, attention, Inductor's fused Triton kernels,
the rest), per variant. With the linears' share of the dense model and the sparse linears'
speed, it bounds what a variant can gain on that model (Amdahl).
GPU: PYTHONPATH=. python tools/profile_gpu_time.py [--case llama_prefill] [--mode compile] [variant ...]"""
import argparse
import collections

import torch

import bench_models  # tools/ is on sys.path when run as a script

KINDS = (("sparsegen", ("bsr_", "sp24_")), ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
         ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")), ("Triton (Inductor)", ("triton",)))


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, marks in KINDS if any(mark in name for mark in marks)), "other")


def gpu_ms_by_kind(case, variant: str, mode: str, steps: int = 5) -> dict:
    """GPU ms per step of each kernel kind, for the case's model with `variant` in `mode`."""
    model = bench_models.patched(case.make_model(), case.family, variant)
    step, _ = bench_models.warmed_up(case, case.make_step(bench_models.in_mode(model, mode)))
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.set_grad_enabled(case.training), torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[kind_of(event.key)] += event.device_time_total / 1e3 / steps
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="llama_prefill")
    parser.add_argument("--mode", default="compile", help="eager or compile (reduce-overhead runs the same kernels)")
    parser.add_argument("variants", nargs="*", default=["dense", "2:4", "b128d0.25"])
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    case = bench_models.cases([args.case], torch.device("cuda"), False)[0]
    rows = {variant: gpu_ms_by_kind(case, variant, args.mode) for variant in args.variants}
    kinds = [kind for kind, _ in KINDS] + ["other"]
    print(f"GPU ms per step by kernel kind: {case.name}, {args.mode}\n")
    print("| variant | " + " | ".join(kinds) + " | total |\n|---|" + "---|" * (len(kinds) + 1))
    for variant, ms in rows.items():
        print(f"| {variant} | " + " | ".join(f"{ms.get(k, 0):.3f}" for k in kinds) + f" | {sum(ms.values()):.3f} |")


if __name__ == "__main__":
    main()
