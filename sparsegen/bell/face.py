"""How users ask for block-ELL layers: sparsegen.linear(sparsity="block-ell", block=, per_row=
or density=) (registry.Face)."""
from __future__ import annotations

from ..jit import registry
from ..layer import one_of
from .nn import BlockEllLinear


def build(in_features, out_features, bias, device, dtype, given) -> BlockEllLinear:
    one_of(given, "per_row", "density")
    return BlockEllLinear(in_features, out_features, given.get("block", (32, 32)), given.get("density", 0.5),
                          given.get("per_row"), bias, device, dtype)


FACES = (registry.Face("block-ell", ("block", "density", "per_row"), build),)
