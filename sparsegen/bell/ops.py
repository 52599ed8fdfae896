"""The block-ELL forward: its PyTorch reference, and the kit's product over it (the GPU
launch, the custom op torch.compile traces, the compiled graph's launcher)."""
from __future__ import annotations

import torch.nn.functional as F

from ..jit import epilogues
from .. import gathered
from . import format as ell


def dense_weight(values, in_features: int, cols, rowblocks: int, out_features: int):
    """W [out_features, in_features] with zeros where no block is kept (differentiable)."""
    return ell.to_dense(values, cols, (out_features, in_features))


def reference(x, values, bias, cols, rowblocks: int, out_features: int, epilogue: str = "none"):
    """Pure PyTorch: the dense weight, F.linear, the epilogue (differentiable, traceable)."""
    weight = dense_weight(values, x.shape[-1], cols, rowblocks, out_features)
    return epilogues.reference(F.linear(x, weight, bias), epilogue)


BELL_DDS = gathered.FixedRowsProduct("bell_dds", reference, dense_weight)
LOWERINGS = (BELL_DDS.lowering,)


def bell_dds(x, values, cols, bias, out_features: int, epilogue: str = "none", out=None, tile=None, instr=None,
             acc="f32"):
    """epilogue(X W^T + b) on the GPU (gathered.FixedRowsProduct.gpu: `out`, and `tile`,
    `instr`, `acc` to force a kernel)."""
    return BELL_DDS.gpu(x, values, bias, cols, values.shape[1], out_features, epilogue, out=out, tile=tile,
                        instr=instr, acc=acc)
