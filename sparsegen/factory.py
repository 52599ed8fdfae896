"""sparsegen.linear: the drop-in for nn.Linear, over every layout's layers. Every argument
is used or refused: one a layout does not take is an InputError naming it, and a density
the layout's grid cannot give within DENSITY_TOLERANCE warns with the density the layer has."""
from __future__ import annotations

import warnings

import torch

from .errors import expect
from .jit import registry
from .layer import layer_dtype

# Every layout's faces (registry.Face, declared in its package): what `sparsity` names, and
# what each takes beyond in/out features, bias, device and dtype.
FACES = {face.sparsity: face for face in registry.faces()}
TAKES = {sparsity: face.takes for sparsity, face in FACES.items()}
SPARSITIES = tuple(FACES)
DENSITY_TOLERANCE = 0.01  # |asked - built| beyond this warns


def linear(in_features: int, out_features: int, block=None, density: float | None = None,
           bias: bool = True, device=None, dtype=None, layout=None, sparsity: str = "block",
           nblocks: int | None = None, weight_dtype: str | None = None, per_row: int | None = None, **recipe):
    """Drop-in for nn.Linear(in_features, out_features), by `sparsity`:
    - "block" (default): a BlockSparseLinear of `block` blocks (default (32, 32)) at `density`
      (default 0.5), or of the bool block `layout`;
    - "2:4": a Sparse24Linear; with 2by4-pretrain options (method, mask_interval, dw_sparse,
      soft_threshold) a Sparse24TrainingLinear; with weight_dtype ("e4m3", "int8") a
      ScaledSparse24Linear (inference: one-byte weights and per-token activations); with
      weight_dtype="int4" (or group_size=: 128 by default, -1 per output channel) an
      Int4Sparse24Linear (inference: 4-bit weights, 16-bit activations);
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
    layer = FACES[sparsity].make(in_features, out_features, bias, device, layer_dtype(dtype), given)
    _warn_if_density_differs(given.get("density"), layer)
    return layer


def _check_device(device) -> None:
    """A CUDA device with a torch that has none is our error, not torch's AssertionError."""
    if device is not None and torch.device(device).type == "cuda":
        expect(torch.cuda.is_available(), "a device this torch can use",
               f"{device!r}, but torch.cuda.is_available() is False (a CPU-only torch, or no GPU)")


def _warn_if_density_differs(asked, layer) -> None:
    """Densities round to whole blocks (and every block row keeps one): say what was built."""
    if asked is None or abs(layer.density - asked) <= DENSITY_TOLERANCE:
        return
    warnings.warn(f"sparsegen.linear: density={asked!r} is not a whole number of blocks on this layer's grid; "
                  f"the layer has density {layer.density:.4g} (every block row keeps at least one block).",
                  UserWarning, stacklevel=3)
