"""ScaledSparse24Linear: 2:4 weights stored in one byte (float8 e4m3 or int8) with a float32
scale per output channel, activations quantized per token on the fly (or by a static
per-tensor scale), bf16/fp16 in and out - the scheme of llm-compressor's FP8 2:4 models.

Y[t, f] = x_scale[t] * w_scale[f] * sum_k Xq[t, k] Wq[f, k] + bias[f], then the layer's
epilogue (an activation, or a gated product: epilogues.Fusable). The generated 2:4 kernel
takes the one-byte operands and applies both scales, the bias and the epilogue to its float32
sums before it rounds them once into Y (bf16 or fp16: the kernels' `scales` parameter). The
quantization before it is one pass too: the generated sp24_quantize kernel, or under
torch.compile Inductor's kernel that computes the activations (a norm's), where there is one
(compiled.py). Both compute the same bytes.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import checkpoint
from ..errors import InputError, expect
from ..jit import epilogues, registry
from ..launch import lean, library, runtime
from ..layer import WeightLike, dense_linear, in_units
from . import format as semi24
from . import dispatch, ops, scaled_lean, tensor

WEIGHT_DTYPES = {"e4m3": torch.float8_e4m3fn, "int8": torch.int8}
_LARGEST = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
# A row's scale is its largest magnitude times this (a multiplication, as the kernel computes it)
_INVERSE = {dtype: 1.0 / largest for dtype, largest in _LARGEST.items()}
_ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)
_TINY = 1e-12  # an all-zero row's scale (its values quantize to 0 whatever the scale)
_OWN_DTYPES = ("values", "weight_scale", "input_scale")  # tensors no cast of the model changes


def weight_dtype_of(name: str) -> torch.dtype:
    expect(name in WEIGHT_DTYPES, f"weight_dtype one of {sorted(WEIGHT_DTYPES)}", repr(name))
    return WEIGHT_DTYPES[name]


def row_scales(t: Tensor, dtype: torch.dtype) -> Tensor:
    """float32 [rows]: each row's largest magnitude over the type's largest value."""
    return (t.detach().abs().amax(-1).float() * _INVERSE[dtype]).clamp_min(_TINY)


def _by_row(scale: Tensor) -> Tensor:
    """A scale per row ([rows]) as a column that broadcasts over each row; one for all as is."""
    return scale.unsqueeze(-1) if scale.dim() else scale


def quantize(t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """t / scale (scale per row, [rows], or one for all) in `dtype`: saturated to its range,
    rounded to the nearest integer for int8."""
    q = t.float() / _by_row(scale)
    largest = _LARGEST[dtype]
    q = q.clamp(-largest, largest)
    return (q.round() if dtype == torch.int8 else q).to(dtype)


def quantized_rows(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(t quantized to `dtype` row by row, its float32 row scales): quantize(t, row_scales(t))'s
    bytes and scales - on a GPU in one sp24_quantize launch (the activations' kernel, which gives
    them bit for bit), where PyTorch's ops take ~8 launches and float32 copies of t."""
    if tensor.on_kernels(t) and ops.quantizes_on_kernel(t) and ops.has_byte_kernels(dtype, t.device):
        return ops.sp24_quantize(t, dtype)
    scale = row_scales(t, dtype)
    return quantize(t, scale, dtype).contiguous(), scale


def dequantized(values: Tensor, metadata: Tensor, w_scale: Tensor) -> Tensor:
    """The float32 [out, in] weight a one-byte 2:4 one with channel scales stands for."""
    dense = semi24.decompress(values, metadata, (values.shape[0], 2 * values.shape[1]))
    return dense.float() * w_scale.unsqueeze(-1)


def scaled_reference(xq: Tensor, values: Tensor, metadata: Tensor, x_scale: Tensor, w_scale: Tensor,
                     bias: Tensor | None, epilogue: str = "none") -> Tensor:
    """What the scaled kernel computes, in float64 (the CPU path and the tests' reference):
    x_scale [M] and w_scale [N] times the one-byte product, plus bias, then the epilogue."""
    weight = semi24.decompress(values, metadata, (values.shape[0], xq.shape[-1]))
    y = (xq.double() @ weight.double().t()) * x_scale.double().unsqueeze(-1) * w_scale.double()
    return epilogues.reference(y if bias is None else y + bias.double(), epilogue)


def _scaled_dds(xq: Tensor, values: Tensor, metadata: Tensor, x_scale: Tensor, w_scale: Tensor,
                bias: Tensor | None, epilogue: str, out_dtype: torch.dtype) -> Tensor:
    """The scaled product in out_dtype (bfloat16, float16): the generated kernel on the GPU,
    the float64 reference elsewhere."""
    if ops.runs_byte_kernels(values):
        return ops.sp24_scaled_dds(xq, values, metadata, x_scale, w_scale, bias, values.shape[0], out_dtype,
                                   epilogue=epilogue)
    return scaled_reference(xq, values, metadata, x_scale, w_scale, bias, epilogue).to(out_dtype)


def _fake_scaled_dds(xq, values, metadata, x_scale, w_scale, bias, epilogue, out_dtype):
    return xq.new_empty((xq.shape[0], epilogues.output_features(epilogue, values.shape[0])), dtype=out_dtype)


library.define(  # what the lowering of sp24_scaled_linear calls where Inductor quantizes
    "sp24_scaled_dds(Tensor x, Tensor values, Tensor metadata, Tensor x_scale, Tensor w_scale, Tensor? bias, "
    "str epilogue, ScalarType out_dtype) -> Tensor", _scaled_dds, _fake_scaled_dds)


def quantized_activations(x2: Tensor, values: Tensor, input_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """(x2 [M, K] in the values' one-byte dtype, its float32 scale per row [M]) in one pass: the
    sp24_quantize kernel on the GPU, PyTorch's ops elsewhere."""
    if ops.runs_byte_kernels(values) and ops.quantizes_on_kernel(x2):
        return ops.sp24_quantize(x2, values.dtype, input_scale)
    if input_scale is None:
        x_scale = row_scales(x2, values.dtype)
    else:  # one scale for every token, which the product's kernel reads per token
        x_scale = input_scale.float().expand(x2.shape[0]).contiguous()
    return quantize(x2, x_scale, values.dtype), x_scale


def _scaled_linear(x2: Tensor, values: Tensor, metadata: Tensor, w_scale: Tensor, bias: Tensor | None,
                   input_scale: Tensor | None, epilogue: str, out_dtype: torch.dtype) -> Tensor:
    """The activations quantized, then the scaled product: what a layer's call computes (in
    one launch where the product kernel can quantize them itself: up to 64 tokens on Hopper)."""
    if x2.dtype == out_dtype and ops.quantizes_in_product(x2, values, metadata):
        return ops.sp24_quantized_dds(x2, values, metadata, w_scale, bias, input_scale, values.shape[0], epilogue)
    xq, x_scale = quantized_activations(x2, values, input_scale)
    return _scaled_dds(xq, values, metadata, x_scale, w_scale, bias, epilogue, out_dtype)


def _fake_scaled_linear(x2, values, metadata, w_scale, bias, input_scale, epilogue, out_dtype):
    return _fake_scaled_dds(x2, values, metadata, None, w_scale, bias, epilogue, out_dtype)


# One op for a compiled graph. Its lowering (compiled.py) decides where the quantization runs:
# in Inductor's kernel that computes x (a norm, a copy), or in our sp24_quantize kernel inside
# the launcher where x comes from a kernel Inductor cannot join (an extern product, attention):
# there Inductor's quantization of a decode step's few long rows took three launches.
_scaled_linear_op = library.define(
    "sp24_scaled_linear(Tensor x, Tensor values, Tensor metadata, Tensor w_scale, Tensor? bias, "
    "Tensor? input_scale, str epilogue, ScalarType out_dtype) -> Tensor", _scaled_linear, _fake_scaled_linear)
scaled_linear = library.eager_or_op(_scaled_linear_op, _scaled_linear)


def scaled_product(x: Tensor, values: Tensor, metadata: Tensor, w_scale: Tensor, bias: Tensor | None,
                   input_scale: Tensor | None = None, epilogue: str = "none") -> Tensor:
    """x [..., K] (bf16, fp16 or float32) times the stored one-byte 2:4 weight, scales, bias and
    epilogue applied, in x's dtype (float32 inputs: computed in bfloat16, the kernels' widest Y)."""
    x2 = x.reshape(-1, x.shape[-1])
    out_dtype = x.dtype if x.dtype in ops.SCALED_OUTPUT_CODES else torch.bfloat16
    if bias is not None:
        bias = bias.to(out_dtype)
    y = scaled_linear(x2, values, metadata, w_scale, bias, input_scale, epilogue, out_dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


class _InputGradient(torch.autograd.Function):
    """scaled_product, no epilogue, for an input that needs its gradient (the layer's own tensors
    are frozen bytes and never get one): trainable layers around a frozen quantized one
    (QLoRA-style). The gradient passes the activations' quantization straight through:
    dX = dY (w_scale W). The layer applies its epilogue after, as autograd records it."""

    @staticmethod
    def forward(ctx, x, values, metadata, w_scale, bias, input_scale):
        ctx.save_for_backward(values, metadata, w_scale)
        return scaled_product(x, values, metadata, w_scale, bias, input_scale)

    @staticmethod
    def backward(ctx, dy):
        return (dy @ dequantized(*ctx.saved_tensors).to(dy.dtype),) + (None,) * 5


class ScaledSparse24Linear(lean.LeanLayer, WeightLike, epilogues.Fusable, checkpoint.CheckedLoad, nn.Module):
    """Inference layer: `values` [out, in/2] one-byte (the kept 2:4 weights quantized with
    `weight_scale` [out], float32, one per output channel), `metadata` as mma.sp reads it,
    `bias` in the activations' dtype, and optionally `input_scale` (a static per-tensor
    activation scale; without it each token is scaled by its own largest magnitude).
    fuse(epilogue) applies an activation or a gated product in the kernel (sparsegen.patch
    does for the activations and gated MLPs it recognises)."""

    def __init__(self, values: Tensor, metadata: Tensor, weight_scale: Tensor, bias: Tensor | None,
                 input_scale: Tensor | None = None):
        super().__init__()
        expect(values.dtype in _LARGEST, "one-byte values (float8_e4m3fn or int8)", values.dtype)
        semi24.check_shape((values.shape[0], 2 * values.shape[1]), cols=semi24.BYTE_COL_GRANULE)
        semi24.check_metadata(metadata, (values.shape[0], 2 * values.shape[1]))
        _check_vector(weight_scale, values.shape[0], "weight_scale")
        check_positive(weight_scale, "weight_scale")
        if input_scale is not None:
            expect(isinstance(input_scale, Tensor) and input_scale.numel() == 1, "input_scale as one float",
                   type(input_scale).__name__)
            check_positive(input_scale, "input_scale")
        self._store(values, metadata, weight_scale, bias, input_scale)

    @classmethod
    def _of_own_parts(cls, values: Tensor, metadata: Tensor, weight_scale: Tensor, bias: Tensor | None,
                      input_scale: Tensor | None) -> "ScaledSparse24Linear":
        """A layer of parts this module made itself (the compress kernel's metadata, row_scales'
        scales, a checked static scale): __init__'s checks of parts from outside skipped. Reading
        every metadata word back and testing the scales cost two GPU syncs and ~5 ms a layer: 0.06 s
        of a Phi-3-shaped model's cold FP8 patch (H200 profile)."""
        layer = cls.__new__(cls)
        super(ScaledSparse24Linear, layer).__init__()
        layer._store(values, metadata, weight_scale, bias, input_scale)
        return layer

    def _store(self, values: Tensor, metadata: Tensor, weight_scale: Tensor, bias: Tensor | None,
               input_scale: Tensor | None) -> None:
        self.out_features, self.in_features = values.shape[0], 2 * values.shape[1]
        self.register_buffer("values", values)
        self.register_buffer("metadata", metadata)
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(()))

    @classmethod
    def from_dense(cls, linear: nn.Linear, weight_dtype: str = "e4m3", method: str = "magnitude",
                   mask: Tensor | None = None, input_scale: float | Tensor | None = None):
        """Prune `linear` to 2:4 (by `method` or `mask`), quantize the kept weights per output
        channel to `weight_dtype` ("e4m3" or "int8") and compress them."""
        expect(isinstance(linear, nn.Linear), "an nn.Linear", type(linear).__name__)
        dtype, w = weight_dtype_of(weight_dtype), linear.weight.detach()
        semi24.check_shape(tuple(w.shape), cols=semi24.BYTE_COL_GRANULE)
        # Kept values first (on a GPU: the sp24_mask / sp24_compress kernels, one launch each,
        # where PyTorch ops took ~15 ms a layer), then quantized: a row's largest kept value is
        # its pruned row's largest, so the scales and bytes are those of quantize-then-compress.
        kept, metadata = tensor.prune_and_compress(w, method, mask)
        values, scale = quantized_rows(kept, dtype)
        static = None if input_scale is None else torch.as_tensor(input_scale, dtype=torch.float32, device=w.device)
        if static is not None:
            check_positive(static, "input_scale", finite=True)
        return cls._of_own_parts(values, metadata, scale, linear.bias, static)

    @classmethod
    def gated(cls, gate: "ScaledSparse24Linear", up: "ScaledSparse24Linear", epilogue: str = "swiglu"):
        """A gated MLP's gate and up projections (layers of one shape and activation scaling)
        as one layer with the gated `epilogue`: their stored rows interleaved as
        epilogues.interleave_rows lays out gate and up, so each keeps its bytes, kept
        positions and channel scales."""
        check_gated_pair(gate, up)
        n, k, both = gate.out_features, gate.in_features, epilogues.interleave_rows
        positions = both(semi24.stored_positions(gate.metadata, n, k), semi24.stored_positions(up.metadata, n, k))
        values = both(gate.values.view(torch.uint8), up.values.view(torch.uint8)).view(gate.values.dtype)
        bias = None if gate.bias is None else both(gate.bias.detach(), up.bias.detach())
        layer = cls._of_own_parts(values, semi24.pack_metadata(positions), both(gate.weight_scale, up.weight_scale),
                                  bias, gate.input_scale)
        return layer.fuse(epilogue)

    OWN_DTYPES = _OWN_DTYPES  # (sparsegen.dense_copy reads it: to_linear takes the model's dtype)

    @classmethod
    def gated_pair(cls, gate: "ScaledSparse24Linear", up: "ScaledSparse24Linear", epilogue: str):
        """gated(gate, up, epilogue), or None for a pair it cannot take as one (check_gated_pair:
        e.g. two static scales): a loaded checkpoint's gated MLP, fused where it can be."""
        try:
            check_gated_pair(gate, up)
        except InputError:
            return None
        return cls.gated(gate, up, epilogue)

    def _apply(self, fn, recurse=True):
        """Casts (model.half(), model.to(torch.bfloat16)) would turn the float8 values and the
        float32 scales into the cast's dtype: they keep their own (moves still move them)."""
        fixed = {name: getattr(self, name) for name in _OWN_DTYPES if getattr(self, name) is not None}
        super()._apply(fn, recurse)
        for name, before in fixed.items():
            after = getattr(self, name)
            if after.dtype != before.dtype:
                setattr(self, name, before.to(after.device))
        return self

    _values_in = "_buffers"  # (lean.LeanLayer: the values are a buffer here, not a parameter)

    def forward(self, x: Tensor) -> Tensor:
        if "_awaits_load" in self.__dict__:
            checkpoint.refuse_unloaded(self)
        y = self._lean_forward(x)  # a repeated signature: its planned launches (scaled_lean.py)
        if y is None:
            y = self._launched(x)  # (None where the call takes the checked path below)
        if y is not None:
            return y
        _check_input(x, self.values, self.in_features)
        args = (x, self.values, self.metadata, self.weight_scale, self.bias, self.input_scale, self.epilogue)
        if torch.is_grad_enabled() and x.requires_grad:  # layers around it train: x's gradient
            return epilogues.differentiable(_InputGradient.apply(*args[:-1]), self.epilogue)
        return scaled_product(*args)

    def _launched(self, x) -> Tensor | None:
        """Y for x as a compiled graph's call makes it, or None: the launcher registered for
        sp24_scaled_linear (semi24/compiled.py: a plan kept per signature, checks of what can
        change between calls only, the full path where no plan serves), into a new Y. Taken
        where _launches_as_compiled says, which holds only where _check_input would pass.
        Written flat, the tensors read from _buffers: a decode step makes this call per layer,
        and the GPU machine's host paid 35 us a call through the checked path's helpers."""
        buffers, bias = self._buffers, self._parameters.get("bias")
        values = buffers["values"]
        if not _launches_as_compiled(x, values, bias, self.in_features):
            return None
        x2 = x.reshape(-1, self.in_features)
        width = epilogues.output_features(self.epilogue, self.out_features)
        y = torch.empty((x2.shape[0], width), dtype=x.dtype, device=x.device)
        registry.launcher("sp24_scaled_linear")(x2, values, buffers["metadata"], buffers["weight_scale"], bias,
                                                buffers["input_scale"], self.epilogue, x.dtype, out=y)
        return y.view(*x.shape[:-1], width)

    def _lean_call(self, x: Tensor, values: Tensor, bias) -> lean.LeanCall | None:
        """lean.LeanLayer's plan of this signature, or None (the launcher or the checked path)."""
        if not _launches_as_compiled(x, values, bias, self.in_features):
            return None
        plan = scaled_lean.plan(x, values, self._buffers["metadata"], self._buffers, self.epilogue)
        return None if plan is None else lean.LeanCall(plan, x, values, bias)

    def _after_load(self) -> None:
        self._forget_lean_calls()

    def likely_specs(self, arch: int, sm_count: int) -> list:
        """The kernels this layer's forward likely takes (sparsegen.warm builds them ahead), for
        activations of the bias's dtype (bfloat16 without one, as most one-byte models run)."""
        activations = self.bias.dtype if self.bias is not None and self.bias.dtype in ops.SCALED_OUTPUT_CODES \
            else torch.bfloat16
        return list(dispatch.likely_specs(self.values.dtype, arch, sm_count, self.out_features, self.epilogue,
                                          activations))

    def to_dense_weight(self) -> Tensor:
        """The dequantized 2:4 weight, float32 [out, in]."""
        return dequantized(self.values, self.metadata, self.weight_scale)

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Module:
        """A dense nn.Linear of the dequantized weight in `dtype` (default: the bias's, else
        bfloat16), followed by the epilogue where one is fused. It computes the product the
        layer approximates: the layer also quantizes its input."""
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.bfloat16)
        expect(dtype in _ACTIVATIONS, f"a dtype in {list(_ACTIVATIONS)}", dtype)
        bias = None if self.bias is None else self.bias.detach().to(dtype)
        return self._dense_twin(dense_linear(self.to_dense_weight().to(dtype), bias))

    def _check_state(self, state_dict: dict, prefix: str) -> None:
        semi24.check_loaded_metadata(state_dict, prefix, (self.out_features, self.in_features))
        for name in ("weight_scale", "input_scale"):
            if isinstance(state_dict.get(prefix + name), Tensor):
                check_positive(state_dict[prefix + name], prefix + name)

    # Tensor parallelism (layer.py's contract, sparsegen.parallel): a part as stored - its bytes,
    # kept positions and channel scales. A column slice of whole 4-groups keeps each row's
    # scale: the ranks' partial products are scaled alike, and each quantizes its own
    # activation columns per token. (A row-wise part's scales are the whole's.)
    TP_SHARDED = {0: ("values", "metadata", "bias", "weight_scale"), 1: ("values", "metadata")}

    def tp_granules(self) -> tuple[int, int]:
        return 16, semi24.BYTE_COL_GRANULE

    def tp_part(self, rows: slice, columns: slice, keep_bias: bool) -> "ScaledSparse24Linear":
        n, k = self.out_features, self.in_features
        positions = semi24.stored_positions(self.metadata, n, k)[rows, in_units(columns, 4)]  # (per 4-group)
        bias = self.bias.detach()[rows] if keep_bias and self.bias is not None else None
        values = self.values[rows, in_units(columns, 2)].contiguous()  # (two kept per 4-group)
        part = ScaledSparse24Linear(values, semi24.pack_metadata(positions.contiguous()), self.weight_scale[rows], bias,
                                    self.input_scale)
        part.epilogue = self.epilogue
        return part.train(self.training)

    def extra_repr(self) -> str:
        scale = "per token" if self.input_scale is None else "static"
        return (f"in_features={self.in_features}, out_features={self.out_features}, sparsity=2:4, "
                f"weight_dtype={self.values.dtype}, activations {scale}, bias={self.bias is not None}"
                f"{self._epilogue_repr()}")


def _launches_as_compiled(x, values: Tensor, bias: Tensor | None, in_features: int) -> bool:
    """Whether an eager call takes the compiled graphs' launcher (ScaledSparse24Linear._launched):
    a plain CUDA tensor of the kernels' 16-bit dtypes and the layer's width, on the layer's
    device and the current one (the launcher allocates there), a bias of x's dtype, rows to
    compute, no autocast, no input gradient. The lean path Sparse24Linear has; what it takes,
    _check_input accepts."""
    return (lean.applies(x) and x.is_cuda and x.dtype in ops.SCALED_OUTPUT_CODES and x.dim() >= 1
            and x.shape[-1] == in_features and x.numel() > 0 and (bias is None or bias.dtype == x.dtype)
            and not (x.requires_grad and torch.is_grad_enabled())
            and x.get_device() == values.get_device() == runtime.current_device())


def _check_input(x, values: Tensor, in_features: int) -> None:
    expect(isinstance(x, Tensor), "input to be a torch.Tensor", type(x).__name__)
    expect(x.dtype in _ACTIVATIONS, f"an input in {list(_ACTIVATIONS)} (quantized by the layer)", x.dtype)
    expect(x.dim() >= 1 and x.shape[-1] == in_features, f"input of shape (..., {in_features})", tuple(x.shape))
    expect(x.device == values.device, f"input on {values.device} (the layer's device)", x.device)


def check_gated_pair(gate, up) -> None:
    """gate and up fit ScaledSparse24Linear.gated (an InputError naming what differs otherwise)."""
    expect(isinstance(gate, ScaledSparse24Linear) and isinstance(up, ScaledSparse24Linear),
           "gate and up as ScaledSparse24Linears", f"{type(gate).__name__} and {type(up).__name__}")
    same_scaling = (gate.input_scale is None and up.input_scale is None) or (
        gate.input_scale is not None and up.input_scale is not None and torch.equal(gate.input_scale, up.input_scale))
    expect(gate.values.shape == up.values.shape and gate.values.dtype == up.values.dtype and same_scaling
           and (gate.bias is None) == (up.bias is None) and gate.epilogue == up.epilogue == "none",
           "gate and up of one shape, weight dtype, activation scaling and bias, without epilogues",
           f"{gate!r} and {up!r}")


def check_positive(scale: Tensor, what: str, finite: bool = False) -> None:
    """Scales above 0 (0 or below would give NaN or sign-flipped outputs), and with `finite`
    finite too (a loader that was told allow_nonfinite=True keeps NaN and Inf, and checks the
    rest itself). A layer built on the meta device has no values yet: its checkpoint's are
    checked on load."""
    if scale.is_meta:
        return
    ok = scale.is_floating_point() and not bool((scale <= 0).any())
    if ok and (not finite or bool(torch.isfinite(scale).all())):
        return
    values = f"values from {scale.float().min().item():g} to {scale.float().max().item():g}" if scale.numel() else "none"
    expect(False, f"{what} of {'finite ' if finite else ''}scales above 0", f"{scale.dtype}, {values}")


def _check_vector(t, n: int, what: str) -> None:
    expect(isinstance(t, Tensor) and t.numel() == n and t.is_floating_point(),
           f"{what} of {n} floats (one per output channel)",
           f"{tuple(t.shape)}, {t.dtype}" if isinstance(t, Tensor) else type(t).__name__)
