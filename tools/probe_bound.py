"""What bounds the block-sparse forward: each default kernel timed as generated and again
with its tensor-core products removed (the template's Wgmma::mma body emptied: the same
copies, barriers, pipeline and stores), against issue #2's target time on that shape.

    PYTHONPATH=. python tools/probe_bound.py        (a GPU; compiles each kernel twice)

If the kernel without products is about as slow as the real one, moving the operands into
shared memory is the bound, and a target below that time needs fewer bytes copied per
useful FLOP - not a faster product."""
from __future__ import annotations

import os
import re

os.environ["SPARSEGEN_NO_DISK_CACHE"] = "1"  # the disk cache's alias would hand back the real kernel

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import sparsegen  # noqa: E402
from sparsegen.jit import cache, codegen
from sparsegen.launch import runtime  # noqa: E402

from bench import interleaved, median_ms, target_speedup  # noqa: E402
from sparsegen.bsr import dispatch as bsr_dispatch  # noqa: E402
from sparsegen.bsr import ops as bsr_ops  # noqa: E402

SHAPES = [(8192, 4096, 11008), (4096, 4096, 4096)]
REAL_RENDER = codegen.render


def without_products(spec) -> str:
    source, count = re.subn(r"(__device__ static void mma\(.*?\) \{)", r"\1\n    return;  // probe: no product",
                            REAL_RENDER(spec))
    assert count == 1, f"no Wgmma::mma in {spec.name}"
    return source


def use_render(render) -> None:
    """Switch the template renderer and forget every kernel built with the other one."""
    codegen.render = render
    bsr_dispatch.forward_kernel.cache_clear()
    runtime.kernel.cache_clear()
    cache._memory.clear()


def forward_timer(x, layer):
    values = layer.values.detach()
    return lambda: median_ms(lambda: bsr_ops.bsr_dds(x, values, layer.row_offsets, layer.col_indices, None,
                                                 layer.block, layer.out_features))


def probe(shape, block: int, density: float) -> str:
    m, k, n = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    layer = sparsegen.linear(k, n, block=(block, block), density=density, bias=False, device="cuda",
                             dtype=torch.bfloat16)
    use_render(REAL_RENDER)
    dense, real = interleaved(lambda: median_ms(lambda: F.linear(x, w)), forward_timer(x, layer))
    use_render(without_products)
    (bare,) = interleaved(forward_timer(x, layer))
    use_render(REAL_RENDER)
    target = dense / target_speedup(block, layer.density)
    return (f"| {m}, {k}, {n} | {block} | {density} | {dense:.3f} | {real:.3f} | {bare:.3f} | {bare / real:.2f} "
            f"| {target:.3f} | {bare / target:.2f} |")


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, bf16\n")
    print("| M, K, N | block | density | dense ms | ours ms | without products ms | without / ours "
          "| target ms | without / target |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    for shape in SHAPES:
        for block in (16, 32, 64):
            for density in (0.1, 0.25, 0.5):
                print(probe(shape, block, density), flush=True)


if __name__ == "__main__":
    main()
