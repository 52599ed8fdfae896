"""Probes for the sanitize step (tools/gpu_run.sh sanitize), run under compute-sanitizer.

planted: a block-CSR product whose index names one block more than its values hold, on the
mma.sync kernel: the last block is read past the end of the values' allocation (the step
turns PyTorch's caching allocator off, so that allocation ends there). memcheck must report
it in a kernel the step's filter selects, else a clean run proves nothing. Never run outside
the step: the values skip the layer's checks on purpose.

cublas: a cuBLAS product into an empty tensor, then read by a PyTorch kernel - what initcheck
says of memory that cuBLAS writes (the dense path's outputs).
"""
import sys

import torch

from sparsegen.bsr import format as bsr
from sparsegen.bsr.ops import bsr_dds

BLOCK, OUT, IN, TOKENS = (32, 32), 64, 64, 16


def planted() -> None:
    mask = torch.ones(OUT // BLOCK[0], IN // BLOCK[1], dtype=torch.bool)
    row_offsets, col_indices = bsr.indices(mask, "cuda")
    values = torch.randn(int(mask.sum()) - 1, *BLOCK, device="cuda", dtype=torch.bfloat16)  # one block short
    x = torch.randn(TOKENS, IN, device="cuda", dtype=torch.bfloat16)
    bsr_dds(x, values, row_offsets, col_indices, None, BLOCK, OUT, instr="mma")
    torch.cuda.synchronize()


def cublas() -> None:
    a, b = (torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, b, out=out)
    print(f"cuBLAS output read back: sum {out.double().sum().item():.3f}")


if __name__ == "__main__":
    {"planted": planted, "cublas": cublas}[sys.argv[1] if len(sys.argv) > 1 else "planted"]()
