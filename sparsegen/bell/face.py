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


def patched(linear, settings: dict, from_dense: bool) -> BlockEllLinear:
    """A patch rule's layer: the blocks of largest norm in each block row, or fresh ones."""
    one_of(settings, "per_row", "density")
    block, density, per_row = settings.get("block", (32, 32)), settings.get("density", 0.5), settings.get("per_row")
    if from_dense:
        return BlockEllLinear.from_dense(linear, block, density, per_row)
    weight = linear.weight
    return BlockEllLinear(linear.in_features, linear.out_features, block, density, per_row, linear.bias is not None,
                          weight.device, weight.dtype)


FACES = (registry.Face("block-ell", ("block", "density", "per_row"), build, rule=("block", "density", "per_row"),
                       patch=patched,
                       examples=(("block", (64, 64), lambda layer: layer.block == (64, 64)),
                                 ("density", 0.25, lambda layer: layer.per_row == 1),
                                 ("per_row", 1, lambda layer: layer.per_row == 1 and layer.density == 0.25)),
                       tuning=registry.Tuning("bell", (((64, 64), 0.5), ((64, 64), 0.25), ((32, 32), 0.5)),
                                              lambda n, k, block, density, **factory: BlockEllLinear(
                                                  k, n, block=block, density=density, **factory))),)
