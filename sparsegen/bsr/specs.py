"""Block-sparse kernels: their specs' rules, tile defaults and the set precompile builds.

bsr_dds: Y = X W^T (W block-sparse; the forward, and dX on W^T). bsr_sdd: dW = dY^T X
sampled at W's stored blocks (the weight gradient). stk's naming: output, lhs, rhs.
bsr_scatter: the dense W of a block-sparse one (the forward's dense path, ops._dense_forward_weight).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..jit import epilogues, registry
from ..errors import SpecError, expect
from ..jit.spec import (BLOCK_SIDES, BYTE_DTYPES, DTYPES, ELEMENT_BYTES, HOPPER_INSTRS, SMEM_LIMIT, STAGE_BYTES_PER_ROW,
                        SWAP_INSTRS, THREADS_256, TMA_INSTRS, KernelSpec, TileConfig, check_acc_on_mma, check_trans,
                        clustered, stages_that_fit, tma_ring_bytes)

BLOCK_DTYPES = tuple(d for d in DTYPES if d not in BYTE_DTYPES)  # the block-sparse kernels' dtypes


def sdd_gather(spec: KernelSpec) -> int:
    """bsr_sdd on tma: X's columns one work item gathers - 128 per consumer warpgroup at
    block rows of 64, 256 (the two consumers' rows) at 128."""
    consumers = spec.tile.warps_m // 4
    return 128 * consumers if spec.block[0] == 64 else 256


def _dds_smem(spec: KernelSpec) -> int:
    rows = spec.tile.tile_m + (128 if spec.instr == "pairs" else spec.block[0])  # pairs: two blocks a stage
    staging = 2 * 64 * STAGE_BYTES_PER_ROW if spec.instr in SWAP_INSTRS else 0  # the transposing store's chunks
    if spec.instr in TMA_INSTRS:
        return tma_ring_bytes(spec.tile.stages, rows) + staging
    align = 1024 if spec.instr in HOPPER_INSTRS else 0  # swizzle atoms are 1024-aligned
    return spec.tile.stages * rows * STAGE_BYTES_PER_ROW + align


def _sdd_smem(spec: KernelSpec) -> int:
    if spec.instr == "tma":  # per stage: tile_m tokens of dY's bm and the X columns
        per_token = (spec.block[0] + sdd_gather(spec)) * ELEMENT_BYTES[spec.dtype]
        return spec.tile.stages * spec.tile.tile_m * per_token + 1024 + 16 * spec.tile.stages
    # stages of tile_m rows of dY (bm columns) and X (bk columns)
    return spec.tile.stages * spec.tile.tile_m * sum(spec.block) * ELEMENT_BYTES[spec.dtype]


def _no_smem(spec: KernelSpec) -> int:
    return 0


def _validate_block_dtype(spec: KernelSpec) -> None:
    expect(spec.dtype in BLOCK_DTYPES, f"a 2:4 op for {spec.dtype} (one-byte types have the 2:4 forward and "
           f"pruning kernels only; block-sparse ops take {BLOCK_DTYPES})", repr(spec.op), SpecError)


def _validate_dds(spec: KernelSpec) -> None:
    expect(spec.trans == "nt" or (spec.trans == "nn" and spec.instr in SWAP_INSTRS),
           "trans 'nt' for bsr_dds ('nn' only for bsr_dds on swap or pairs)", repr(spec.trans), SpecError)
    _validate_block_dtype(spec)
    check_acc_on_mma(spec)
    _validate_cluster(spec, shares=has_call_variants(spec))
    t, bm = spec.tile, spec.block[0]
    if spec.instr not in SWAP_INSTRS:  # warps split tile_m rows of X and the block's rows of W
        expect(t.tile_m % (16 * t.warps_m) == 0, f"tile_m a multiple of 16 x warps_m = {16 * t.warps_m}",
               t.tile_m, SpecError)
        expect(bm % (16 * t.warps_n) == 0, f"block rows ({bm}) a multiple of 16 x warps_n = {16 * t.warps_n}; "
               "use fewer warps_n", t.warps_n, SpecError)
    if spec.instr in HOPPER_INSTRS:
        _validate_wgmma(spec)


def _validate_cluster(spec: KernelSpec, shares: bool = False) -> None:
    expect(spec.tile.cluster in (1, 2), "a cluster of 1 or 2 (4: sp24_dds)", spec.tile.cluster, SpecError)
    expect(spec.tile.cluster == 1 or shares, "cluster 1 (clusters share tiles only in sp24_dds on TMA, and in "
           "swap and pairs at 64-row blocks)", spec.tile.cluster, SpecError)


def _validate_wgmma(spec: KernelSpec) -> None:
    t = spec.tile
    expect(spec.arch == 90, f"arch 90 for instr={spec.instr!r} (Hopper only); use instr='mma' "
           "elsewhere", spec.arch, SpecError)
    expect(spec.dtype in ("bf16", "fp16"), "dtype bf16 or fp16 for wgmma", spec.dtype, SpecError)
    expect(spec.block[0] <= 256, "block rows at most 256 (wgmma's largest N)", spec.block[0], SpecError)
    expect(t.warps_n == 1 and t.warps_m % 4 == 0,
           "warps_n = 1 and warps_m a multiple of 4 (whole warpgroups) for wgmma",
           f"warps {t.warps_m}x{t.warps_n}", SpecError)
    if spec.instr not in SWAP_INSTRS:  # (swap: tokens are wgmma's N, checked below)
        expect(t.tile_m % (16 * t.warps_m) == 0, "each warpgroup to own whole m64 tiles",
               f"tile_m {t.tile_m} for {t.warps_m // 4} warpgroups", SpecError)
    least = 2 if spec.instr in TMA_INSTRS else 3
    expect(t.stages >= least, f"at least {least} stages for {spec.instr}", t.stages, SpecError)
    if spec.instr in SWAP_INSTRS:  # W as wgmma's A: 64-row halves of the block, X's tokens as N
        rows = (64, 128) if spec.instr == "swap" else (64,)
        expect(spec.block[0] in rows and spec.block[1] % 64 == 0 and t.warps_m == 8,
               f"blocks of {' or '.join(map(str, rows))} rows and a multiple of 64 columns, two consumer "
               f"warpgroups (warps_m 8) for {spec.instr}", f"block {spec.block}, {t.tag}", SpecError)
        per_consumer = t.tile_m if spec.instr == "pairs" else t.tile_m * spec.block[0] // 128
        expect(per_consumer <= 256 and per_consumer % 64 == 0, "64, 128, 192 or 256 tokens per consumer (wgmma's "
               "largest N is 256; the store stages 64 at a time)", t.tag, SpecError)


def _validate_sdd(spec: KernelSpec) -> None:
    check_trans(spec, "tn")
    _validate_block_dtype(spec)
    _validate_cluster(spec)
    t, (bm, bk) = spec.tile, spec.block
    expect(spec.instr in ("mma", "tma") and spec.dtype in ("bf16", "fp16"),
           "instr 'mma' or 'tma' and a 16-bit dtype for bsr_sdd", f"{spec.instr}, {spec.dtype}", SpecError)
    if spec.instr == "tma":  # a producer and 2 (or, at 64 rows, 4) consumer warpgroups, tile_m tokens a stage
        expect(spec.arch == 90 and bm in (64, 128) and bk in (64, 128), "sm_90 and blocks of 64 or 128 for "
               "the tma bsr_sdd", f"sm_{spec.arch}, block {spec.block}", SpecError)
        expect(t.tile_m in (32, 48, 64) and t.warps_n == 1 and t.warps_m in ((8, 16) if bm == 64 else (8,)),
               "tile_m 32, 48 or 64, warps_n 1 and warps_m 8 (16 too for 64-row blocks) for the tma bsr_sdd",
               t.tag, SpecError)
        return
    expect(bk % (16 * t.warps_n) == 0, f"block cols ({bk}) a multiple of 16 x warps_n", t.warps_n, SpecError)
    expect(bm % (16 * t.warps_m) == 0, f"block rows ({bm}) a multiple of 16 x warps_m", t.warps_m, SpecError)


def _validate_scatter(spec: KernelSpec) -> None:
    check_trans(spec, "nt")
    _validate_block_dtype(spec)
    _validate_cluster(spec)
    expect(spec.instr == "mma" and spec.dtype in BLOCK_DTYPES, f"instr 'mma' and a dtype in {BLOCK_DTYPES} "
           "for bsr_scatter (it copies, no tensor cores)", f"{spec.instr}, {spec.dtype}", SpecError)


def default_instr(dtype: str, arch: int, block=(64, 64), rows: int | None = None) -> str:
    """Per block shape, the fastest family on an H200: W as wgmma's A ("swap") for blocks
    of 64 or 128 rows and whole 64-column widths beyond 64 tokens (0.97-1.76x the X-as-A
    kernels below over four shapes and densities 0.1-0.5, below 1.0 in 2 of 24 cells; an
    ad-hoc sweep like tools/bench.py --tune); otherwise, from --tune, cp.async copies beat TMA's narrow boxes
    for 16-wide blocks, ping-pong consumers win up to 64 rows, cooperative ones at 128."""
    if arch != 90 or dtype not in ("bf16", "fp16"):
        return "mma"
    if block[1] < 32:
        return "wgmma"
    if block[0] in (64, 128) and block[1] % 64 == 0 and (rows is None or rows > 64):
        return "swap"
    return "tma" if block[0] >= 128 else "pingpong"


def default_tile(block: tuple[int, int], arch: int = 90, instr: str = "mma",
                 rows: int | None = None) -> TileConfig:
    """Tile per block-row height, from tools/bench.py --tune on an H200 (BENCHMARKS.md).

    Taller tiles reuse each weight block over more rows of X; `rows` (M) below 128 takes
    a 64-row tile so small batches do not compute on zero padding.
    """
    bm, small = block[0], rows is not None and rows <= 64
    if instr in HOPPER_INSTRS:
        if small:
            return TileConfig(tile_m=64, warps_m=4, warps_n=1, stages=4)
        if instr == "pingpong":  # one warpgroup holds a whole tile: at most 128 accumulators each
            tile_m = 128 if bm >= 128 else 256
            return TileConfig(tile_m=tile_m, warps_m=8, warps_n=1,
                              stages=stages_that_fit(tile_m + bm, arch, most=6))
        if instr in ("tma", "swap", "pairs"):  # swap at block 64: 4 stages beat 5 in 7 of 12 cells, tied 3, lost 2
            return TileConfig(tile_m=256, warps_m=8, warps_n=1, stages=4)
        return TileConfig(tile_m=256 if bm >= 64 else 128, warps_m=8, warps_n=1, stages=4)
    stages = 4 if SMEM_LIMIT.get(arch, 0) > 128 * 1024 else 3
    if small:
        return TileConfig(tile_m=64, warps_m=4, warps_n=1, stages=stages)
    if bm >= 128:
        return TileConfig(tile_m=128, warps_m=2, warps_n=2, stages=3)
    if bm == 64:
        return TileConfig(tile_m=128, warps_m=2, warps_n=2, stages=stages)
    return TileConfig(tile_m=128, warps_m=4, warps_n=1, stages=stages)


def forward_spec(block, dtype: str, arch: int, tile: TileConfig | None = None, instr: str | None = None,
                 rows: int | None = None, epilogue: str = "none", acc: str = "f32") -> KernelSpec:
    """The forward kernel; another accumulator than f32 takes the mma.sync kernel unless told."""
    block = tuple(block)
    instr = instr or ("mma" if acc != "f32" else default_instr(dtype, arch, block, rows))
    return KernelSpec(op="bsr_dds", block=block, dtype=dtype, trans="nt", arch=arch,
                      tile=tile or default_tile(block, arch, instr, rows), instr=instr, epilogue=epilogue, acc=acc)


def input_grad_spec(block, dtype: str, arch: int, rows: int | None = None, tile: TileConfig | None = None,
                    instr: str | None = None) -> KernelSpec | None:
    """dX = dY W read from W's stored blocks (trans "nn", block = W^T's block), where the
    swap kernel runs that way (or the given instr, swap or pairs); None elsewhere (the
    caller transposes the values instead)."""
    block = tuple(block)
    expect(instr in (None, *SWAP_INSTRS), "instr 'swap' or 'pairs' to read the stored blocks as W^T's",
           repr(instr), SpecError)
    instr = instr or _input_grad_instr(default_instr(dtype, arch, block, rows), block)
    if instr not in SWAP_INSTRS:
        return None
    return KernelSpec(op="bsr_dds", block=block, dtype=dtype, trans="nn", arch=arch,
                      tile=tile or default_tile(block, arch, instr, rows), instr=instr)


def _input_grad_instr(instr: str, block) -> str:
    """dX on the swap kernel runs over pairs of W^T's block rows where they have 64 rows: on
    an H100 at (8192, 4096, 11008), 42 -> 47%, 54 -> 58% and 54 -> 66% of cuBLAS per useful
    FLOP at densities 0.1, 0.25 and 0.5 (tmp_probe sweep, BENCHMARKS.md)."""
    return "pairs" if instr == "swap" and block[0] == 64 else instr


def sdd_spec(block, dtype: str, arch: int, tile: TileConfig | None = None, instr: str | None = None,
             many_blocks: bool = False) -> KernelSpec:
    """The weight-gradient kernel. On sm_90 with blocks of 64 or 128: wgmma fed by TMA, a
    block per 256 gathered columns of one block row, 4 stages of 64 tokens (5, which fit at
    block 64, came within 2.5% of 4 either way in `tools/bench.py --train` runs on an H200).
    At 64-row blocks with `many_blocks` (dispatch.SDD_WIDE_BLOCKS_PER_SM): four consumers gathering
    512 columns, 4 stages of 48 tokens - 6-17% faster on an H100 at (8192, 4096, 11008) and
    (8192, 4096, 4096), densities 0.25-0.5 (a dY box serves twice the columns; 4 stages of
    48 tokens beat 3 of 64 by 6-8%, 6 of 32 lost 6-13%).
    Elsewhere mma.sync, one threadblock per stored block, 32 or 64 rows of M a stage."""
    bm, bk = block
    if instr is None:
        instr = "tma" if tile is None and arch == 90 and bm in (64, 128) and bk in (64, 128) else "mma"
    if instr == "tma":
        wide = many_blocks and bm == 64
        return KernelSpec(op="bsr_sdd", block=tuple(block), dtype=dtype, trans="tn", arch=arch,
                          tile=tile or (TileConfig(48, 16, 1, 4) if wide else TileConfig(64, 8, 1, 4)), instr="tma")
    rows, stages = (64, 3) if bm >= 128 and bk >= 128 else (32, 4)  # tools/bench.py --train sweep
    tile = tile or TileConfig(tile_m=rows, warps_m=2 if bm >= 32 else 1, warps_n=2 if bk >= 32 else 1,
                              stages=stages)
    return KernelSpec(op="bsr_sdd", block=tuple(block), dtype=dtype, trans="tn", arch=arch,
                      tile=tile, instr="mma")


def scatter_spec(block, dtype: str, arch: int) -> KernelSpec:
    """The dense weight of a block-sparse one: 256 threads a block, 16 bytes each."""
    return KernelSpec(op="bsr_scatter", block=tuple(block), dtype=dtype, trans="nt", arch=arch, tile=THREADS_256,
                      instr="mma")


def has_call_variants(spec: KernelSpec) -> bool:
    """The swap family at 64-row blocks: the kernels whose pairs and cluster variants
    dispatch.swap_variant picks per call (and precompile builds)."""
    return spec.instr in SWAP_INSTRS and spec.block[0] == 64


def call_variants(spec: KernelSpec) -> list[KernelSpec]:
    """The kernels dispatch.swap_variant may pick for a call of `spec` (itself among them): for
    the swap family at 64-row blocks, swap or pairs of block rows (pairs stays pairs), each
    alone or in clusters of two; any other kernel is its only variant."""
    if not has_call_variants(spec):
        return [spec]
    instrs = ("pairs",) if spec.instr == "pairs" else ("swap", "pairs")
    return [dataclasses.replace(spec, instr=instr, tile=dataclasses.replace(spec.tile, cluster=cluster))
            for instr in instrs for cluster in (1, 2)]


def default_specs(arch: int, dtypes: tuple, blocks=None) -> list[KernelSpec]:
    """Every square block plus common rectangles (or `blocks`): forward (with the epilogues
    sparsegen.patch fuses), backward and the dense path's scatter."""
    wide = [d for d in dtypes if d in BLOCK_DTYPES]
    blocks = blocks or [(b, b) for b in BLOCK_SIDES] + [(32, 64), (64, 32)]
    forward = [forward_spec(b, d, arch, rows=rows) for d in wide for b in blocks for rows in (None, 1)]
    # the swap family's variants picked per call (dispatch.swap_variant): pairs of block rows,
    # clusters of two blocks sharing W's copies
    forward += [dataclasses.replace(s, instr="pairs") for s in forward if has_call_variants(s) and s.instr == "swap"]
    forward += [clustered(s) for s in forward if has_call_variants(s)]
    # The backward: dX is the forward op on W^T (blocks transposed), dW the sdd op.
    backward = [forward_spec(b[::-1], d, arch) for d in wide for b in blocks if b[0] != b[1]]
    backward += [sdd_spec(b, d, arch, many_blocks=many) for d in wide if d != "fp32" for b in blocks
                 for many in (False, True)]
    backward += [s for d in wide for b in blocks if (s := input_grad_spec(b[::-1], d, arch))]
    backward += [clustered(s) for s in backward if has_call_variants(s)]
    # the forward's dense path (ops._dense_forward_weight: crossover table, high density), any block
    scatter = [scatter_spec(b, d, arch) for d in wide for b in blocks]
    fused = [dataclasses.replace(s, epilogue=e) for s in forward if s.dtype in ("bf16", "fp16")
             for e in epilogues.FUSED]
    return forward + scatter + backward + fused


registry.register(registry.Layout("bsr", (
    registry.OpRules("bsr_dds", "bsr/bsr_dds.cu.j2", _validate_dds, _dds_smem, trans=("nt", "nn"), epilogues=True,
                     accs=("f32", "f16"), args=registry.ProductArgs(
                         ("x", "values", "bias", "row_offsets", "col_indices", "flat_index"), ("block_rows", "block_cols"))),
    registry.OpRules("bsr_sdd", "bsr/bsr_sdd.cu.j2", _validate_sdd, _sdd_smem, trans=("tn",)),
    registry.OpRules("bsr_scatter", "bsr/bsr_scatter.cu.j2", _validate_scatter, _no_smem, tensor_cores=False),
), default_specs, Path(__file__).parent, lowerings_module="compiled", faces_module="face", kit_module="ops"))
