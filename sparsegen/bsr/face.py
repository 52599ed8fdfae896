"""How users ask for block-CSR layers: sparsegen.linear(sparsity="block", block=, density=
or layout=) (registry.Face)."""
from __future__ import annotations

from ..jit import registry
from .nn import BlockSparseLinear


def build(in_features, out_features, bias, device, dtype, given) -> BlockSparseLinear:
    return BlockSparseLinear(in_features, out_features, given.get("block", (32, 32)), given.get("density", 0.5),
                             bias, device, dtype, given.get("layout"))


FACES = (registry.Face("block", ("block", "density", "layout"), build),)
