"""sparsegen.linear: the drop-in for nn.Linear, over every layout's layers."""
from __future__ import annotations

import torch

from .bdiag.nn import BlockDiagonalLinear
from .bsr.nn import BlockSparseLinear
from .errors import expect
from .semi24.nn import Sparse24Linear
from .semi24.scaled import ScaledSparse24Linear
from .semi24.train import Sparse24TrainingLinear


SPARSITIES = ("block", "2:4", "block-diagonal")


def linear(in_features: int, out_features: int, block=(32, 32), density: float = 0.5,
           bias: bool = True, device=None, dtype=None, layout=None, sparsity: str = "block",
           nblocks: int | None = None, weight_dtype: str | None = None, **recipe):
    """Drop-in for nn.Linear(in_features, out_features): a BlockSparseLinear, or with
    sparsity="2:4" a Sparse24Linear (2:4 semi-structured; block, density and layout unused),
    or with 2:4 and 2by4-pretrain options (method, mask_interval, dw_sparse,
    soft_threshold) a Sparse24TrainingLinear, or with 2:4 and weight_dtype ("e4m3", "int8")
    a ScaledSparse24Linear (inference: one-byte weights and per-token activations), or with
    sparsity="block-diagonal" a BlockDiagonalLinear of `nblocks` diagonal blocks (default
    round(1 / density))."""
    expect(sparsity in SPARSITIES, f"sparsity one of {SPARSITIES}", repr(sparsity))
    expect(sparsity == "2:4" or not recipe, "no 2:4 training options for block sparsity", sorted(recipe))
    expect(sparsity == "block-diagonal" or nblocks is None, "nblocks only for sparsity='block-diagonal'",
           f"nblocks={nblocks!r}")
    if sparsity == "block-diagonal":
        expect(layout is None, "no block layout for sparsity='block-diagonal'", "a layout")
        return BlockDiagonalLinear(in_features, out_features, nblocks or max(1, round(1 / density)), bias, device,
                                   dtype)
    expect(sparsity == "2:4" or weight_dtype is None, "weight_dtype only for sparsity='2:4'",
           f"weight_dtype={weight_dtype!r}")
    if sparsity == "2:4":
        expect(layout is None, "no block layout for sparsity='2:4'", "a layout")
        if weight_dtype is not None:
            expect(not recipe, "no training options for one-byte weights (an inference layer)", sorted(recipe))
            dense = torch.nn.Linear(in_features, out_features, bias, device, dtype)
            return ScaledSparse24Linear.from_dense(dense, weight_dtype)
        if recipe:
            return Sparse24TrainingLinear(in_features, out_features, bias, device, dtype, **recipe)
        return Sparse24Linear(in_features, out_features, bias, device, dtype)
    return BlockSparseLinear(in_features, out_features, block, density, bias, device, dtype, layout)
