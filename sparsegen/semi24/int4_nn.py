"""Int4Sparse24Linear: 2:4 weights whose kept values are 4-bit integers with a 16-bit scale per
output row and group of input columns (W4A16, symmetric: the scheme of llm-compressor's
W4A16 2:4 models), activations and outputs bf16 or fp16 - decode reads about 3.1 bits a
weight. On a GPU the generated sp24_w4 kernel (mma.sp) dequantizes the values in registers
and applies bias and epilogue to its float32 sums; elsewhere a float64 product of the
dequantized weight stands in. Storage and rounding: int4.py.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from .. import checkpoint
from ..errors import expect
from ..jit import epilogues
from ..launch import calls, lean, library, plans, runtime
from ..layer import DenseWeightDescription, dense_linear, in_units
from . import dispatch, int4, ops, tensor
from . import format as semi24
from .specs import (MAX_GROUPS, W4_ROWS, sp24_compress_spec, sp24_spec, sp24_w4_spec, w4_narrow, w4_rows_bucket,
                    w_rows)

_ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)


def dequantized_weight(qweight: Tensor, metadata: Tensor, scales: Tensor, group: int) -> Tensor:
    """The dense [out, in] weight the parts stand for, in the scales' dtype."""
    kept = int4.dequantize(int4.unpack(qweight), scales, group)
    return semi24.decompress(kept, metadata, (kept.shape[0], 2 * kept.shape[1]))


def w4_reference(x2: Tensor, qweight: Tensor, metadata: Tensor, scales: Tensor, bias: Tensor | None, group: int,
                 epilogue: str) -> Tensor:
    """What the kernel computes, in float64: X times the dequantized weight, bias, epilogue."""
    y = x2.double() @ dequantized_weight(qweight, metadata, scales, group).double().t()
    return epilogues.reference(y if bias is None else y + bias.double(), epilogue)


@functools.lru_cache(maxsize=None)
def w4_kernel(dtype: torch.dtype, device_index: int, rows_bucket: int | None, epilogue: str, narrow: bool,
              tile=None, kwarps: int | None = None, groups: int = 1):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    spec = sp24_w4_spec(dispatch.DTYPE_NAMES[dtype], arch, tile, rows=rows_bucket, epilogue=epilogue, kwarps=kwarps,
                        narrow=narrow, groups=groups)
    return runtime.kernel(spec, device_index)


def _plan(x2: Tensor, weights: list[tuple], group: int, epilogue: str = "none", splits: int | None = None,
          tile=None, kwarps: int | None = None) -> ops._Sp24Plan:
    """The launch over 4-bit weights [(qweight, metadata, scales)] of one X, Y's columns weight
    after weight (one weight: a layer's product; 2-3: a grouped one, w4_group_plan): the 2:4
    forward's grid and K splits (dispatch.grid; `splits` overrides), W's parts bound once; X,
    bias and Y bound per call. The grouped kernel's parameters are the single one's, each
    weight's parts in turn, with where each weight but the first starts in Y last."""
    (m, k), device_index = x2.shape, x2.device.index or 0
    widths = [16 * q.shape[0] for q, _, _ in weights]
    n = sum(widths)
    narrow = w4_narrow(n, runtime.sm_count(device_index))
    kern = w4_kernel(x2.dtype, device_index, w4_rows_bucket(m), epilogue, narrow, tile, kwarps, len(weights))
    grid, k_split = dispatch.grid(kern.spec, m, k, n, device_index, splits)
    starts = [sum(widths[:g]) for g in range(1, len(widths))]
    pointers = (0, *(t.data_ptr() for weight in weights for t in weight), 0, 0, 0, 0)  # X, W, bias, Y, sums
    launch = runtime.PackedLaunch(kern, grid, (), pointers, (m, k, n, k_split, group, *starts))
    return ops._Sp24Plan(kern, launch, (), *dispatch.split_space(kern.spec, grid, m, n),
                         epilogues.output_features(epilogue, n))


_PLANS = plans.PlanCache()


def _w4_product(x2: Tensor, qweight: Tensor, metadata: Tensor, scales: Tensor, bias: Tensor | None, group: int,
                out_features: int, epilogue: str) -> Tensor:
    """Y [M, out] in X's dtype (the scales'): the kernel on a GPU, the float64 reference elsewhere."""
    if not _on_kernel(x2, qweight):
        return w4_reference(x2, qweight, metadata, scales, bias, group, epilogue).to(x2.dtype).contiguous()
    return sp24_w4(x2, qweight, metadata, scales, bias, group, out_features, epilogue)


def _on_kernel(x2: Tensor, qweight: Tensor) -> bool:
    """Whether a product of these operands runs the kernels (rows to compute, CUDA 16-bit X, an
    aligned weight) rather than the reference."""
    return bool(x2.numel()) and calls.runs_16bit_kernels(x2) and calls.tma_ready(qweight)


def sp24_w4(x2: Tensor, qweight: Tensor, metadata: Tensor, scales: Tensor, bias: Tensor | None, group: int,
            out_features: int, epilogue: str = "none", out: Tensor | None = None, splits: int | None = None,
            tile=None, kwarps: int | None = None) -> Tensor:
    """The 4-bit product on CUDA operands the caller checked: Y [M, width] (`out` if given);
    `splits`, `tile` and `kwarps` override the dispatch's (a plan is then made for this call alone).
    Prefill on Hopper takes the 16-bit 2:4 kernel (wgmma.sp) on the values dequantized for
    the call (prefill_on_16_bit)."""
    x2 = calls.rows_2d(x2)
    chosen = splits is None and tile is None and kwarps is None
    if chosen and prefill_on_16_bit(x2.shape[0], x2.device.index or 0):
        values = w4_values(qweight, scales, group)
        return _on_16_bit_kernel(x2, values, metadata, bias, out_features, epilogue, out)
    make = functools.partial(_plan, x2, [(qweight, metadata, scales)], group, epilogue, splits, tile, kwarps)
    signature = (*x2.shape, x2.dtype, out_features, group, epilogue, qweight.data_ptr(), scales.data_ptr())
    plan = _PLANS.get(metadata, signature, make) if chosen else make()
    y, _ = calls.output_for(x2, x2, out, plan.width, x2.dtype)
    plan.run(x2, None, bias, y)
    return y


# Tokens from which Hopper runs a 4-bit product as the 16-bit 2:4 kernel on its values
# dequantized for the call: mma.sp, which reads the 4-bit values itself, reached 0.6x cuBLAS
# bf16 at 2048 tokens on an H200 where wgmma.sp on 16-bit values ran 1.4-1.5x (bench24.py
# --int4); dequantizing writes half a dense weight's bytes, a few percent of such a product.
PREFILL_ROWS = 128


def prefill_on_16_bit(m: int, device_index: int) -> bool:
    return m > PREFILL_ROWS and runtime.device_arch(torch.device("cuda", device_index)) >= 90


@functools.lru_cache(maxsize=None)
def _values_kernel(dtype: torch.dtype, device_index: int):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    return runtime.kernel(sp24_compress_spec(dispatch.DTYPE_NAMES[dtype], arch, "sp24_w4_values"), device_index)


def w4_values(qweight: Tensor, scales: Tensor, group: int) -> Tensor:
    """The kept values [N, K/2] in the scales' dtype, dequantized on the GPU (one launch): a
    transient tensor (no copy of the weight is kept)."""
    n, k = 16 * qweight.shape[0], 32 * qweight.shape[1]
    values = torch.empty(n, k // 2, dtype=scales.dtype, device=scales.device)
    kern = _values_kernel(scales.dtype, scales.device.index or 0)
    kern.launch((-(-qweight.numel() // kern.threads), 1, 1), (),
                (qweight.data_ptr(), scales.data_ptr(), values.data_ptr()), (n, k, group))
    return values


def _on_16_bit_kernel(x2: Tensor, values: Tensor, metadata: Tensor, bias, out_features: int, epilogue: str,
                      out) -> Tensor:
    """The 16-bit 2:4 forward's plan for this signature, W's values bound per call (they are new)."""
    signature = (*x2.shape, x2.dtype, x2.device.index, out_features, epilogue)
    plan = _PREFILL_PLANS.get(signature, lambda: ops._sp24_plan(x2, values, metadata, out_features, None,
                                                                epilogue=epilogue))
    y, _ = calls.output_for(x2, x2, out, plan.width, x2.dtype)
    plan.run_at(x2.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                weight=(values.data_ptr(), metadata.data_ptr()))
    return y


_PREFILL_PLANS = plans.SignatureCache()


def sp24_w4_linear_into(x, qweight, metadata, scales, bias, group, out_features, epilogue, *, out):
    """sp24_w4_linear as a compiled graph calls it (registry.Lowering, semi24/compiled.py): into
    Inductor's buffer, by the plan kept for this signature; the reference (CPU) into a copy."""
    if _on_kernel(x, qweight) and calls.fits_in_place(out):
        sp24_w4(x, qweight, metadata, scales, bias, group, out_features, epilogue, out=out)
    else:
        out.copy_(_w4_product(x, qweight, metadata, scales, bias, group, out_features, epilogue))


def w4_group_plan(x2: Tensor, weights: list[tuple], group: int) -> ops._Sp24Plan | None:
    """The plan of one sp24_w4 launch over several 4-bit weights [(qweight, metadata, scales)]
    of one X (a compiled graph's q, k and v projections), Y's columns weight after weight; None
    where it does not apply (see groups_on_kernel, or a weight but the last ending inside a tile)."""
    if not groups_on_kernel(x2, weights, group):
        return None
    plan = _plan(x2, weights, group)
    tile_rows = w_rows(plan.kern.spec)
    return None if any(16 * q.shape[0] % tile_rows for q, _, _ in weights[:-1]) else plan


def groups_on_kernel(x2: Tensor, weights: list[tuple], group: int) -> bool:
    """What the grouped kernel takes: 2-D X of at most PREFILL_ROWS rows in its weights' scales'
    dtype on a GPU, 2 to MAX_GROUPS weights of X's K and one scale group, every part aligned."""
    return (x2.dim() == 2 and 0 < x2.shape[0] <= PREFILL_ROWS and 1 < len(weights) <= MAX_GROUPS
            and all(_on_kernel(x2, q) and scales.dtype == x2.dtype and 32 * q.shape[1] == x2.shape[1]
                    and scales.shape[0] == int4.groups(x2.shape[1], group)
                    and calls.tma_ready(metadata) and calls.tma_ready(scales) for q, metadata, scales in weights))


_GROUP_PLANS = plans.PlanCache()


def sp24_w4_group_into(*args, out):
    """Grouped 4-bit products as a compiled graph calls them (semi24/compiled.py): args are X
    (2-D), each weight's qweight, metadata and scales, then the scale group; Y [M, sum of the
    weights' rows] in `out`. One launch where w4_group_plan applies, else each product into its columns."""
    *tensors, group = args
    x, weights = tensors[0], [tuple(tensors[at:at + 3]) for at in range(1, len(tensors), 3)]
    signature = (x.shape, x.dtype, group, *(t.data_ptr() for weight in weights for t in weight))
    plan = _GROUP_PLANS.get(weights[0][1], signature, lambda: w4_group_plan(x, weights, group))
    x_address, y_address = x.data_ptr(), out.data_ptr()
    if plan is not None and lean.runs_into(plan, x, out, x_address | y_address):
        plan.run_at(x_address, 0, y_address)
        return
    at = 0
    for q, metadata, scales in weights:
        n = 16 * q.shape[0]
        sp24_w4_linear_into(x, q, metadata, scales, None, group, n, "none", out=out[..., at:at + n])
        at += n


class W4Args:
    """sp24_w4_linear's arguments as the lowering reads them: x, qweight, metadata, scales,
    bias, then group, out_features and epilogue."""
    tensors = ("x", "qweight", "metadata", "scales", "bias")
    optional = ("bias",)

    @staticmethod
    def out_features_and_epilogue(args: tuple) -> tuple:
        return args[6], args[7]


def _fake_w4_product(x2, qweight, metadata, scales, bias, group, out_features, epilogue):
    return x2.new_empty((x2.shape[0], epilogues.output_features(epilogue, out_features)))


w4_product = library.eager_or_op(library.define(
    "sp24_w4_linear(Tensor x, Tensor qweight, Tensor metadata, Tensor scales, Tensor? bias, int group, "
    "int out_features, str epilogue) -> Tensor", _w4_product, _fake_w4_product), _w4_product)


def int4_product(x: Tensor, qweight: Tensor, metadata: Tensor, scales: Tensor, bias: Tensor | None, group: int,
                 out_features: int, epilogue: str = "none") -> Tensor:
    """x [..., K] (the scales' dtype or float32, computed in the scales') times the 4-bit
    weight, bias and epilogue applied, in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).to(scales.dtype)
    y = w4_product(x2, qweight, metadata, scales, bias, group, out_features, epilogue)
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


class _InputGradient(torch.autograd.Function):
    """int4_product, no epilogue, for an input that needs its gradient (the layer's 4-bit
    values are frozen): trainable layers around a frozen 4-bit one, QLoRA-style. dX = dY W, W
    dequantized for the backward, then dropped. The layer applies its epilogue after."""

    @staticmethod
    def forward(ctx, x, qweight, metadata, scales, bias, group, out_features):
        ctx.save_for_backward(qweight, metadata, scales)
        ctx.group = group
        return int4_product(x, qweight, metadata, scales, bias, group, out_features)

    @staticmethod
    def backward(ctx, dy):
        weight = dequantized_weight(*ctx.saved_tensors, ctx.group)
        return (dy @ weight.to(dy.dtype),) + (None,) * 6


class Int4Sparse24Linear(lean.LeanLayer, epilogues.Fusable, checkpoint.CheckedLoad, nn.Module):
    """Inference layer: `qweight` (int32 words of the kept values, int4.py's layout), `metadata`
    (mma.sp's, as Sparse24Linear's), `scales` [ceil(in / group), out] in the activations' dtype
    (bf16 or fp16), `bias`. Inputs in that dtype, or float32 (computed in it, returned in
    float32). fuse(epilogue) applies an activation or a gated product in the kernel."""

    def __init__(self, qweight: Tensor, metadata: Tensor, scales: Tensor, bias: Tensor | None,
                 group_size: int | None = 128):
        super().__init__()
        n, k = 16 * qweight.shape[0], 32 * qweight.shape[1]
        group = int4.group_of(group_size, k)
        int4.check_parts(qweight, metadata, scales, (n, k), group)
        expect(bias is None or (isinstance(bias, Tensor) and tuple(bias.shape) == (n,)),
               f"bias of shape ({n},) or None", tuple(getattr(bias, "shape", ())) or type(bias).__name__)
        self._store(qweight, metadata, scales, bias, group)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group_size: int | None = 128, method: str = "magnitude",
                   mask: Tensor | None = None, dtype: torch.dtype | None = None) -> "Int4Sparse24Linear":
        """Prune `linear` to 2:4 (by `method` or `mask`), then quantize the kept values to 4 bits
        by round-to-nearest, a scale per output row and `group_size` input columns (None: per
        row). Scales in `dtype` (default: the linear's, bfloat16 for a float32 one)."""
        expect(isinstance(linear, nn.Linear), "an nn.Linear", type(linear).__name__)
        w = linear.weight.detach()
        semi24.check_shape(tuple(w.shape))
        dtype = dtype or int4.scale_dtype_for(w.dtype)
        kept, metadata = tensor.prune_and_compress(w.to(dtype), method, mask)
        group = int4.group_of(group_size, w.shape[1])
        q, scales = int4.quantize(kept, group, dtype)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls._of_own_parts(int4.pack(q), metadata, scales, bias, group)

    @classmethod
    def gated_pair(cls, gate: "Int4Sparse24Linear", up: "Int4Sparse24Linear", epilogue: str):
        """A gated MLP's gate and up as one layer with the gated `epilogue` (rows interleaved
        as epilogues.interleave_rows lays them out, each keeping its 4-bit values, kept
        positions and scales), or None for a pair that differs in shape, group, dtype or bias."""
        same = (gate.qweight.shape == up.qweight.shape and gate.group_size == up.group_size
                and gate.scales.dtype == up.scales.dtype and (gate.bias is None) == (up.bias is None)
                and gate.epilogue == up.epilogue == "none")
        if not same:
            return None
        both, (n, k) = epilogues.interleave_rows, (gate.out_features, gate.in_features)
        q = both(int4.unpack(gate.qweight), int4.unpack(up.qweight))
        positions = both(semi24.stored_positions(gate.metadata, n, k), semi24.stored_positions(up.metadata, n, k))
        bias = None if gate.bias is None else both(gate.bias.detach(), up.bias.detach())
        scales = both(gate.scales.t(), up.scales.t()).t().contiguous()
        return cls._of_own_parts(int4.pack(q), semi24.pack_metadata(positions), scales, bias, gate.group_size).fuse(
            epilogue)

    @classmethod
    def _of_own_parts(cls, qweight: Tensor, metadata: Tensor, scales: Tensor, bias: Tensor | None,
                      group: int) -> "Int4Sparse24Linear":
        """A layer of parts made here (packed, compressed and scaled by this module): __init__'s
        checks of parts from outside skipped (they read every metadata word back)."""
        layer = cls.__new__(cls)
        super(Int4Sparse24Linear, layer).__init__()
        layer._store(qweight, metadata, scales, bias, group)
        return layer

    def _store(self, qweight: Tensor, metadata: Tensor, scales: Tensor, bias: Tensor | None, group: int) -> None:
        self.out_features, self.in_features, self.group_size = 16 * qweight.shape[0], 32 * qweight.shape[1], group
        self.register_buffer("qweight", qweight)
        self.register_buffer("metadata", metadata)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(scales.dtype).clone(), requires_grad=False)

    @property
    def weight(self) -> DenseWeightDescription:
        return DenseWeightDescription((self.out_features, self.in_features), self.scales.dtype, self.scales.device)

    _values_in, _values_name = "_buffers", "qweight"  # (lean.LeanLayer: calls planned on the packed values)

    def forward(self, x: Tensor) -> Tensor:
        y = self._lean_forward(x)  # a repeated signature: its planned launch
        if y is not None:
            return y
        buffers = self._buffers
        if not self._takes(x, buffers["scales"]):
            self._explain_bad_input(x)  # (one test for the common case; messages only when wrong)
        args = (x, buffers["qweight"], buffers["metadata"], buffers["scales"], self._parameters.get("bias"),
                self.group_size, self.out_features, self.epilogue)
        if torch.is_grad_enabled() and x.requires_grad:  # layers around it train (QLoRA-style): x's gradient
            return epilogues.differentiable(_InputGradient.apply(*args[:-1]), self.epilogue)
        return int4_product(*args)

    def _lean_call(self, x: Tensor, qweight: Tensor, bias) -> lean.LeanCall | None:
        """lean.LeanLayer's plan of this signature: the 4-bit kernel's launch, or None where the
        call takes the checked path (a float32, CPU or empty input, Hopper's prefill route)."""
        scales = self._buffers["scales"]
        if not (x.dtype is scales.dtype and self._takes(x, scales)):
            return None
        x2 = x.reshape(-1, self.in_features)
        if not _on_kernel(x2, qweight) or prefill_on_16_bit(x2.shape[0], x.device.index or 0):
            return None
        plan = _plan(x2, [(qweight, self._buffers["metadata"], scales)], self.group_size, self.epilogue)
        return lean.LeanCall(plan, x, qweight, bias)

    def _after_load(self) -> None:
        self._forget_lean_calls()

    # Tensor parallelism (sparsegen.parallel): parts compute, but no TP_SHARDED - a part's scales
    # ([groups, N]) split along another dim than its values and metadata, which one DTensor
    # placement per layer cannot say - so a part's state_dict is refused by name.
    def tp_granules(self) -> tuple[int, int]:
        """Rows: whole 16-row lines; columns: whole scale groups (per channel: 64, as 2:4's)."""
        return 16, self.group_size if self.group_size < self.in_features else 64

    def tp_part(self, rows: slice, columns: slice, keep_bias: bool) -> "Int4Sparse24Linear":
        """The layer of these weight rows and columns: its 4-bit values, kept positions and
        scales exactly (nothing quantized again); per channel, its columns' scale is the row's."""
        n, k = self.out_features, self.in_features
        nibbles = int4.unpack(self.qweight)[rows, in_units(columns, 2)]
        positions = semi24.stored_positions(self.metadata, n, k)[rows, in_units(columns, 4)]
        per_channel = self.group_size >= k
        scales = self.scales[:, rows] if per_channel else self.scales[in_units(columns, self.group_size), rows]
        bias = self.bias.detach()[rows] if keep_bias and self.bias is not None else None
        part = Int4Sparse24Linear._of_own_parts(
            int4.pack(nibbles.contiguous()), semi24.pack_metadata(positions.contiguous()), scales.contiguous(), bias,
            2 * nibbles.shape[1] if per_channel else self.group_size)
        part.epilogue = self.epilogue
        return part.train(self.training)

    def likely_specs(self, arch: int, sm_count: int) -> list:
        """The kernels this layer's forward takes at any token count (sparsegen.warm builds them
        ahead): sp24_w4's for each of its token buckets, and on Hopper the prefill route's. (Per
        bucket, not at dispatch.LIKELY_ROWS: those skip sp24_w4's 17-32, a decode of 32 sequences.)"""
        name = dispatch.DTYPE_NAMES[self.scales.dtype]
        hopper = arch >= 90
        narrow = w4_narrow(self.out_features, sm_count)
        found = [sp24_w4_spec(name, arch, rows=rows, epilogue=self.epilogue, narrow=narrow)
                 for rows in W4_ROWS if rows is not None or not hopper]
        if hopper:
            found += [sp24_compress_spec(name, arch, "sp24_w4_values"), sp24_spec(name, arch, epilogue=self.epilogue)]
        return found

    def _takes(self, x, scales: Tensor) -> bool:
        """x of the layer's width, on its device, in its dtype or float32 (what forward accepts)."""
        return (isinstance(x, Tensor) and x.dim() >= 1 and x.shape[-1] == self.in_features
                and (x.dtype is scales.dtype or x.dtype is torch.float32) and x.device == scales.device)

    def _explain_bad_input(self, x) -> None:
        expect(isinstance(x, Tensor) and x.dim() >= 1 and x.shape[-1] == self.in_features,
               f"input of shape (..., {self.in_features})", tuple(getattr(x, "shape", ())) or type(x).__name__)
        expect(x.dtype in (self.scales.dtype, torch.float32), f"input in {self.scales.dtype} (the layer's dtype) "
               "or float32", x.dtype)
        expect(x.device == self.scales.device, f"input on {self.scales.device} (the layer's device)", x.device)

    def to_dense_weight(self) -> Tensor:
        """The dequantized 2:4 weight [out, in] in the layer's dtype."""
        return dequantized_weight(self.qweight, self.metadata, self.scales, self.group_size)

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Module:
        """A dense nn.Linear of the dequantized weight (in `dtype`, default the layer's), then
        the epilogue where one is fused: the product this layer computes."""
        dtype = dtype or self.scales.dtype
        bias = None if self.bias is None else self.bias.detach().to(dtype)
        return self._dense_twin(dense_linear(self.to_dense_weight().to(dtype), bias))

    def _check_state(self, state_dict: dict, prefix: str) -> None:
        parts = [state_dict.get(prefix + name) for name in ("qweight", "metadata", "scales")]
        if all(isinstance(part, Tensor) for part in parts):
            int4.check_parts(*parts, (self.out_features, self.in_features), self.group_size)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, dtype={self.scales.dtype}{self._epilogue_repr()}")
