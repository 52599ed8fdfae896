"""The block-diagonal forward: its PyTorch reference (a batched product of the diagonal
blocks), and the kit's product over it (GPU launch, custom op, compiled graph's launcher)."""
from __future__ import annotations

import torch

from ..jit import epilogues
from .. import gathered
from . import format as diag


def reference(x, values, bias, rowblocks: int, diagrows: int, out_features: int, epilogue: str = "none"):
    """Y = epilogue(X W^T + b) as torch.bmm of the diagonal blocks (differentiable, traceable)."""
    nblocks = values.shape[0] // diagrows
    return epilogues.reference(batched_product(x, diag.untile(values, nblocks), bias), epilogue)


def batched_product(x, blocks, bias=None):
    """X W^T for W of diagonal `blocks` [nblocks, n, k]: each block times its slice of X."""
    nblocks, n, k = blocks.shape
    x3 = x.reshape(-1, nblocks, k).transpose(0, 1)  # [nblocks, M, k]
    y = torch.bmm(x3, blocks.transpose(1, 2)).transpose(0, 1).reshape(*x.shape[:-1], nblocks * n)
    return y if bias is None else y + bias


def dense_weight(values, in_features: int, rowblocks: int, diagrows: int, out_features: int):
    """W [out_features, in_features], zeros off the diagonal blocks (the dense path's copy)."""
    return diag.to_dense(values, values.shape[0] // diagrows)


def transposed(values, in_features: int, rowblocks: int, diagrows: int, out_features: int):
    """W^T as block-diagonal tiles (each diagonal block transposed) and its op's arguments:
    dX = dY W runs the forward kernel over them (no dense weight)."""
    nblocks = values.shape[0] // diagrows
    values_t = diag.transposed(values, nblocks)
    return values_t, op_ints(values_t, nblocks)


def weight_grad(dy2, x2, values, rowblocks: int, diagrows: int, out_features: int):
    """dW's diagonal blocks, dY_d^T X_d for each block d as one batched product, as tiles."""
    nblocks = values.shape[0] // diagrows
    dy3 = dy2.reshape(-1, nblocks, dy2.shape[-1] // nblocks).permute(1, 2, 0)  # [nblocks, n, M]
    x3 = x2.reshape(-1, nblocks, x2.shape[-1] // nblocks).transpose(0, 1)      # [nblocks, M, k]
    return diag.tile(torch.bmm(dy3, x3), tuple(values.shape[2:]))


BDIAG_DDS = gathered.FixedRowsProduct("bdiag_dds", reference, dense_weight, transposed=transposed,
                                      weight_grad=weight_grad)
LOWERINGS = (BDIAG_DDS.lowering,)


def op_ints(values, nblocks: int) -> tuple[int, int, int]:
    """The op's (rowblocks, diagrows, out_features) for tiles `values` of `nblocks` blocks."""
    rows, rowblocks, bm, _ = values.shape
    return rowblocks, rows // nblocks, rows * bm


def bdiag_dds(x, values, bias, nblocks: int, epilogue: str = "none", **kernel):
    """epilogue(X W^T + b) on the GPU (gathered.FixedRowsProduct.gpu: `out`, and `tile`,
    `instr`, `acc` to force a kernel)."""
    return BDIAG_DDS.gpu(x, values, bias, *op_ints(values, nblocks), epilogue, **kernel)
