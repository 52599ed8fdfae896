"""The 2:4 linear as a torch.library custom op (fake version and gradients, for
torch.compile) and as an autograd.Function for eager GPU training.

Y = X W^T + b with W 2:4 ([N, K/2] values + metadata). dX = dY W runs cuBLAS on the
decompressed W; dW is dY^T X gathered at the stored positions, so the values' gradient
has their shape.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops
from .layouts import semi24


def sp24_reference(x: Tensor, values: Tensor, metadata: Tensor, bias: Optional[Tensor], out_features: int) -> Tensor:
    """Pure PyTorch, any device and dtype; autograd differentiates it as it is."""
    weight = semi24.decompress(values, metadata, (out_features, x.shape[-1]))
    return F.linear(x, weight, bias)


def sp24_any_device(x, values, metadata, bias, out_features: int) -> Tensor:
    if ops.runs_16bit_kernels(x):
        return ops.sp24_dds(x, values, metadata, bias, out_features)
    return sp24_reference(x, values, metadata, bias, out_features)


@torch.library.custom_op("sparsegen::sp24_linear", mutates_args=())
def sp24_linear(x: Tensor, values: Tensor, metadata: Tensor, bias: Optional[Tensor], out_features: int) -> Tensor:
    return sp24_any_device(x, values, metadata, bias, out_features)


@sp24_linear.register_fake
def _(x, values, metadata, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _gradients(x, values, metadata, has_bias, need, dy):
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    dx = dvalues = dbias = None
    if need[0]:
        dx = dy @ semi24.decompress(values, metadata, (dy.shape[-1], x.shape[-1]))
    if need[1]:
        dvalues = semi24.gather_kept(dy2.t() @ x2, metadata)
    if has_bias and need[3]:
        dbias = dy2.sum(0)
    return dx, dvalues, None, dbias


def _setup_context(ctx, inputs, output):
    x, values, metadata, bias, _ = inputs
    ctx.save_for_backward(x, values, metadata)
    ctx.has_bias = bias is not None


def _backward(ctx, dy):
    x, values, metadata = ctx.saved_tensors
    return _gradients(x, values, metadata, ctx.has_bias, ctx.needs_input_grad, dy) + (None,)


sp24_linear.register_autograd(_backward, setup_context=_setup_context)


class _EagerSp24Linear(torch.autograd.Function):
    """The same, straight to the kernel: no custom-op dispatch on the eager hot path."""

    @staticmethod
    def forward(ctx, x, values, metadata, bias, out_features):
        _setup_context(ctx, (x, values, metadata, bias, out_features), None)
        return ops.sp24_dds(x, values, metadata, bias, out_features)

    @staticmethod
    def backward(ctx, dy):
        return _backward(ctx, dy)


def eager_sp24_linear(x, values, metadata, bias, out_features: int) -> Tensor:
    return _EagerSp24Linear.apply(x, values, metadata, bias, out_features)
