"""Block-ELL kernels: the layout kit's forward op (gathered_specs.py) reading each block's
column from the index `cols` (rowblocks, the blocks a row keeps, passed at launch: one kernel
serves every layer of a block size), and the set precompile builds."""
from __future__ import annotations

from pathlib import Path

from ..jit import gathered_specs, registry
from ..jit.spec import KernelSpec, TileConfig

PRECOMPILED_BLOCKS = ((32, 32), (64, 64))


def forward_spec(block, dtype: str, arch: int, rows: int | None = None, epilogue: str = "none",
                 tile: TileConfig | None = None, instr: str | None = None, acc: str = "f32") -> KernelSpec:
    return gathered_specs.forward_spec("bell_dds", block, dtype, arch, {}, rows, epilogue, tile, instr, acc)


def default_specs(arch: int, dtypes: tuple, blocks=None) -> list[KernelSpec]:
    """Every layer of these block sizes, large batches and small."""
    return [forward_spec(b, d, arch, rows) for d in dtypes if d in ("bf16", "fp16")
            for b in (blocks or PRECOMPILED_BLOCKS) for rows in (None, 1)]


registry.register(registry.Layout("bell", (
    gathered_specs.product_rules("bell_dds", "bell/bell_dds.cu.j2", index="cols"),
), default_specs, Path(__file__).parent, lowerings_module="ops", faces_module="face"))
