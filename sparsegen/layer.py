"""What every layout's nn modules share: autocast as nn.Linear does it, whether autograd
records a call, and the nn.Linear a sparse layer converts back to."""
from __future__ import annotations

import torch
from torch import nn

from . import env
from .checkpoint import refuse_unloaded
from .errors import InputError, expect
from .launch import calls, lean
from .jit import epilogues, registry


# The dtypes a layer's weights may have, by torch.dtype or by these names (sparsegen.linear's
# dtype=; one-byte weights are weight_dtype="e4m3" / "int8" of 2:4 layers).
DTYPES_BY_NAME = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
                  "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
                  "fp32": torch.float32, "float": torch.float32, "float64": torch.float64, "fp64": torch.float64,
                  "double": torch.float64}


def layer_dtype(dtype) -> torch.dtype | None:
    """dtype as a torch.dtype a layer's weights may have (None: torch's default), a name of
    DTYPES_BY_NAME taken for its dtype; an InputError listing both otherwise."""
    if dtype is None or dtype in DTYPES_BY_NAME.values():
        return dtype
    expect(isinstance(dtype, str) and dtype in DTYPES_BY_NAME,
           f"dtype one of {sorted(set(DTYPES_BY_NAME.values()), key=str)} or a name of one ({', '.join(DTYPES_BY_NAME)}); "
           "one-byte weights: sparsity='2:4' with weight_dtype='e4m3' or 'int8' (int8 and float8_e4m3fn: "
           "sparsegen.to_sparse24 for inference)", repr(dtype))
    return DTYPES_BY_NAME[dtype]


def dense_linear(weight: torch.Tensor, bias) -> nn.Linear:
    """An nn.Linear holding copies of a dense weight [out, in] and bias (for to_linear)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                       dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def autocast_inputs(x: torch.Tensor, values: torch.Tensor, bias):
    """Under torch.autocast, as nn.Linear does: input, values and bias in the autocast
    dtype (float32 parameters get float32 gradients back through the cast)."""
    # One cheap global test first: this runs on every forward call.
    if not lean.any_autocast():
        return x, values, bias
    on = (isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type in ("cuda", "cpu")
          and torch.is_autocast_enabled(x.device.type))
    if not on:
        return x, values, bias
    dtype = torch.get_autocast_dtype(x.device.type)
    return x.to(dtype), values.to(dtype), None if bias is None else bias.to(dtype)


def needs_grad(x: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    """Whether autograd must record this call (under torch.compile: decided when tracing)."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))


class DenseWeightDescription:
    """What a sparse layer answers for `weight`: the dense weight's shape, dtype and device,
    for code written for nn.Linear that reads those (`x.to(proj.weight.dtype)`). It is no
    tensor - the dense weight is stored nowhere - so code that would read or write its values
    (an init, `.data`, `.requires_grad = False`) fails loudly instead of touching nothing."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device):
        for name, value in (("shape", torch.Size(shape)), ("dtype", dtype), ("device", device)):
            object.__setattr__(self, name, value)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return self.shape.numel()

    def __getattr__(self, name: str):
        raise AttributeError(f"A sparse layer's weight is a description of the dense weight (shape, dtype, "
                             f"device), not a tensor: it has no {name!r}. The stored values are the layer's "
                             "`values`; `to_dense_weight()` builds the dense weight.")

    def __setattr__(self, name: str, value) -> None:
        raise InputError(f"Expected changes to a sparse layer's own parameters (`values`, `bias`; "
                         f"layer.requires_grad_(False) freezes them). Got {name!r} set on its weight's description.")

    def __reduce__(self):  # (copies and pickles are made anew: __setattr__ refuses every name)
        return DenseWeightDescription, (tuple(self.shape), self.dtype, self.device)

    def __repr__(self) -> str:
        return f"DenseWeightDescription(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


class WeightLike:
    """`weight` as code written for nn.Linear reads it besides its values - a
    DenseWeightDescription in the stored values' dtype and device."""

    @property
    def weight(self) -> DenseWeightDescription:
        return DenseWeightDescription((self.out_features, self.in_features), self.values.dtype, self.values.device)


class SparseLinearForward(WeightLike):
    """forward as every layout's inference layer runs it: the lean path for repeated calls
    (lean.LeanLayer), autocast, the input checks, then the layout's autograd Function where a
    gradient is needed, else its bare product (no autograd on the host path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "_awaits_load" in self.__dict__:
            refuse_unloaded(self)
        y = self._lean_forward(x)
        if y is not None:
            return y
        x, values, bias = autocast_inputs(x, self.values, self.bias)
        calls.check_inputs(x, values, bias, self.in_features)
        if needs_grad(x, values, bias):
            y = self._differentiable_product(x, values, bias)
            return epilogues.differentiable(y, self.epilogue, gated_kernels(y, self.epilogue))
        return self._product(x, values, bias)


GATED_PRODUCT_ACTIVATIONS = ("silu", "gelu")  # the gates the gated_product kernel has (other ones: PyTorch's ops)


def gated_kernels(y: torch.Tensor, epilogue: str):
    """The gated_product kernels (forward, gradient) for a training step's gated epilogue on
    y, where they take it: a plain 16-bit CUDA tensor on a GPU the templates cover, outside
    torch.compile's tracing (Inductor fuses the PyTorch ops there), SPARSEGEN_GATED_KERNEL
    not 0. Else None: PyTorch's ops."""
    gate = epilogues.activation(epilogue) if epilogues.is_gated(epilogue) else None
    if not (gate in GATED_PRODUCT_ACTIVATIONS and type(y) is torch.Tensor and calls.runs_16bit_kernels(y)):
        return None
    if torch.compiler.is_compiling() or not env.gated_kernel():
        return None
    return registry.kit_kernel("gated_product"), registry.kit_kernel("gated_product_grad")


def one_of(given: dict, first: str, second: str) -> None:
    """Two arguments that set each other: one may be given, not both."""
    expect(not (first in given and second in given), f"{first} or {second}, not both (each sets the other)",
           f"{first}={given.get(first)!r} and {second}={given.get(second)!r}")


# ---- tensor parallelism: what a layer lends sparsegen.parallel's styles ---------------------
# A splittable layer has `tp_granules()` -> (rows, columns): the multiples a rank's share of its
# out_features and in_features must be (whole blocks, 2:4 groups); `tp_part(rows, columns,
# keep_bias)` -> a layer of its kind holding those weight rows and columns (the stored positions
# kept, not chosen again); and `TP_SHARDED` {0: column-wise, 1: row-wise: the state entries a
# part saves as DTensors of the whole layer}, where a part's state describes a whole one (a
# layer without it has its part's state_dict refused).

def weight_part(module: nn.Module, rows: slice, columns: slice) -> nn.Linear:
    """Those rows and columns of a sparse layer's weight, as a bias-free nn.Linear."""
    weight = module.to_dense_weight().detach()[rows, columns]
    return dense_linear(weight, None)


def finish_part(part: nn.Module, module: nn.Module, rows: slice, keep_bias: bool) -> nn.Module:
    """A part with `module`'s bias rows (where kept), epilogue and training mode."""
    part.bias = nn.Parameter(module.bias.detach()[rows].clone()) if keep_bias and module.bias is not None else None
    part.epilogue = getattr(module, "epilogue", "none")
    return part.train(module.training)


def in_units(cut: slice, by: int) -> slice:
    """The slice of whole units of `by` that `cut` (a slice of whole units) covers."""
    return slice(None if cut.start is None else cut.start // by, None if cut.stop is None else cut.stop // by)
