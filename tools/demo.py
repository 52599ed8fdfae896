"""sparsegen in one minute: a block-sparse and a 2:4 layer, the kernels behind them, and (on a
GPU) the block-sparse speed.

Works with or without a GPU: without one, the layer runs its PyTorch reference and the
kernels are still generated and compiled (for sm_80 and sm_90) into the on-disk cache.
"""
import time

import torch

import sparsegen
from sparsegen.jit import cache, codegen
from sparsegen.bsr.specs import forward_spec
from sparsegen.semi24.specs import sp24_spec


def show_layers() -> None:
    """A block-sparse and a 2:4 layer, each checked against a float64 product."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for fc in (sparsegen.linear(1024, 256, block=(32, 32), density=0.5, device=device, dtype=dtype),
               sparsegen.linear(1024, 256, sparsity="2:4", device=device, dtype=dtype)):
        print(fc)
        x = torch.randn(4, 100, 1024, device=device, dtype=dtype)
        y = fc(x)
        ref = torch.nn.functional.linear(x.double(), fc.to_dense_weight().double(), fc.bias.double())
        error = ((y.double() - ref).norm() / ref.norm()).item()
        print(f"  forward on {device}: {tuple(x.shape)} -> {tuple(y.shape)}, "
              f"relative error vs float64 {error:.1e}")


def show_pipeline() -> None:
    for s in [forward_spec((64, 64), "bf16", arch) for arch in (80, 90)] + [sp24_spec("bf16", 90)]:
        start = time.perf_counter()
        built = cache.build(s)
        source = "compiled by NVRTC" if built.compiled else "from the cache"
        print(f"{s.name}: {len(built.cubin)} bytes of CUBIN, {source} "
              f"in {time.perf_counter() - start:.2f} s")
    print(f"templates: {codegen.templates_dir()}  (try: sparsegen show {s.name})")


def show_speed() -> None:
    if not torch.cuda.is_available():
        print("no GPU: skipping the timing (tools/bench.py has the full comparison)")
        return
    m, k, n = 8192, 4096, 11008
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dense = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    for density in (0.5, 0.25):
        fc = sparsegen.BlockSparseLinear.from_dense(dense, block=(128, 128), density=density)
        t_dense, t_sparse = _time(lambda: dense(x)), _time(lambda: fc(x))
        print(f"(M,K,N)=({m},{k},{n}) block 128 density {density}: dense {t_dense:.3f} ms, "
              f"sparsegen {t_sparse:.3f} ms, speedup {t_dense / t_sparse:.2f}x")


def _time(fn, reps: int = 50) -> float:
    with torch.no_grad():
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


if __name__ == "__main__":
    show_layers()
    show_pipeline()
    show_speed()
