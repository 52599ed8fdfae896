"""2:4 training as the 2by4-pretrain toolkit does it: dense weights, 2:4 products.

`Sparse24TrainingLinear` keeps a dense `weight` and a 2:4 `mask` (transposable by default,
refreshed from |weight| every `mask_interval` training steps). Each step:
- forward: Y = X (W * mask)^T on the 2:4 kernel (W is compressed at the mask each step, by
  the sp24_compress kernel on a GPU);
- dX = dY (W * mask): with a transposable mask, (W * mask)^T is 2:4 too and runs on the same
  kernel; otherwise cuBLAS on the masked weight;
- dW = dY^T X for every weight (straight-through: pruned weights keep learning, so the mask
  can change), or with `dw_sparse=True` from an MVUE-sparsified dY^T (unbiased; on the GPU
  the product runs on the 2:4 kernel as dW^T = X^T S^T when the token count is a multiple
  of 32, else on cuBLAS).
The schedule lives on the device: `step` (an int64 buffer) counts training forwards (training
mode with gradients on) and the refresh at each positive multiple of `mask_interval` is
decided by the mask kernel reading it, so a training step captured as a CUDA graph (or
torch.compile's reduce-overhead) refreshes on schedule as it replays; see `scheduled_refresh`.
`soft_threshold=True` is S-STE: each group keeps sign(w) * (|w| - t) for its two largest,
t its third largest magnitude, times a per-tensor scale fixed at each mask refresh.
`masked_decay_` adds weight decay to the pruned weights' gradients only, and
`dense_finetune_` switches layers to plain dense products for the last phase.
Under torch.compile the products, the compressions and the scheduled refresh are
sparsegen ops (sp24_masked_product, sp24_scheduled_refresh): a compiled step runs the same
kernels and keeps the same schedule; MVUE's dW is traced as PyTorch there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..launch import calls, library
from .. import checkpoint
from ..errors import expect, positive_int
from ..layer import autocast_inputs, dense_linear, layer_dtype
from . import format as semi24
from . import ops
from .tensor import compress_masked, on_kernels, prune_and_compress, prune_mask

MASK_METHODS = ("transposable", "magnitude")


def soft_threshold(w: torch.Tensor) -> torch.Tensor:
    """S-STE's 2:4 soft threshold: the two largest |w| of each group, each less the third."""
    groups = w.reshape(w.shape[0], -1, 4)
    third = groups.abs().sort(-1).values[..., 1:2]  # the third largest = the second smallest
    return (groups.sign() * (groups.abs() - third).clamp_min(0)).reshape(w.shape)


class _Sparse24STE(torch.autograd.Function):
    """Products with (operand * mask); the operand is the weight, or S-STE's thresholded one."""

    @staticmethod
    def forward(ctx, x, weight, bias, operand, mask, kernel_dx: bool, dw_sparse: bool, dw_scale):
        ctx.save_for_backward(x, operand, mask)
        ctx.flags, ctx.dw_scale = (kernel_dx, dw_sparse, bias is not None), dw_scale
        return masked_product(x, operand, mask, bias)

    @staticmethod
    def backward(ctx, dy):
        x, operand, mask = ctx.saved_tensors
        kernel_dx, dw_sparse, has_bias = ctx.flags
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = dw = dbias = None
        if ctx.needs_input_grad[0]:
            # (W * mask)^T is 2:4 when the mask is transposable: the same kernel runs dX,
            # compressing the transposed views as they are (no transpose copy).
            dx = masked_product(dy, operand.t(), mask.t()) if kernel_dx else dy @ (operand * mask)
        if ctx.needs_input_grad[1]:
            dw = _sparse_weight_grad(dy2, x2) if dw_sparse else dy2.t() @ x2
            if ctx.dw_scale is not None:  # S-STE: straight through the scaled soft threshold
                dw = dw * ctx.dw_scale.to(dw.dtype)
        if has_bias and ctx.needs_input_grad[2]:
            dbias = dy2.sum(0)
        return dx, dw, dbias, None, None, None, None, None


def _sparse_product(x: torch.Tensor, operand: torch.Tensor, mask: torch.Tensor, bias=None) -> torch.Tensor:
    """x @ (operand * mask)^T (+ bias), mask 2:4 along rows. The kernel path compresses the
    operand at the mask's positions directly: the masked weight is never materialized."""
    if not calls.runs_16bit_kernels(x):
        return F.linear(x, operand * mask, bias)
    values, metadata = compress_masked(operand, mask)
    return ops.sp24_dds_fresh(x, values, metadata, bias, operand.shape[0])


sp24_masked_product_op = library.define(
    "sp24_masked_product(Tensor x, Tensor operand, Tensor mask, Tensor? bias=None) -> Tensor", _sparse_product,
    lambda x, operand, mask, bias=None: library.rows_by(x, operand.shape[0]))


# x @ (operand * mask)^T (+ bias): the op in a compiled graph, else its implementation.
masked_product = library.eager_or_op(sp24_masked_product_op, _sparse_product)


def _sparse_weight_grad(dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """dW = S X with S an MVUE 2:4 sample of dY^T along tokens. On the GPU (tokens a multiple
    of 32) the 2:4 kernel runs it as dW^T = X^T S^T: S is sampled and packed straight from
    dY's transposed view, X^T is one copy."""
    if not _mvue_dw_on_kernel(dy2):
        return _mvue_rows(dy2.t()) @ x2
    values, metadata = prune_and_compress(dy2.contiguous().t(), "mvue")  # the kernel unless turned off
    return ops.sp24_dds_fresh(x2.t().contiguous(), values, metadata, None, dy2.shape[1]).t()


def _mvue_dw_on_kernel(dy2: torch.Tensor) -> bool:
    """On the GPU with a token count a multiple of 32; not while torch.compile traces (the
    kernel's seed is drawn on the host: PyTorch ops there)."""
    tokens = dy2.shape[0]
    return (not torch.compiler.is_compiling() and calls.runs_16bit_kernels(dy2) and tokens > 0
            and tokens % semi24.COL_GRANULE == 0)


def _mvue_rows(t: torch.Tensor) -> torch.Tensor:
    """MVUE 2:4 along the rows of t (dY^T: along tokens); a token count not a multiple of
    4 leaves the last columns dense."""
    whole = t.shape[1] // 4 * 4
    if whole == 0:
        return t
    return torch.cat([semi24.mvue(t[:, :whole].contiguous()), t[:, whole:]], dim=1)


@torch.no_grad()
def scheduled_refresh(weight, mask, step, scale, interval: int, method: str, soft: bool) -> None:
    """Count a training step (`step` += 1); at each positive multiple of `interval` refresh
    `mask` (and for S-STE, `scale`) from |weight| first. All on the device: the transposable
    mask kernel on the GPU reads the counter and returns at once between refreshes;
    elsewhere torch.where keeps the old mask."""
    kernel = method == "transposable" and on_kernels(weight)
    due = None if kernel and not soft else (step > 0) & (step % interval == 0)
    if kernel:
        ops.sp24_transposable_mask(weight, out=mask, step=step, interval=interval)
    else:
        mask.copy_(torch.where(due, prune_mask(weight, method), mask))
    if soft:
        scale.copy_(torch.where(due, _norm_keeping_scale(weight), scale))
    step.add_(1)


sp24_scheduled_refresh_op = library.define(
    "sp24_scheduled_refresh(Tensor weight, Tensor(a!) mask, Tensor(b!) step, Tensor(c!) scale, int interval, "
    "str method, bool soft) -> ()", scheduled_refresh, lambda *args: None)
_scheduled_refresh_call = library.eager_or_op(sp24_scheduled_refresh_op, scheduled_refresh)


class Sparse24TrainingLinear(checkpoint.CheckedLoad, nn.Module):
    """nn.Linear trained with 2:4 sparse products (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 mask_interval: int = 100, method: str = "transposable", dw_sparse: bool = False,
                 soft_threshold: bool = False):
        super().__init__()
        semi24.check_shape((out_features, in_features))
        expect(method in MASK_METHODS, f"method in {MASK_METHODS}", repr(method))
        mask_interval = positive_int(mask_interval, "mask_interval")
        dense = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=layer_dtype(dtype))
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight, self.bias = dense.weight, dense.bias
        self.mask_interval, self.method = int(mask_interval), method
        self.dw_sparse, self.soft_threshold, self.dense = dw_sparse, soft_threshold, False
        self.register_buffer("mask", torch.zeros(out_features, in_features, dtype=torch.bool, device=device))
        self.register_buffer("scale", torch.ones((), device=device))
        # Training forwards so far, on the device: read there by scheduled_refresh, so no
        # host sync per step and a replayed CUDA graph advances it.
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        self.refresh_mask()

    @classmethod
    def from_dense(cls, linear: nn.Linear, **options) -> "Sparse24TrainingLinear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    linear.weight.device, linear.weight.dtype, **options)
        with torch.no_grad():
            layer.weight.copy_(linear.weight)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        layer.refresh_mask()
        return layer

    _uncounted = False  # the last training forward ran without grad (reentrant checkpointing's)

    def _counts_a_step(self) -> bool:
        """Whether this training forward is a step of the schedule: one with grad, once.
        Activation checkpointing's recomputation inside the backward is no new step (counting
        it refreshed the mask twice as often, and between a forward and its recomputation) -
        unless the forward it repeats ran without grad (reentrant checkpointing), uncounted."""
        if torch.compiler.is_compiling():  # (compiled graphs recompute no mutation)
            return torch.is_grad_enabled()
        if not torch.is_grad_enabled():
            self._uncounted = True
            return False
        recomputing = torch._C._current_graph_task_id() != -1  # (a forward inside a backward)
        counts = self._uncounted or not recomputing
        self._uncounted = False
        return counts

    _optional = ("step",)  # checkpoints of sparsegen before the device-side schedule lack it

    def _check_state(self, state_dict: dict, prefix: str) -> None:
        """A saved mask is checked to be 2:4 before it is copied (the products compress at it
        without looking again)."""
        mask = state_dict.get(prefix + "mask")
        if mask is not None:
            semi24.check_mask(mask, (self.out_features, self.in_features))

    @torch.no_grad()
    def refresh_mask(self) -> None:
        """A new mask from |weight| (and, for S-STE, the scale that keeps the norm), now."""
        w = self.weight.detach()
        self.mask.copy_(prune_mask(w, self.method))
        if self.soft_threshold:
            self.scale.copy_(_norm_keeping_scale(w))

    def sparse_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The 2:4 weight the products use: masked, or S-STE's scaled soft threshold."""
        return self._operand(weight) * self.mask

    def _operand(self, weight: torch.Tensor) -> torch.Tensor:
        """What the mask is applied to: the weight, or S-STE's scaled soft threshold."""
        if self.soft_threshold:
            return soft_threshold(weight) * self.scale.to(weight.dtype)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "_awaits_load" in self.__dict__:
            checkpoint.refuse_unloaded(self)
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        calls.check_inputs(x, weight, bias, self.in_features)
        if self.training and self._counts_a_step():
            # (the weight as the products see it: the autocast copy, if any)
            _scheduled_refresh_call(weight.detach(), self.mask, self.step, self.scale, self.mask_interval,
                                    self.method, self.soft_threshold)
        if self.dense:
            return F.linear(x, weight, bias)
        operand = self._operand(weight)
        if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return masked_product(x, operand, self.mask, bias)
        # Straight-through: the dense weight gets dY^T X, whatever the mask.
        kernel_dx = self.method == "transposable" and self.out_features % semi24.COL_GRANULE == 0
        return _Sparse24STE.apply(x, weight, bias, operand.detach(), self.mask, kernel_dx, self.dw_sparse,
                                  self.scale if self.soft_threshold else None)

    def to_dense_weight(self) -> torch.Tensor:
        """W [out, in] as this layer's products use it now (masked, or whole after
        dense_finetune_), differentiable as every layer's is."""
        return self.weight if self.dense else self.sparse_weight(self.weight)

    def to_linear(self) -> nn.Linear:
        """A dense nn.Linear with the weight this layer's products use now."""
        return dense_linear(self.to_dense_weight().detach(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, sparsity=2:4 "
                f"({'dense fine-tuning' if self.dense else self.method + ' mask'}), "
                f"mask_interval={self.mask_interval}, dw_sparse={self.dw_sparse}, "
                f"soft_threshold={self.soft_threshold}")


def _norm_keeping_scale(w: torch.Tensor) -> torch.Tensor:
    """S-STE's per-tensor scale: the least-squares fit of w by its soft threshold."""
    w = w.float()
    soft = soft_threshold(w)
    return (w * soft).sum() / soft.square().sum().clamp_min(1e-30)


def _training_layers(model: nn.Module) -> list[Sparse24TrainingLinear]:
    return [m for m in model.modules() if isinstance(m, Sparse24TrainingLinear)]


@torch.no_grad()
def masked_decay_(model: nn.Module, decay: float) -> None:
    """2by4-pretrain's masked decay: grad += decay * W where the mask prunes, for every
    Sparse24TrainingLinear in model. Call between backward() and the optimizer step."""
    for layer in _training_layers(model):
        if layer.weight.grad is not None:
            layer.weight.grad.add_(layer.weight * ~layer.mask, alpha=decay)


def dense_finetune_(model: nn.Module) -> int:
    """Switch every Sparse24TrainingLinear in model to dense products (the recipe's last
    phase). Returns how many layers switched."""
    layers = _training_layers(model)
    for layer in layers:
        layer.dense = True
    return len(layers)
