"""The block-sparse linear's autograd: an autograd.Function over the sparsegen ops, which
torch.compile traces without graph breaks.

dX = dY W runs the forward op on W^T, whose block-CSR index is built once per layout
(the values are re-transposed each step: d x the weight's bytes). dW computes dY^T X only
at W's stored blocks (the generated bsr_sdd kernel; a dense GEMM and a gather for float32
and on the CPU).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import Tensor

from . import format as bsr
from . import ops


@dataclass(frozen=True)
class IndexTensors:
    """A layout's index tensors, in the op's argument order (all built once per layout)."""

    row_offsets: Tensor
    col_indices: Tensor
    flat_index: Tensor      # position of each stored block in the row-major block grid
    t_row_offsets: Tensor   # the same three for W^T ...
    t_col_indices: Tensor
    t_flat_index: Tensor
    t_perm: Tensor          # ... whose values are values[t_perm], each block transposed

    @classmethod
    def of(cls, mask: Tensor, device=None) -> "IndexTensors":
        row_offsets, col_indices = bsr.indices(mask, device)
        t_row_offsets, t_col_indices, t_perm = bsr.transposed(mask, device)
        return cls(row_offsets, col_indices, bsr.flat_index(mask, device), t_row_offsets,
                   t_col_indices, bsr.flat_index(mask.t().contiguous(), device), t_perm)

    def as_tuple(self) -> tuple[Tensor, ...]:
        return tuple(getattr(self, name) for name in INDEX_NAMES)


# The op's index arguments, in order: also the buffer names of BlockSparseLinear.
INDEX_NAMES = tuple(f.name for f in fields(IndexTensors))


def _gradients(ctx, dy):
    """dX, dW (at the stored blocks) and d(bias): under torch.compile through the ops (which
    a compiled graph calls), in eager mode straight to the kernels (no dispatcher)."""
    x, values, row_offsets, col_indices, flat_index, t_row_offsets, t_col_indices, t_flat_index, t_perm = ctx.saved_tensors
    (bm, bk), need, traced = ctx.block, ctx.needs_input_grad, torch.compiler.is_compiling()
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = dvalues = dbias = None
    if need[0]:
        index = (t_row_offsets, t_col_indices, t_flat_index)
        dx = (ops.input_grad_op(dy, values, t_perm, *index, bk, bm, x.shape[-1]) if traced
              else ops.input_grad(dy, values, t_perm, *index, (bk, bm), x.shape[-1]))
    if need[1]:
        x2 = x.reshape(-1, x.shape[-1])
        dvalues = ops.sampled_weight_grad(dy2, x2, flat_index, (bm, bk))
    if ctx.has_bias and need[2]:
        dbias = dy2.sum(0)
    return dx, dvalues, dbias


class _BsrLinear(torch.autograd.Function):
    """Y = X W^T + b and its gradients. torch.compile traces this Function (the forward and
    backward graphs then call the sparsegen ops); eager mode calls the kernels directly."""

    @staticmethod
    def forward(ctx, x, values, bias, row_offsets, col_indices, flat_index, t_row_offsets, t_col_indices,
                t_flat_index, t_perm, block_rows, block_cols, out_features):
        ctx.save_for_backward(x, values, row_offsets, col_indices, flat_index, t_row_offsets, t_col_indices,
                              t_flat_index, t_perm)
        ctx.block, ctx.has_bias = (block_rows, block_cols), bias is not None
        return forward_product(x, values, bias, row_offsets, col_indices, flat_index, (block_rows, block_cols),
                               out_features)

    @staticmethod
    def backward(ctx, dy):
        return _gradients(ctx, dy) + (None,) * 10


def forward_product(x, values, bias, row_offsets, col_indices, flat_index, block, out_features,
                    epilogue: str = "none") -> Tensor:
    """epilogue(Y = X W^T + b) with no gradient: the op inside a compiled graph, else the
    kernel (or, off the GPU, the reference) called directly."""
    if torch.compiler.is_compiling():
        return ops.bsr_dds_op(x, values, bias, row_offsets, col_indices, flat_index, *block, out_features, epilogue)
    return ops.bsr_dds_any_device(x, values, bias, row_offsets, col_indices, flat_index, block, out_features,
                                  epilogue)


def block_sparse_linear(x: Tensor, values: Tensor, bias: Optional[Tensor], index: tuple,
                        block: tuple[int, int], out_features: int) -> Tensor:
    """Differentiable Y = X W^T + b on any device, traceable by torch.compile.
    index: IndexTensors.as_tuple() of the layout."""
    return _BsrLinear.apply(x, values, bias, *index, block[0], block[1], out_features)
