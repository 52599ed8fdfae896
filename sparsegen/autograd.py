"""The block-sparse linear as a torch.library custom op, with a fake (shape-only) version
and its gradients, so torch.compile traces models that use it without graph breaks.

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

from . import ops
from .layouts import bsr


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


@torch.library.custom_op("sparsegen::bsr_linear", mutates_args=())
def bsr_linear(x: Tensor, values: Tensor, bias: Optional[Tensor], row_offsets: Tensor,
               col_indices: Tensor, flat_index: Tensor, t_row_offsets: Tensor, t_col_indices: Tensor,
               t_flat_index: Tensor, t_perm: Tensor, block_rows: int, block_cols: int,
               out_features: int) -> Tensor:
    """Y = X W^T + b. The W^T index (t_*) is only read by the backward."""
    return ops.bsr_dds_any_device(x, values, bias, row_offsets, col_indices, flat_index,
                                  (block_rows, block_cols), out_features)


@bsr_linear.register_fake
def _(x, values, bias, *index_and_sizes):
    return x.new_empty((*x.shape[:-1], index_and_sizes[-1]))


def _setup_context(ctx, inputs, output):
    x, values, bias, *index, block_rows, block_cols, _ = inputs
    ctx.save_for_backward(x, values, *index)
    ctx.block, ctx.has_bias = (block_rows, block_cols), bias is not None


def _gradients(ctx, dy, dds, sdd):
    """dX, dW (at the stored blocks) and d(bias). dds(dy, values, t_perm, index of W^T, block
    of W^T, in_features) and sdd(dy2, x2, flat_index, block) run the two products: the
    torch.ops versions when traced, the kernels themselves in eager mode."""
    x, values, row_offsets, col_indices, flat_index, t_row_offsets, t_col_indices, t_flat_index, t_perm = ctx.saved_tensors
    (bm, bk), need = ctx.block, ctx.needs_input_grad
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = dvalues = dbias = None
    if need[0]:
        dx = dds(dy, values, t_perm, (t_row_offsets, t_col_indices, t_flat_index), (bk, bm), x.shape[-1])
    if need[1]:
        dvalues = sdd(dy2, x.reshape(-1, x.shape[-1]), flat_index, (bm, bk))
    if ctx.has_bias and need[2]:
        dbias = dy2.sum(0)
    return dx, dvalues, dbias


def _traced_dds(dy, values, perm, index, block, out_features):
    return torch.ops.sparsegen.bsr_input_grad(dy, values, perm, *index, *block, out_features)


def _traced_sdd(dy2, x2, flat_index, block):
    return torch.ops.sparsegen.bsr_sdd(dy2, x2, flat_index, *block)


def _eager_dds(dy, values, perm, index, block, out_features):
    return ops.input_grad(dy, values, perm, *index, block, out_features)


def _backward(ctx, dy):
    return _gradients(ctx, dy, _traced_dds, _traced_sdd) + (None,) * 10


bsr_linear.register_autograd(_backward, setup_context=_setup_context)


class _EagerBsrLinear(torch.autograd.Function):
    """The same product and gradients for eager GPU training, calling the kernels directly:
    a custom op's dispatch cost ~400 us of host time per backward under torch.profiler, which a
    small layer's step cannot hide."""

    @staticmethod
    def forward(ctx, x, values, bias, index, block, out_features):
        _setup_context(ctx, (x, values, bias, *index, *block, out_features), None)
        return ops.bsr_dds(x, values, index[0], index[1], bias, block, out_features)

    @staticmethod
    def backward(ctx, dy):
        return _gradients(ctx, dy, _eager_dds, ops.weight_grad) + (None,) * 3


def eager_block_sparse_linear(x: Tensor, values: Tensor, bias: Optional[Tensor], index: tuple,
                              block: tuple[int, int], out_features: int) -> Tensor:
    """block_sparse_linear for CUDA tensors outside torch.compile, with less host overhead."""
    return _EagerBsrLinear.apply(x, values, bias, index, block, out_features)


def block_sparse_linear(x: Tensor, values: Tensor, bias: Optional[Tensor], index: tuple,
                        block: tuple[int, int], out_features: int) -> Tensor:
    """Differentiable Y = X W^T + b on any device, traceable by torch.compile.
    index: IndexTensors.as_tuple() of the layout."""
    return bsr_linear(x, values, bias, *index, block[0], block[1], out_features)
