"""How users ask for block-diagonal layers: sparsegen.linear(sparsity="block-diagonal",
nblocks= or density=) (registry.Face)."""
from __future__ import annotations

from ..errors import InputError, expect
from ..jit import registry
from ..layer import one_of
from .nn import BlockDiagonalLinear


def build(in_features, out_features, bias, device, dtype, given) -> BlockDiagonalLinear:
    one_of(given, "nblocks", "density")
    if "nblocks" in given:
        return BlockDiagonalLinear(in_features, out_features, given["nblocks"], bias, device, dtype)
    density = given.get("density", 0.5)
    expect(isinstance(density, (int, float)) and not isinstance(density, bool) and 0 < density <= 1,
           "density in (0, 1] (block-diagonal: 1 / the number of diagonal blocks)", repr(density))
    nblocks = max(1, round(1 / density))
    try:
        return BlockDiagonalLinear(in_features, out_features, nblocks, bias, device, dtype)
    except InputError as error:
        raise InputError(f"density={density!r} means {nblocks} diagonal blocks (1 / density, rounded), "
                         f"which this shape cannot take: {error} Pass nblocks= to choose them.") from None


def patched(linear, settings: dict, from_dense: bool) -> BlockDiagonalLinear:
    """A patch rule's layer: the linear's diagonal blocks, or fresh ones. (Never a gated
    pair: the diagonal blocks of interleaved gate/up rows would pair gate rows with up rows.)"""
    nblocks = settings.get("nblocks", max(1, round(1 / settings.get("density", 0.5))))
    if from_dense:
        return BlockDiagonalLinear.from_dense(linear, nblocks)
    weight = linear.weight
    return BlockDiagonalLinear(linear.in_features, linear.out_features, nblocks, linear.bias is not None,
                               weight.device, weight.dtype)


def _fits(n: int, k: int, block, density: float) -> bool:
    """16-wide tiles inside each diagonal block at least."""
    return n % (16 * round(1 / density)) == 0 and k % (16 * round(1 / density)) == 0


FACES = (registry.Face("block-diagonal", ("nblocks", "density"), build, rule=("nblocks", "density"),
                       patch=patched,
                       examples=(("nblocks", 2, lambda layer: layer.nblocks == 2),
                                 ("density", 0.25, lambda layer: layer.nblocks == 4)),
                       tuning=registry.Tuning("bdiag", (((0, 0), 0.5), ((0, 0), 0.25)),
                                              lambda n, k, block, density, **factory: BlockDiagonalLinear(
                                                  k, n, nblocks=round(1 / density), **factory),
                                              fits=_fits, tile=lambda layer, block: tuple(layer.block))),)
