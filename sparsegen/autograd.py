"""Gradients of the block-sparse linear on the GPU.

dX = dY W runs the forward kernel on W^T, whose block-CSR index is built once per layout
(the values are re-transposed each step: d x the weight's bytes). dW keeps only W's
nonzero blocks of dY^T X; for now it is one dense GEMM and a gather (dense speed, not
sparse) until a sampled dense-dense kernel is generated.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import ops
from .layouts import bsr


@dataclass
class Layout:
    """What the op needs of a layer's layout, with W^T's index built on first use."""

    mask: torch.Tensor
    row_offsets: torch.Tensor
    col_indices: torch.Tensor
    block: tuple[int, int]
    shape: tuple[int, int]  # (out_features, in_features)
    _transposed: tuple | None = field(default=None, repr=False)

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._transposed is None:
            self._transposed = bsr.transposed(self.mask, self.row_offsets.device)
        return self._transposed


class BlockSparseLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, bias, layout: Layout):
        ctx.save_for_backward(x, values)
        ctx.layout, ctx.has_bias = layout, bias is not None
        return ops.bsr_dds(x, values, layout.row_offsets, layout.col_indices, bias, layout.block,
                           layout.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, values = ctx.saved_tensors
        layout = ctx.layout
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = _input_grad(dy2, values, layout).reshape(x.shape) if ctx.needs_input_grad[0] else None
        dvalues = _weight_grad(dy2, x, layout) if ctx.needs_input_grad[1] else None
        dbias = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dvalues, dbias, None


def _input_grad(dy2: torch.Tensor, values: torch.Tensor, layout: Layout) -> torch.Tensor:
    row_offsets, col_indices, perm = layout.transposed()
    values_t = bsr.transpose_values(values, perm)
    block_t = (layout.block[1], layout.block[0])
    return ops.bsr_dds(dy2, values_t, row_offsets, col_indices, None, block_t, layout.shape[1])


def _weight_grad(dy2: torch.Tensor, x: torch.Tensor, layout: Layout) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return bsr.dense_to_values(dy2.t() @ x2, layout.mask, layout.block)


def block_sparse_linear(x, values, bias, layout: Layout) -> torch.Tensor:
    """Y = X W^T + b, differentiable in x, values and bias (GPU tensors)."""
    return BlockSparseLinearFunction.apply(x, values, bias, layout)
