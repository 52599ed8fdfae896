"""BlockEllLinear: a drop-in nn.Linear whose weight is block-ELL."""
from __future__ import annotations

import torch
from torch import nn

from .. import gathered
from ..layer import finish_part, in_units
from ..errors import expect, positive_int
from . import format as ell
from . import ops


class BlockEllLinear(gathered.FixedRowsLinear):
    """y = x W^T + b with W [out, in] in blocks of shape `block`, every block row keeping the
    same number of them: `per_row`, or round(density x in / block[1]) (at least one).

    `cols` (an integer tensor [out / bm, per_row], each row's block columns increasing)
    fixes which blocks exist; otherwise each row's are drawn at random. `fuse(epilogue)`
    applies an activation or a gated product in the kernel (epilogues.py).
    """

    PRODUCT = ops.BELL_DDS

    def __init__(self, in_features: int, out_features: int, block=(32, 32), density: float = 0.5,
                 per_row: int | None = None, bias: bool = True, device=None, dtype=None, cols=None):
        super().__init__()
        self.in_features = positive_int(in_features, "in_features")
        self.out_features = positive_int(out_features, "out_features")
        self.block = ell.check_block(block)
        grid = ell.grid_shape(out_features, in_features, self.block)
        self.per_row = ell.check_per_row(per_row, grid, density)
        cols = ell.random_cols(grid, self.per_row) if cols is None else ell.check_cols(cols, grid, self.per_row)
        self.register_buffer("cols", cols.to(device))
        self._make_parameters(grid[0], self.per_row, bias, dict(device=device, dtype=dtype))

    @property
    def density(self) -> float:
        return self.per_row * self.block[1] / self.in_features

    def op_args(self) -> tuple:
        return self.cols, self.per_row

    def to_dense_weight(self) -> torch.Tensor:
        return ell.to_dense(self.values, self.cols, (self.out_features, self.in_features))

    def _check_state(self, state_dict: dict, prefix: str) -> None:
        """A file's index is checked as a caller's is, before anything is copied."""
        cols = state_dict.get(prefix + "cols")
        if cols is not None:
            ell.check_cols(cols, ell.grid_shape(self.out_features, self.in_features, self.block), self.per_row)

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
        return layer.copy_dense(weight, linear.bias)

    # Tensor parallelism (layer.py's contract, sparsegen.parallel): column-wise only, whole block
    # rows with their index rows. A row-wise share of the input columns would keep a different
    # number of blocks in each row, which block-ELL cannot hold.
    TP_SHARDED = {0: ("values", "cols", "bias")}

    def tp_granules(self) -> tuple[int, int]:
        return self.block

    def tp_part(self, rows: slice, columns: slice, keep_bias: bool) -> "BlockEllLinear":
        expect(columns == slice(None), "a block-ELL layer split column-wise (ColwiseParallel: whole block rows)",
               "a split of its input columns (each row would keep another number of blocks)")
        block_rows = in_units(rows, self.block[0])
        part = BlockEllLinear(self.in_features, self.cols[block_rows].shape[0] * self.block[0], self.block,
                              per_row=self.per_row, bias=False, device=self.values.device, dtype=self.values.dtype,
                              cols=self.cols[block_rows])
        with torch.no_grad():
            part.values.copy_(self.values[block_rows])
        return finish_part(part, self, rows, keep_bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"per_row={self.per_row} (density {self.density:.3f}), bias={self.bias is not None}"
                f"{self._epilogue_repr()}")
