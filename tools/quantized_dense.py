"""The dense baselines of the one-byte 2:4 layers (bench only): the same quantization -
weights per output channel, activations per token (sparsegen.semi24.scaled) - with PyTorch's
dense one-byte products: torch._scaled_mm with row-wise scales for e4m3, torch._int_mm then
the scales for int8."""
from __future__ import annotations

import torch
from torch import nn

from sparsegen.semi24.scaled import WEIGHT_DTYPES, quantize, row_scales

_INT_MM_MIN_ROWS = 17  # torch._int_mm wants more than 16 rows: decode batches are padded


class QuantizedDenseLinear(nn.Module):
    def __init__(self, linear: nn.Linear, weight_dtype: str):
        super().__init__()
        dtype = WEIGHT_DTYPES[weight_dtype]
        weight = linear.weight.detach()
        self.register_buffer("weight_scale", row_scales(weight, dtype))
        self.register_buffer("weight", quantize(weight, self.weight_scale, dtype))  # [out, in] row-major
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        x_scale = row_scales(x2, self.weight.dtype)
        xq = quantize(x2, x_scale, self.weight.dtype)
        if self.weight.dtype == torch.int8:
            y = self._int8(xq, x_scale).to(x.dtype)
        else:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale.unsqueeze(-1),
                                 scale_b=self.weight_scale.unsqueeze(0), out_dtype=x.dtype, bias=bias)
        return y.reshape(*x.shape[:-1], self.weight.shape[0])

    def _int8(self, xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        rows = xq.shape[0]
        if rows < _INT_MM_MIN_ROWS:
            xq = torch.nn.functional.pad(xq, (0, 0, 0, _INT_MM_MIN_ROWS - rows))
        y = torch._int_mm(xq, self.weight.t())[:rows].float() * x_scale.unsqueeze(-1) * self.weight_scale
        return y if self.bias is None else y + self.bias.float()


def quantize_linears(model: nn.Module, pattern: str, weight_dtype: str) -> nn.Module:
    """Every nn.Linear whose name fully matches `pattern` becomes a QuantizedDenseLinear."""
    import re

    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and re.fullmatch(pattern, name):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, QuantizedDenseLinear(module, weight_dtype))
    return model
