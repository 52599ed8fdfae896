"""Block-ELL kernels: their specs' rules, tile defaults and the set precompile builds.

bell_dds: Y = X W^T (+ bias, epilogue), W block-ELL (format.py). It renders the common
gathered-K kernels (templates/common/sg_gathered_dds*.cuh) with a row policy of its own:
`rowblocks`, the stored blocks of every block row, is a compile-time parameter of the spec
(registry.Param), so a row's start is a multiply and its trip count a constant.
"""
from __future__ import annotations

from pathlib import Path

from .. import registry
from ..errors import SpecError, expect
from ..spec import (SMEM_LIMIT, STAGE_BYTES_PER_ROW, KernelSpec, TileConfig, check_acc_on_mma, check_choice,
                    check_trans, stages_that_fit, tma_ring_bytes)

DTYPES = ("bf16", "fp16", "fp32")
INSTRS = ("mma", "tma", "pingpong")  # mma.sync anywhere; wgmma fed by TMA on sm_90a (16-bit)
ROWBLOCKS = registry.Param("rowblocks", 4, doc="stored blocks in every block row (the layout's per_row)")
MAX_ROWBLOCKS = 4096  # a kernel per value: a bound on what a name may ask to compile
PRECOMPILED_ROWBLOCKS = (8, 16)
PRECOMPILED_BLOCKS = ((32, 32), (64, 64))


def _smem(spec: KernelSpec) -> int:
    rows = spec.tile.tile_m + spec.block[0]
    return spec.tile.stages * rows * STAGE_BYTES_PER_ROW if spec.instr == "mma" else tma_ring_bytes(spec.tile.stages, rows)


def _validate(spec: KernelSpec) -> None:
    check_trans(spec, "nt")
    check_choice("dtype", spec.dtype, DTYPES)
    check_choice("instr", spec.instr, INSTRS)
    check_choice("cluster", spec.tile.cluster, (1,))
    check_acc_on_mma(spec)
    rowblocks = spec.param_values["rowblocks"]
    expect(1 <= rowblocks <= MAX_ROWBLOCKS, f"rowblocks in [1, {MAX_ROWBLOCKS}]", rowblocks, SpecError)
    t, bm = spec.tile, spec.block[0]
    if spec.instr == "mma":  # warps split tile_m rows of X and the block's rows of W
        expect(t.tile_m % (16 * t.warps_m) == 0 and bm % (16 * t.warps_n) == 0,
               "tile_m a multiple of 16 x warps_m and block rows of 16 x warps_n", f"{t.tag}, block {spec.block}",
               SpecError)
        return
    consumers = t.warps_m // 4
    per_consumer = t.tile_m if spec.instr == "pingpong" else t.tile_m // max(consumers, 1)
    expect(spec.arch == 90 and spec.dtype != "fp32", f"sm_90 and a 16-bit dtype for {spec.instr}",
           f"sm_{spec.arch}, {spec.dtype}", SpecError)
    expect(t.warps_n == 1 and t.warps_m % 4 == 0 and per_consumer % 64 == 0 and t.stages >= 2,
           "warps_n 1, whole consumer warpgroups owning whole m64 tiles, at least 2 stages", t.tag, SpecError)


def forward_spec(block, dtype: str, arch: int, rowblocks: int, rows: int | None = None, epilogue: str = "none",
                 tile: TileConfig | None = None, instr: str | None = None, acc: str = "f32") -> KernelSpec:
    """The forward kernel; `rows` (M) up to 64 takes a 64-row tile, another accumulator
    than f32 the mma.sync kernel (unless told)."""
    block, small = tuple(block), rows is not None and rows <= 64
    instr = instr or ("mma" if arch != 90 or dtype == "fp32" or acc != "f32" else
                      "tma" if block[0] >= 128 and not small else "pingpong")
    return KernelSpec(op="bell_dds", block=block, dtype=dtype, trans="nt", arch=arch, instr=instr,
                      tile=tile or default_tile(block, arch, instr, small), epilogue=epilogue,
                      params={"rowblocks": rowblocks}, acc=acc)


def default_tile(block, arch: int, instr: str, small: bool) -> TileConfig:
    """bsr_dds's measured tiles for the same kernels (bsr/specs.py), which this layout shares."""
    bm = block[0]
    if instr != "mma":
        if small:
            return TileConfig(64, 4, 1, 4)
        tile_m = 128 if bm >= 128 and instr == "pingpong" else 256
        return TileConfig(tile_m, 8, 1, stages_that_fit(tile_m + bm, arch, most=4 if instr == "tma" else 6))
    stages = 3 if bm >= 128 or SMEM_LIMIT[arch] <= 128 * 1024 else 4
    warps = (2, 2) if bm >= 64 else (4, 1)
    return TileConfig(64 if small else 128, *((4, 1) if small else warps), stages)


def default_specs(arch: int, dtypes: tuple, blocks=None) -> list[KernelSpec]:
    """A few common shapes: a layer with another rowblocks compiles its kernel on first use."""
    return [forward_spec(b, d, arch, r, rows) for d in dtypes if d in ("bf16", "fp16")
            for b in (blocks or PRECOMPILED_BLOCKS) for r in PRECOMPILED_ROWBLOCKS for rows in (None, 1)]


registry.register(registry.Layout("bell", (
    registry.OpRules("bell_dds", "bell/bell_dds.cu.j2", _validate, _smem, epilogues=True, params=(ROWBLOCKS,),
                     accs=("f32", "f16")),
), default_specs, Path(__file__).parent, lowerings_module="compiled"))
