"""The 2:4 linear: the sparsegen::sp24_dds op and an autograd.Function over it, which
torch.compile traces (see autograd.py).

Y = X W^T + b with W 2:4 ([N, K/2] values + metadata). dX = dY W runs cuBLAS on the
decompressed W; dW is dY^T X gathered at the stored positions, so the values' gradient
has their shape.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import epilogues, library, ops
from .layouts import semi24


def sp24_reference(x: Tensor, values: Tensor, metadata: Tensor, bias: Tensor | None, out_features: int,
                   epilogue: str = "none") -> Tensor:
    """Pure PyTorch, any device and dtype; autograd differentiates it as it is."""
    weight = semi24.decompress(values, metadata, (out_features, x.shape[-1]))
    return epilogues.reference(F.linear(x, weight, bias), epilogue)


def sp24_any_device(x, values, metadata, bias, out_features: int, epilogue: str = "none") -> Tensor:
    if ops.runs_16bit_kernels(x):
        return ops.sp24_dds(x, values, metadata, bias, out_features, epilogue=epilogue)
    return sp24_reference(x, values, metadata, bias, out_features, epilogue)


sp24_dds_op = library.define(
    "sp24_dds(Tensor x, Tensor values, Tensor metadata, Tensor? bias, int out_features, str epilogue) -> Tensor",
    sp24_any_device, ops.fake_product)


def forward_product(x, values, metadata, bias, out_features: int, epilogue: str = "none") -> Tensor:
    """epilogue(Y = X W^T + b) with no gradient: the op inside a compiled graph, else the
    kernel (or the reference) called directly."""
    if torch.compiler.is_compiling():
        return sp24_dds_op(x, values, metadata, bias, out_features, epilogue)
    return sp24_any_device(x, values, metadata, bias, out_features, epilogue)


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


class _Sp24Linear(torch.autograd.Function):
    """Y = X W^T + b and its gradients; torch.compile traces it (see autograd.py)."""

    @staticmethod
    def forward(ctx, x, values, metadata, bias, out_features):
        ctx.save_for_backward(x, values, metadata)
        ctx.has_bias = bias is not None
        return forward_product(x, values, metadata, bias, out_features)

    @staticmethod
    def backward(ctx, dy):
        x, values, metadata = ctx.saved_tensors
        return _gradients(x, values, metadata, ctx.has_bias, ctx.needs_input_grad, dy) + (None,)


def sp24_linear(x, values, metadata, bias, out_features: int) -> Tensor:
    """Differentiable Y = X W^T + b with W 2:4, on any device, traceable by torch.compile."""
    return _Sp24Linear.apply(x, values, metadata, bias, out_features)
