"""The 2:4 linear: the sparsegen::sp24_dds op and an autograd.Function over it, which
torch.compile traces (see autograd.py).

Y = X W^T + b with W 2:4 ([N, K/2] values + metadata). The mask is fixed while the values
train, so on the GPU (16-bit):
- dX = dY W: when W's stored positions are 2:4 along columns too (a transposable mask), on
  the 2:4 kernel over W^T, made from W's values and metadata each step (sp24_transpose: one
  pass); otherwise cuBLAS on the expanded W (sp24_expand: one pass, no index tensors);
- dW: dY^T X on cuBLAS, its stored positions gathered by the same kernel (sp24_gather), so
  the values' gradient has their shape.
Elsewhere PyTorch ops do the same. The backward torch.compile traces calls both through the
sparsegen::sp24_input_grad and sp24_weight_grad ops, so a compiled step runs these kernels too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..launch import calls, kept_index, library, plans
from .. import env
from ..jit import epilogues
from . import format as semi24
from . import ops


def sp24_reference(x: Tensor, values: Tensor, metadata: Tensor, bias: Tensor | None, out_features: int,
                   epilogue: str = "none") -> Tensor:
    """Pure PyTorch, any device and dtype; autograd differentiates it as it is."""
    weight = semi24.decompress(values, metadata, (out_features, x.shape[-1]))
    return epilogues.reference(F.linear(x, weight, bias), epilogue)


def sp24_any_device(x, values, metadata, bias, out_features: int, epilogue: str = "none") -> Tensor:
    # A training layer's backward asks whether the metadata is still what its transposable
    # answer was worked out from: where it was rewritten (DDP's broadcast), compare it now.
    kept_index.start_check(metadata)
    if calls.runs_16bit_kernels(x):
        return ops.sp24_dds(x, values, metadata, bias, out_features, epilogue=epilogue)
    return sp24_reference(x, values, metadata, bias, out_features, epilogue)


sp24_dds_op = calls.define_product("sp24_dds", sp24_any_device)


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
        dx = _input_grad_call(dy, values, metadata, dy.shape[-1])
    if need[1]:
        dvalues = _weight_grad_call(dy2, x2, metadata)
    if has_bias and need[3]:
        dbias = dy2.sum(0)
    return dx, dvalues, None, dbias


def _on_kernels(t: Tensor) -> bool:
    return calls.runs_16bit_kernels(t) and env.compress_kernel()


def input_grad(dy: Tensor, values: Tensor, metadata: Tensor, out_features: int) -> Tensor:
    """dX = dY W, W 2:4 [out_features, K]: on the GPU the 2:4 kernel on W^T where W's
    positions allow it, else cuBLAS on the expanded W; elsewhere PyTorch."""
    n, k = out_features, 2 * values.shape[1]
    if not (_on_kernels(dy) and dy.dtype == values.dtype):
        return dy @ semi24.decompress(values, metadata, (n, k)).to(dy.dtype)
    m = dy.numel() // n if n else 0
    # (cuBLAS's call first: where it takes the product, W^T's check is not needed at all)
    if not ops.fresh_takes_dense(m, n, k, dy.dtype, dy.device.index or 0) and stored_transposable(metadata, n, k):
        # W^T stores W's positions, 2 in every group of 4 along its rows too: exact.
        return ops.sp24_dds_fresh(dy, *ops.sp24_transpose(values, metadata, n), None, k)
    return dy @ ops.sp24_expand(values, metadata, n)


def weight_grad(dy2: Tensor, x2: Tensor, metadata: Tensor) -> Tensor:
    """The values' gradient: dY^T X at W's stored positions ([N, K/2]), dY and X 2-D."""
    dw = dy2.t() @ x2
    if _on_kernels(dw):
        return ops.sp24_gather(dw, metadata)
    return semi24.gather_kept(dw, metadata)


sp24_input_grad_op = library.define(
    "sp24_input_grad(Tensor dy, Tensor values, Tensor metadata, int out_features) -> Tensor", input_grad,
    lambda dy, values, metadata, out_features: library.rows_by(dy, 2 * values.shape[1]))
sp24_weight_grad_op = library.define(
    "sp24_weight_grad(Tensor dy, Tensor x, Tensor metadata) -> Tensor", weight_grad,
    lambda dy, x, metadata: dy.new_empty(dy.shape[1], x.shape[1] // 2))
_input_grad_call = library.eager_or_op(sp24_input_grad_op, input_grad)
_weight_grad_call = library.eager_or_op(sp24_weight_grad_op, weight_grad)


_TRANSPOSABLE = plans.PlanCache()


def stored_transposable(metadata: Tensor, n: int, k: int) -> bool:
    """Whether W's stored positions are 2:4 along columns as well (so W^T compresses exactly),
    worked out once per metadata (and per in-place change of it: a load). Not known during a
    CUDA graph capture that meets it first: then False (cuBLAS), for that capture."""
    if n % semi24.COL_GRANULE:
        return False
    capturing = metadata.is_cuda and torch.cuda.is_current_stream_capturing()  # (the cache keeps no result then)
    stamp = kept_index.stamp_of(metadata)
    kept = _TRANSPOSABLE.get(metadata, (n, k), lambda: {})
    if kept and (kept["stamp"] == stamp or kept_index.current(metadata) is kept["generation"]):
        kept["stamp"] = stamp
        return kept["answer"]
    answer = not capturing and _columns_24(metadata, n, k)
    if not capturing:
        kept.update(stamp=stamp, generation=kept_index.generation(metadata), answer=answer)
    return answer


def _columns_24(metadata: Tensor, n: int, k: int) -> bool:
    positions = semi24.stored_positions(metadata, n, k)
    stored = torch.zeros(n, k // 4, 4, dtype=torch.bool, device=metadata.device).scatter_(-1, positions, True)
    return bool((stored.reshape(n // 4, 4, k).sum(1) <= 2).all())


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
