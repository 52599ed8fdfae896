"""Block-diagonal kernels: the layout kit's forward op (gathered_specs.py) with no index, its
column rule needing one more parameter, `diagrows`; and the set precompile builds."""
from __future__ import annotations

from pathlib import Path

from ..jit import gathered_specs, registry

DIAGROWS = registry.Param("diagrows", 1, doc="block rows in each diagonal block")
PRECOMPILED = ((16, 16), (4, 4))  # (rowblocks, diagrows) of 64x64 tiles: 4096^2 and 1024^2 weights in 4 blocks


def forward_spec(block, dtype: str, arch: int, rowblocks: int, diagrows: int, rows: int | None = None, **options):
    return gathered_specs.forward_spec("bdiag_dds", block, dtype, arch, {"rowblocks": rowblocks, "diagrows": diagrows},
                                       rows, **options)


def default_specs(arch: int, dtypes: tuple, blocks=None) -> list:
    """A few common shapes: a layer of another shape compiles its kernel on first use."""
    return [forward_spec((64, 64), d, arch, r, g, rows) for d in dtypes if d in ("bf16", "fp16")
            for r, g in PRECOMPILED for rows in (None, 1)]


registry.register(registry.Layout("bdiag", (
    gathered_specs.product_rules("bdiag_dds", "bdiag/bdiag_dds.cu.j2", params=(DIAGROWS,)),
), default_specs, Path(__file__).parent, lowerings_module="ops", faces_module="face"))
