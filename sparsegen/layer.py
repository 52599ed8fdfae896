"""What every layout's nn modules share: autocast as nn.Linear does it, whether autograd
records a call, and the nn.Linear a sparse layer converts back to."""
from __future__ import annotations

import torch
from torch import nn

from .errors import expect
from .launch import calls, lean
from .jit import epilogues


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


class SparseLinearForward:
    """forward as every layout's inference layer runs it: the lean path for repeated calls
    (lean.LeanLayer), autocast, the input checks, then the layout's autograd Function where a
    gradient is needed, else its bare product (no autograd on the host path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._lean_forward(x)
        if y is not None:
            return y
        x, values, bias = autocast_inputs(x, self.values, self.bias)
        calls.check_inputs(x, values, bias, self.in_features)
        if needs_grad(x, values, bias):
            return epilogues.differentiable(self._differentiable_product(x, values, bias), self.epilogue)
        return self._product(x, values, bias)


def one_of(given: dict, first: str, second: str) -> None:
    """Two arguments that set each other: one may be given, not both."""
    expect(not (first in given and second in given), f"{first} or {second}, not both (each sets the other)",
           f"{first}={given.get(first)!r} and {second}={given.get(second)!r}")
