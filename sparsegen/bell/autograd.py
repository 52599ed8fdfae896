"""The block-ELL linear's autograd. The forward runs the generated kernel; the backward is
PyTorch on the dense weight (dX = dY W, dW = dY^T X kept at the stored blocks), which
torch.compile traces with the rest. A sparse backward would be the next template to write:
W^T of a block-ELL is not block-ELL (its rows hold different counts), so dX needs block-CSR.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import format as ell
from . import ops


class _EllLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, bias, cols, out_features):
        ctx.save_for_backward(x, values, cols)
        ctx.has_bias = bias is not None
        return ops.BELL_DDS(x, values, bias, cols, values.shape[1], out_features, "none")  # (every op argument: a
        # compiled graph calls the op by its schema, which has no defaults)

    @staticmethod
    def backward(ctx, dy):
        x, values, cols = ctx.saved_tensors
        need, block = ctx.needs_input_grad, tuple(values.shape[2:])
        weight = ell.to_dense(values, cols, (dy.shape[-1], x.shape[-1]))
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = (dy2 @ weight).reshape(x.shape) if need[0] else None
        dvalues = ell.gather_values(dy2.t() @ x2, cols, block) if need[1] else None
        dbias = dy2.sum(0) if ctx.has_bias and need[2] else None
        return dx, dvalues, dbias, None, None


def block_ell_linear(x: Tensor, values: Tensor, bias: Optional[Tensor], cols: Tensor, out_features: int) -> Tensor:
    """Differentiable Y = X W^T + b on any device, traceable by torch.compile."""
    return _EllLinear.apply(x, values, bias, cols, out_features)
