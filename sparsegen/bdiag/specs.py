"""Block-diagonal kernels: the layout kit's forward op (gathered_specs.py) with no index, its
column rule needing one more parameter, `diagrows`. Both parameters are compiled in (a kernel
per diagonal block's shape): diagrows because the column's division by it at run time cost
the forward 2-13% on an H100, rowblocks because a known trip count of the block loop gained
2-4% at 8192x4096x11008 in 8 blocks (tools/bench.py --bdiag, old tree against new side by
side). And the set precompile builds."""
from __future__ import annotations

from pathlib import Path

from ..jit import gathered_specs, registry

DIAGROWS = registry.Param("diagrows", 1, doc="block rows in each diagonal block")


PRECOMPILED_DIAGROWS = (16, 4)  # of 64x64 tiles: 4096^2 and 1024^2 weights in 4 (square) blocks


def forward_spec(block, dtype: str, arch: int, diagrows: int, rowblocks: int, rows: int | None = None, **options):
    params = {"rowblocks": rowblocks, "diagrows": diagrows}
    return gathered_specs.forward_spec("bdiag_dds", block, dtype, arch, params, rows, **options)


def default_specs(arch: int, dtypes: tuple, blocks=None) -> list:
    """64x64 tiles of a few shapes: another diagonal block height compiles its kernel on first use."""
    return [forward_spec((64, 64), d, arch, g, g, rows) for d in dtypes if d in ("bf16", "fp16")
            for g in PRECOMPILED_DIAGROWS for rows in (None, 1)]


registry.register(registry.Layout("bdiag", (
    gathered_specs.product_rules("bdiag_dds", "bdiag/bdiag_dds.cu.j2", params=(DIAGROWS,), compile_time=("rowblocks", "diagrows")),
), default_specs, Path(__file__).parent, lowerings_module="ops", faces_module="face"))
