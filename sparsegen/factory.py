"""sparsegen.linear: the drop-in for nn.Linear, over every layout's layers. Every argument
is used or refused: one a layout does not take is an InputError naming it, and a density
the layout's grid cannot give within DENSITY_TOLERANCE warns with the density the layer has."""
from __future__ import annotations

import warnings

import torch

from .bdiag.nn import BlockDiagonalLinear
from .bell.nn import BlockEllLinear
from .bsr.nn import BlockSparseLinear
from .errors import InputError, expect
from .semi24.nn import Sparse24Linear
from .semi24.scaled import ScaledSparse24Linear
from .semi24.train import Sparse24TrainingLinear

TRAINING_OPTIONS = ("method", "mask_interval", "dw_sparse", "soft_threshold")
# What each sparsity takes beyond in/out features, bias, device and dtype.
TAKES = {"block": ("block", "density", "layout"),
         "2:4": ("weight_dtype", *TRAINING_OPTIONS),
         "block-diagonal": ("nblocks", "density"),
         "block-ell": ("block", "density", "per_row")}
SPARSITIES = tuple(TAKES)
DENSITY_TOLERANCE = 0.01  # |asked - built| beyond this warns


def linear(in_features: int, out_features: int, block=None, density: float | None = None,
           bias: bool = True, device=None, dtype=None, layout=None, sparsity: str = "block",
           nblocks: int | None = None, weight_dtype: str | None = None, per_row: int | None = None, **recipe):
    """Drop-in for nn.Linear(in_features, out_features), by `sparsity`:
    - "block" (default): a BlockSparseLinear of `block` blocks (default (32, 32)) at `density`
      (default 0.5), or of the bool block `layout`;
    - "2:4": a Sparse24Linear; with 2by4-pretrain options (method, mask_interval, dw_sparse,
      soft_threshold) a Sparse24TrainingLinear; with weight_dtype ("e4m3", "int8") a
      ScaledSparse24Linear (inference: one-byte weights and per-token activations);
    - "block-diagonal": a BlockDiagonalLinear of `nblocks` diagonal blocks (or round(1 / density));
    - "block-ell": a BlockEllLinear of `block` blocks, `per_row` in each block row (or `density`).
    An argument the chosen sparsity does not take is an InputError naming it."""
    expect(sparsity in SPARSITIES, f"sparsity one of {SPARSITIES}", repr(sparsity))
    given = dict(block=block, density=density, layout=layout, nblocks=nblocks, weight_dtype=weight_dtype,
                 per_row=per_row, **recipe)
    given = {name: value for name, value in given.items() if value is not None}
    unused = sorted(set(given) - set(TAKES[sparsity]))
    expect(not unused, f"only arguments that sparsity={sparsity!r} takes: {', '.join(TAKES[sparsity])}",
           f"also {', '.join(unused)}")
    _check_device(device)
    layer = _BUILDERS[sparsity](in_features, out_features, bias, device, dtype, given)
    _warn_if_density_differs(given.get("density"), layer)
    return layer


def _check_device(device) -> None:
    """A CUDA device with a torch that has none is our error, not torch's AssertionError."""
    if device is not None and torch.device(device).type == "cuda":
        expect(torch.cuda.is_available(), "a device this torch can use",
               f"{device!r}, but torch.cuda.is_available() is False (a CPU-only torch, or no GPU)")


def _block(in_features, out_features, bias, device, dtype, given) -> BlockSparseLinear:
    return BlockSparseLinear(in_features, out_features, given.get("block", (32, 32)), given.get("density", 0.5),
                             bias, device, dtype, given.get("layout"))


def _sparse24(in_features, out_features, bias, device, dtype, given):
    recipe = {name: given[name] for name in TRAINING_OPTIONS if name in given}
    if "weight_dtype" in given:
        expect(not recipe, "no training options for one-byte weights (an inference layer)", sorted(recipe))
        dense = torch.nn.Linear(in_features, out_features, bias, device, dtype)
        return ScaledSparse24Linear.from_dense(dense, given["weight_dtype"])
    if recipe:
        return Sparse24TrainingLinear(in_features, out_features, bias, device, dtype, **recipe)
    return Sparse24Linear(in_features, out_features, bias, device, dtype)


def _block_diagonal(in_features, out_features, bias, device, dtype, given) -> BlockDiagonalLinear:
    _one_of(given, "nblocks", "density")
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


def _block_ell(in_features, out_features, bias, device, dtype, given) -> BlockEllLinear:
    _one_of(given, "per_row", "density")
    return BlockEllLinear(in_features, out_features, given.get("block", (32, 32)), given.get("density", 0.5),
                          given.get("per_row"), bias, device, dtype)


def _one_of(given: dict, first: str, second: str) -> None:
    expect(not (first in given and second in given), f"{first} or {second}, not both (each sets the other)",
           f"{first}={given.get(first)!r} and {second}={given.get(second)!r}")


_BUILDERS = {"block": _block, "2:4": _sparse24, "block-diagonal": _block_diagonal, "block-ell": _block_ell}


def _warn_if_density_differs(asked, layer) -> None:
    """Densities round to whole blocks (and every block row keeps one): say what was built."""
    if asked is None or abs(layer.density - asked) <= DENSITY_TOLERANCE:
        return
    warnings.warn(f"sparsegen.linear: density={asked!r} is not a whole number of blocks on this layer's grid; "
                  f"the layer has density {layer.density:.4g} (every block row keeps at least one block).",
                  UserWarning, stacklevel=3)
