"""The block-diagonal linear's autograd. W^T is block-diagonal (each block transposed), so
dX = dY W is the forward kernel over W^T's tiles; dW, kept on the diagonal blocks only, is
one batched product dY_d^T X_d; neither builds the dense weight."""
from __future__ import annotations

import torch
from torch import Tensor

from . import format as diag
from . import ops


class _DiagLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, bias, nblocks: int):
        ctx.save_for_backward(x, values)
        ctx.has_bias, ctx.nblocks = bias is not None, nblocks
        return forward_product(x, values, bias, nblocks)

    @staticmethod
    def backward(ctx, dy):
        x, values = ctx.saved_tensors
        need, nblocks = ctx.needs_input_grad, ctx.nblocks
        dx = forward_product(dy, diag.transposed(values, nblocks), None, nblocks) if need[0] else None
        dvalues = weight_grad(dy, x, nblocks, tuple(values.shape[2:])) if need[1] else None
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and need[2] else None
        return dx, dvalues, dbias, None


def forward_product(x, values, bias, nblocks: int, epilogue: str = "none") -> Tensor:
    return ops.BDIAG_DDS(x, values, bias, *ops.op_ints(values, nblocks), epilogue)


def weight_grad(dy: Tensor, x: Tensor, nblocks: int, block: tuple[int, int]) -> Tensor:
    """dW's diagonal blocks, dY_d^T X_d for each d, as the kit's tiles."""
    dy3 = dy.reshape(-1, nblocks, dy.shape[-1] // nblocks).permute(1, 2, 0)  # [nblocks, n, M]
    x3 = x.reshape(-1, nblocks, x.shape[-1] // nblocks).transpose(0, 1)      # [nblocks, M, k]
    return diag.tile(torch.bmm(dy3, x3), block)


def block_diagonal_linear(x: Tensor, values: Tensor, bias, nblocks: int) -> Tensor:
    """Differentiable Y = X W^T + b on any device, traceable by torch.compile."""
    return _DiagLinear.apply(x, values, bias, nblocks)
