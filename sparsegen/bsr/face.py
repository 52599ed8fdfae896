"""How users ask for block-CSR layers: sparsegen.linear(sparsity="block", block=, density=
or layout=) and patch rules of those settings (registry.Face)."""
from __future__ import annotations

import torch

from ..jit import registry
from .nn import BlockSparseLinear


def build(in_features, out_features, bias, device, dtype, given) -> BlockSparseLinear:
    return BlockSparseLinear(in_features, out_features, given.get("block", (32, 32)), given.get("density", 0.5),
                             bias, device, dtype, given.get("layout"))


def patched(linear, settings: dict, from_dense: bool) -> BlockSparseLinear:
    """A patch rule's layer: the blocks of largest norm of the linear's weight (or `layout`),
    or fresh ones."""
    block, density, layout = settings.get("block", (32, 32)), settings.get("density", 0.5), settings.get("layout")
    if from_dense:
        return BlockSparseLinear.from_dense(linear, block, density, layout)
    weight = linear.weight
    return BlockSparseLinear(linear.in_features, linear.out_features, block, density, linear.bias is not None,
                             weight.device, weight.dtype, layout)


FACES = (registry.Face("block", ("block", "density", "layout"), build, rule=("block", "density", "layout"),
                       patch=patched, pairs=lambda settings: "layout" not in settings,
                       examples=(("block", (64, 64), lambda layer: layer.block == (64, 64)),
                                 ("density", 0.25, lambda layer: layer.density == 0.25),
                                 ("layout", torch.ones(8, 4, dtype=torch.bool),
                                  lambda layer: layer.block == (32, 32) and layer.density == 1.0)),
                       tuning=registry.Tuning("bsr", (((64, 64), 0.5), ((64, 64), 0.25), ((128, 128), 0.25),
                                                      ((128, 128), 0.5), ((32, 32), 0.5), ((32, 32), 0.25),
                                                      ((16, 16), 0.25)),
                                              lambda n, k, block, density, **factory: BlockSparseLinear(
                                                  k, n, block=block, density=density, **factory))),)
