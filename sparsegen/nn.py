"""BlockSparseLinear: a drop-in nn.Linear whose weight is block-sparse."""
from __future__ import annotations

import math

import torch
from torch import nn

from . import ops
from .autograd import Layout, block_sparse_linear
from .errors import expect
from .layouts import bsr


class BlockSparseLinear(nn.Module):
    """y = x W^T + b with W [out, in] stored as block-CSR blocks of shape `block`.

    `layout` (a bool tensor [out/bm, in/bk]) fixes which blocks exist; otherwise a random
    layout at `density` is drawn (rounded to whole blocks, no empty block row).
    """

    def __init__(self, in_features: int, out_features: int, block=(32, 32), density: float = 0.5,
                 bias: bool = True, device=None, dtype=None, layout: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        expect(len(tuple(block)) == 2, "block as (rows, cols)", block)
        self.block = tuple(int(b) for b in block)
        grid = bsr.grid_shape(self.out_features, self.in_features, self.block)
        mask = bsr.random_mask(grid, density) if layout is None else bsr.check_mask(layout, grid)
        factory = dict(device=device, dtype=dtype or torch.get_default_dtype())
        self.register_buffer("layout", mask.to(device))
        row_offsets, col_indices = bsr.indices(mask, device)
        self.register_buffer("row_offsets", row_offsets)
        self.register_buffer("col_indices", col_indices)
        self.values = nn.Parameter(torch.empty(int(mask.sum()), *self.block, **factory))
        self.bias = nn.Parameter(torch.empty(self.out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's uniform bound, on the fan-in the kept blocks actually give each output.
        fan_in = max(1.0, self.density * self.in_features)
        bound = 1.0 / math.sqrt(fan_in)
        nn.init.uniform_(self.values, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @property
    def mask(self) -> torch.Tensor:
        """Boolean block mask [out/bm, in/bk]."""
        return self.layout

    @property
    def density(self) -> float:
        return self.layout.sum().item() / max(1, self.layout.numel())

    def to_dense_weight(self) -> torch.Tensor:
        return bsr.values_to_dense(self.values, self.layout, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops.check_inputs(x, self.values, self.bias, self.in_features)
        if not x.is_cuda:
            return ops.reference_linear(x, self.values, self.layout, self.block, self.bias)
        if torch.is_grad_enabled() and (x.requires_grad or self.values.requires_grad):
            return block_sparse_linear(x, self.values, self.bias, self._autograd_layout())
        # Inference: straight to the kernel, no autograd bookkeeping on the host path.
        return ops.bsr_dds(x, self.values, self.row_offsets, self.col_indices, self.bias,
                           self.block, self.out_features)

    def _autograd_layout(self) -> Layout:
        """Cached while the index buffers stay the same tensors with the same contents
        (.to() makes new ones; load_state_dict bumps their version)."""
        stamp = (self.row_offsets.data_ptr(), self.row_offsets._version, self.col_indices._version)
        cached = getattr(self, "_layout_cache", None)
        if cached is None or cached[0] != stamp:
            layout = Layout(self.layout, self.row_offsets, self.col_indices, self.block,
                            (self.out_features, self.in_features))
            self._layout_cache = cached = (stamp, layout)
        return cached[1]

    @classmethod
    def from_dense(cls, linear: nn.Linear, block=(32, 32), density: float = 0.5,
                   layout: torch.Tensor | None = None) -> "BlockSparseLinear":
        """Keep the blocks of `linear.weight` with the largest norm (or those in `layout`)."""
        expect(isinstance(linear, nn.Linear), "an nn.Linear", type(linear).__name__)
        weight = linear.weight.detach()
        mask = layout if layout is not None else bsr.top_norm_mask(weight, tuple(block), density)
        layer = cls(linear.in_features, linear.out_features, block, bias=linear.bias is not None,
                    device=weight.device, dtype=weight.dtype, layout=mask)
        with torch.no_grad():
            layer.values.copy_(bsr.dense_to_values(weight, layer.layout, layer.block))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def extra_repr(self) -> str:
        nnz, total = int(self.layout.sum()), self.layout.numel()
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={self.block}, density={self.density:.3f} ({nnz}/{total} blocks), "
                f"bias={self.bias is not None}")


def linear(in_features: int, out_features: int, block=(32, 32), density: float = 0.5,
           bias: bool = True, device=None, dtype=None, layout=None) -> BlockSparseLinear:
    """Drop-in for nn.Linear(in_features, out_features) with a block-sparse weight."""
    return BlockSparseLinear(in_features, out_features, block, density, bias, device, dtype, layout)
