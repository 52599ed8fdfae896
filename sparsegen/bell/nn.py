"""BlockEllLinear: a drop-in nn.Linear whose weight is block-ELL."""
from __future__ import annotations

import math

import torch
from torch import nn

from .. import calls, checkpoint, epilogues, lean
from ..errors import expect, positive_int
from ..layer import SparseLinearForward, dense_linear
from . import format as ell
from . import ops
from .autograd import block_ell_linear, forward_product


class BlockEllLinear(SparseLinearForward, lean.LeanLayer, epilogues.Fusable, checkpoint.CheckedLoad, nn.Module):
    """y = x W^T + b with W [out, in] in blocks of shape `block`, every block row keeping the
    same number of them: `per_row`, or round(density x in / block[1]) (at least one).

    `cols` (an integer tensor [out / bm, per_row], each row's block columns increasing)
    fixes which blocks exist; otherwise each row's are drawn at random. `fuse(epilogue)`
    applies an activation or a gated product in the kernel (epilogues.py).
    """

    def __init__(self, in_features: int, out_features: int, block=(32, 32), density: float = 0.5,
                 per_row: int | None = None, bias: bool = True, device=None, dtype=None, cols=None):
        super().__init__()
        self.in_features = positive_int(in_features, "in_features")
        self.out_features = positive_int(out_features, "out_features")
        self.block = ell.check_block(block)
        grid = ell.grid_shape(out_features, in_features, self.block)
        self.per_row = ell.check_per_row(per_row, grid, density)
        cols = ell.random_cols(grid, self.per_row) if cols is None else ell.check_cols(cols, grid, self.per_row)
        factory = dict(device=device, dtype=dtype or torch.get_default_dtype())
        self.register_buffer("cols", cols.to(device))
        self.values = nn.Parameter(torch.empty(grid[0], self.per_row, *self.block, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.per_row * self.block[1])  # nn.Linear's, on the fan-in each output has
        nn.init.uniform_(self.values, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @property
    def density(self) -> float:
        return self.per_row * self.block[1] / self.in_features

    def to_dense_weight(self) -> torch.Tensor:
        return ell.to_dense(self.values, self.cols, (self.out_features, self.in_features))

    def _check_state(self, state_dict: dict, prefix: str) -> None:
        """A file's index is checked as a caller's is, before anything is copied."""
        cols = state_dict.get(prefix + "cols")
        if cols is not None:
            ell.check_cols(cols, ell.grid_shape(self.out_features, self.in_features, self.block), self.per_row)

    def _after_load(self) -> None:
        self._forget_lean_calls()

    def _differentiable_product(self, x, values, bias) -> torch.Tensor:
        return block_ell_linear(x, values, bias, self.cols, self.out_features)

    def _product(self, x, values, bias) -> torch.Tensor:
        return forward_product(x, values, bias, self.cols, self.out_features, self.epilogue)

    def _lean_call(self, x: torch.Tensor, values: torch.Tensor, bias):
        calls.check_inputs(x, values, bias, self.in_features)
        plan = ops.bell_lean_plan(x, values, self.cols, self.out_features, self.epilogue)
        return None if plan is None else lean.LeanCall(plan, x, values, bias)

    @classmethod
    def from_dense(cls, linear: nn.Linear, block=(32, 32), density: float = 0.5,
                   per_row: int | None = None) -> "BlockEllLinear":
        """Keep, in each block row of `linear.weight`, the blocks with the largest norm."""
        expect(isinstance(linear, nn.Linear), "an nn.Linear", type(linear).__name__)
        weight, block = linear.weight.detach(), ell.check_block(block)
        grid = ell.grid_shape(linear.out_features, linear.in_features, block)
        per_row = ell.check_per_row(per_row, grid, density)
        layer = cls(linear.in_features, linear.out_features, block, per_row=per_row, bias=linear.bias is not None,
                    device=weight.device, dtype=weight.dtype, cols=ell.top_norm_cols(weight, block, per_row))
        with torch.no_grad():
            layer.values.copy_(ell.gather_values(weight, layer.cols, block))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def to_linear(self) -> nn.Module:
        """A dense nn.Linear with this layer's weights (zeros where blocks are absent), then the
        epilogue where one is fused."""
        return self._dense_twin(dense_linear(self.to_dense_weight().detach(), self.bias))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"per_row={self.per_row} (density {self.density:.3f}), bias={self.bias is not None}"
                f"{self._epilogue_repr()}")
