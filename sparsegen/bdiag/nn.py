"""BlockDiagonalLinear: a drop-in nn.Linear whose weight is block-diagonal."""
from __future__ import annotations

import torch
from torch import nn

from .. import gathered
from ..errors import expect, positive_int
from . import format as diag
from . import ops


class BlockDiagonalLinear(gathered.FixedRowsLinear):
    """y = x W^T + b with W [out, in] made of `nblocks` dense [out / nblocks, in / nblocks]
    blocks on its diagonal (Monarch's block-diagonal factor): density 1 / nblocks, no index.
    `block` is the kernel's tile inside a diagonal block (default: the largest of 64, 32, 16
    dividing it). `blocks()` gives the diagonal blocks [nblocks, n, k]."""

    PRODUCT = ops.BDIAG_DDS

    def __init__(self, in_features: int, out_features: int, nblocks: int = 4, bias: bool = True, device=None,
                 dtype=None, block=None):
        super().__init__()
        self.in_features = positive_int(in_features, "in_features")
        self.out_features = positive_int(out_features, "out_features")
        shape = diag.plan_shape(out_features, in_features, nblocks, block)
        self.nblocks, self.block, self.diagrows = shape.nblocks, shape.block, shape.diagrows
        self._make_parameters(out_features // self.block[0], shape.rowblocks, bias,
                              dict(device=device, dtype=dtype))

    @property
    def density(self) -> float:
        return 1.0 / self.nblocks

    def op_args(self) -> tuple:
        return self.values.shape[1], self.diagrows

    def blocks(self) -> torch.Tensor:
        return diag.untile(self.values, self.nblocks)

    def to_dense_weight(self) -> torch.Tensor:
        return diag.to_dense(self.values, self.nblocks)

    @classmethod
    def from_dense(cls, linear: nn.Linear, nblocks: int = 4, block=None) -> "BlockDiagonalLinear":
        """Keep the diagonal blocks of `linear.weight`."""
        expect(isinstance(linear, nn.Linear), "an nn.Linear", type(linear).__name__)
        weight = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, nblocks, linear.bias is not None, weight.device,
                    weight.dtype, block)
        with torch.no_grad():
            layer.values.copy_(diag.tile(diag.diagonal_of(weight, layer.nblocks), layer.block))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, nblocks={self.nblocks}, "
                f"block={self.block}, bias={self.bias is not None}{self._epilogue_repr()}")
