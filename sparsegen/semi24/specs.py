"""2:4 semi-structured kernels: their specs' rules, tile defaults, template context and the
set precompile builds.

sp24_dds: Y = X W^T with W 2:4 semi-structured (mma.sp); its "block" is the instruction's
16 x 32 tile of W, the granule its shapes come in. sp24_compress: prune a dense W to 2:4
and pack values and metadata (one thread per metadata word; tile gives the block size).
sp24_mask: the transposable 2:4 mask of a dense W (one thread per 4 x 4 tile).
sp24_expand: a 2:4 W to dense, or a dense gradient's elements at W's stored positions
(16-bit; one thread per metadata word) - Sparse24Linear's backward. sp24_transpose: W^T's 2:4
form from W's where the stored positions are 2:4 along columns too (16-bit; blocks of 256
threads over 64 x 128 pieces of W) - that backward's dX on the 2:4 kernel.
sp24_quantize: ScaledSparse24Linear's activations, each row quantized to the one-byte dtype by
its own scale (or a static one) in one pass; `src` is the activations' 16-bit type.
sp24_w4: Y = X W^T with W 2:4 and its kept values 4-bit integers with a 16-bit scale per row and
group of columns (Int4Sparse24Linear, W4A16): sp24_dds's mma.sp kernel reading W through
templates/semi24/sg_int4.cuh, which dequantizes in registers; dtype is the activations'.
sp24_w4_values: such a weight's kept values dequantized into 16-bit [N, K/2] values (one thread
per word), for the 16-bit 2:4 kernels where they multiply faster (prefill on Hopper).
gated_product: a training step's gated MLP epilogue, act(gate) * up over the interleaved gate/up
product, and its gradient (16-bit; one thread per group of 8 outputs). Not 2:4's own: every
layout's gated layers train through it (jit/epilogues.py asks for it as a kit kernel).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..jit import epilogues, registry
from ..jit.codegen import ELEM_TYPES, MMA_TYPES
from ..errors import SpecError, expect
from ..jit.spec import (BYTE_DTYPES, ELEMENT_BYTES, MIN_ARCH, SMEM_LIMIT, THREADS_256, KernelSpec, TileConfig,
                        check_trans)
from .format import ROW_PAIRS, TRANSPOSABLE_PATTERNS

SP24_BLOCK = (16, 32)
# sp24_dds over one-byte inputs with scales applied in its epilogue (ScaledSparse24Linear):
# Y = x_scale[t] * w_scale[f] * (Xq Wq^T)[t, f] (+ bias[f]), written in the activations' type.
SCALED_OUTPUTS = {1: "bf16", 2: "fp16"}
SCALED_DTYPES = {1: torch.bfloat16, 2: torch.float16}
SCALED_CODES = {dtype: code for code, dtype in SCALED_DTYPES.items()}  # Y's (or the activations') dtype -> code
SCALES = registry.Param("scales", 0, choices=(0, *SCALED_OUTPUTS), named_at_default=False,
                        doc="one-byte products only: 0 none (Y int32 for int8, bf16 for e4m3); 1 and 2 a float32 "
                            "scale per token and per feature applied before bias and epilogue, Y in bf16 (1) or fp16 (2)")
QUANTIZED_X = registry.Param("quantize", 0, choices=(0, 1), named_at_default=False,
                             doc="scaled products on wgmma.sp (tma) only: 1 takes X in the output's 16-bit type and "
                                 "quantizes it per token in the kernel (sp24_quantize's bytes), for at most tile_m "
                                 "<= 64 tokens (one token tile): a decode step's layer in one launch")
MAX_GROUPS = 3  # a grouped product's weights: an attention's q, k and v projections
GROUPS = registry.Param("groups", 1, choices=tuple(range(1, MAX_GROUPS + 1)), named_at_default=False,
                        doc="sp24_dds on wgmma.sp (tma), and sp24_w4: how many weights of one X a launch multiplies, "
                            "Y's columns weight after weight (every weight but the last a whole number of tiles: "
                            "the caller checks); a compiled graph's q, k and v projections in one launch")
SOURCE = registry.Param("src", 1, choices=tuple(SCALED_OUTPUTS),
                        doc="sp24_quantize's input: bf16 (1) or fp16 (2) activations")
GEGLU = registry.Param("geglu", 0, choices=(0, 1), doc="gated_product's activation of the gate: silu (0) or gelu (1)")


def w_rows(spec: KernelSpec) -> int:
    """sp24_dds: weight rows per block - 64 per consumer warpgroup (tma), per warp (mma)."""
    return (16 if spec.instr == "tma" else 64) * spec.tile.warps_m


def _dds_smem(spec: KernelSpec) -> int:
    t = spec.tile
    if spec.instr == "tma":  # 128 bytes per X row, 64 + 8 (e4m3: 16) per W row
        staging = w_rows(spec) * 2 * (64 if t.tile_m >= 128 else 32)  # the store's token chunks
        ring = t.stages * (t.tile_m * 128 + w_rows(spec) * (64 + 16 // ELEMENT_BYTES[spec.dtype]))
        if quantizes_x(spec):  # X's 16-bit boxes (twice a stage's X bytes) and their barriers
            ring += t.stages * (t.tile_m * 256 + 8)
        return ring + staging + 1024 + 16 * t.stages
    # per stage: 256 bytes per X row; 128 of values + 16 (8-bit: 32) of metadata per W row
    return t.stages * (t.tile_m * 256 + w_rows(spec) * (128 + 32 // ELEMENT_BYTES[spec.dtype]))


def _no_smem(spec: KernelSpec) -> int:
    return 0


def _byte_instrs(spec: KernelSpec) -> tuple[str, ...]:
    """Pruning runs mma-family kernels; the forward mma.sp, and on sm_90 wgmma.sp too - only
    wgmma.sp for e4m3: sm_90 has no fp8 mma.sync (ptxas emulates it through the stack,
    320-360x slower than cuBLAS fp8 on an H100: tools/bench24.py --bytes)."""
    if spec.op != "sp24_dds" or spec.arch != 90:
        return ("mma",)
    return ("tma",) if spec.dtype == "e4m3" else ("mma", "tma")


def _validate_byte_dtype(spec: KernelSpec) -> None:
    instrs = _byte_instrs(spec)
    expect(spec.instr in instrs, f"a 2:4 op on instr {' or '.join(map(repr, instrs))} "
           f"for {spec.dtype} on sm_{spec.arch} (one-byte types have the 2:4 forward and pruning kernels only)",
           f"{spec.op!r} on {spec.instr!r}", SpecError)
    if spec.op != "sp24_dds":  # pruning needs no tensor cores
        return
    least = MIN_ARCH.get(spec.dtype, 80)
    expect(spec.arch >= least, f"sm_{least} or later for {spec.dtype} tensor cores", f"sm_{spec.arch}", SpecError)


def _scales(spec: KernelSpec) -> int:
    return spec.param_values.get("scales", 0)


def quantizes_x(spec: KernelSpec) -> bool:
    return spec.param_values.get("quantize", 0) == 1


def groups(spec: KernelSpec) -> int:
    return spec.param_values.get("groups", 1)


def _validate(spec: KernelSpec) -> None:
    """What every 2:4 op needs: trans nt, the mma.sp block, 16-bit or one-byte values."""
    check_trans(spec, "nt")
    expect(not _scales(spec) or spec.dtype in BYTE_DTYPES, "a one-byte dtype (int8, e4m3) for scales",
           spec.dtype, SpecError)
    if spec.dtype in BYTE_DTYPES:
        _validate_byte_dtype(spec)
    t = spec.tile
    hopper = spec.op == "sp24_dds" and spec.arch == 90
    expect(spec.instr == "mma" or (hopper and spec.instr == "tma"),
           "instr 'mma' (mma.sp), or 'tma' (wgmma.sp) for sp24_dds on sm_90", repr(spec.instr), SpecError)
    expect(spec.dtype != "fp32", "a 16-bit or one-byte dtype for 2:4 kernels", spec.dtype, SpecError)
    expect(spec.block == SP24_BLOCK, f"block {SP24_BLOCK} (the mma.sp tile) for {spec.op}", spec.block, SpecError)
    tma = spec.op == "sp24_dds" and spec.instr == "tma"
    expect(t.cluster in (1, 2) or (t.cluster == 4 and spec.op == "sp24_dds"), "a cluster of 1 or 2 (4: sp24_dds)",
           t.cluster, SpecError)
    expect(t.cluster == 1 or tma, "cluster 1 (clusters share tiles only in sp24_dds on TMA, and in swap and "
           "pairs at 64-row blocks)", t.cluster, SpecError)
    expect(not quantizes_x(spec) or (_scales(spec) and tma and t.cluster == 1 and t.tile_m <= 64),
           "scales, instr 'tma', cluster 1 and tile_m <= 64 for quantize", f"{spec.instr!r}, {t.tag}, scales "
           f"{_scales(spec)}", SpecError)
    expect(groups(spec) == 1 or ((tma or spec.op == "sp24_w4") and not quantizes_x(spec)),
           "instr 'tma' (sp24_w4: any) and no quantize for groups > 1",
           f"{spec.instr!r}, quantize {spec.param_values.get('quantize', 0)}", SpecError)
    expect(groups(spec) == 1 or spec.op != "sp24_w4" or spec.epilogue == "none",
           "no epilogue for a grouped sp24_w4 (its weights' rows are Y's columns one after another)",
           spec.epilogue, SpecError)
    if spec.instr == "tma":  # consumer warpgroups of 64 W rows; tile_m tokens are wgmma's N
        expect(t.warps_n == 1 and t.warps_m % 4 == 0 and t.tile_m <= 256 and t.tile_m % 8 == 0,
               "warps_n = 1, whole warpgroups (warps_m % 4 == 0) and tile_m <= 256 for tma",
               t.tag, SpecError)
        expect(t.tile_m % (8 * t.cluster) == 0, "tile_m a multiple of 8 x cluster (each block's share of X)",
               t.tag, SpecError)
        return
    expect(t.tile_m % (8 * t.warps_n) == 0, f"tile_m a multiple of 8 x warps_n = {8 * t.warps_n}",
           t.tile_m, SpecError)


def _validate_16bit(spec: KernelSpec) -> None:
    """sp24_expand, sp24_transpose and gated_product: the training kernels, 16-bit only."""
    expect(spec.dtype in ("bf16", "fp16"), f"a 16-bit dtype for {spec.op} (the trained layers')",
           spec.dtype, SpecError)
    _validate(spec)


def _w4_smem(spec: KernelSpec) -> int:
    """Per stage: 256 bytes per X row; per W row 32 bytes of 4-bit values, 16 of metadata and a scale."""
    return spec.tile.stages * (spec.tile.tile_m * 256 + w_rows(spec) * (32 + 16 + 2))


def _validate_w4(spec: KernelSpec) -> None:
    expect(spec.dtype in ("bf16", "fp16"), "a 16-bit dtype (the activations') for sp24_w4", spec.dtype, SpecError)
    expect(spec.instr == "mma", "instr 'mma' (mma.sp) for sp24_w4", repr(spec.instr), SpecError)
    _validate(spec)
    t = spec.tile
    sums = (_kwarps(spec) - 1) * 4 * (t.tile_m // t.warps_n // 8) * 4 * t.threads * 4  # the other k-warps' f32 sums
    expect(sums <= _w4_smem(spec), f"k-warps whose sums fit the pipeline's {_w4_smem(spec)} bytes (fewer kwarps, "
           "more stages or fewer tokens a warp)", f"{sums} bytes for {spec.name}", SpecError)


def _kwarps(spec: KernelSpec) -> int:
    return spec.param_values["kwarps"]


# sp24_w4's warps per W rows and tokens, each taking a share of a stage's instruction steps (not
# 4: four times a 4-warp tile is 512 threads, whose 128 registers each spill - SASS, sm_80 / sm_90)
KWARPS = registry.Param("kwarps", 1, choices=(1, 2), named_at_default=False,
                        doc="warps sharing a tile's W rows and tokens, each a share of K (sums met in shared memory)")


# The token counts sp24_w4_spec tells apart: decode (up to 8, up to 16, up to 32), small batches
# (33-128), prefill (more: on Hopper the 16-bit kernel's, int4_nn.prefill_on_16_bit)
W4_ROWS = (8, 16, 32, 128, None)
W4_NARROW_ROWS = (8, 16, 128)  # (the buckets whose tile a narrow weight changes: _w4_tile)


def w4_rows_bucket(m: int) -> int | None:
    return next((rows for rows in W4_ROWS if rows is not None and m <= rows), None)


def sp24_w4_spec(dtype: str, arch: int, tile: TileConfig | None = None, rows: int | None = None,
                 epilogue: str = "none", kwarps: int | None = None, narrow: bool = False, groups: int = 1) -> KernelSpec:
    """The 4-bit 2:4 forward (mma.sp on every arch). A stage's W is a quarter of the 16-bit
    kernel's bytes, so decode tiles take few tokens, and a narrow weight (w4_narrow: its 256-row
    tiles would fill under a quarter of the SMs) takes tiles of 128 rows whose two warps of
    rows each have a k-warp: more blocks and warps in flight. From a sweep of tiles, k-warps and
    K splits on an H200 (tools/probe_int4.py, weights from HBM): at one token a 28672x8192 weight
    ran 2.5x cuBLAS bf16 on 16 x 256 tiles, 4096x4096 1.6x on 16 x 128 with k-warps (1.5x
    without); at 16 tokens 4096x4096 1.3x on those against 0.8x on 16 x 256; 17-32 tokens take
    32 x 128 tiles with k-warps (28672x8192 1.7x, 4096x14336 1.4x against 0.9x on 32 x 256);
    33-128 tokens 64 x 128 with k-warps where narrow (4096x14336 at 64 tokens 1.0x against
    0.6x), else 64 x 256 (28672x8192 0.9x). 1-8 tokens take 8-token tiles with k-warps, 8 x 128 where
    narrow (33bbbc9's sweep: at one token 14336x4096 2.38x and 4096x14336 2.49x against 2.16x and 2.10x
    on 16-token tiles; at 8 tokens 2.30x and 2.37x against 2.01x and 2.02x, 28672x8192 2.78x against 2.44x)."""
    big_smem = SMEM_LIMIT[arch] > 160 * 1024
    if tile is None:
        tile, chosen_kwarps = _w4_tile(rows, narrow, big_smem, arch)
        kwarps = kwarps or chosen_kwarps
    return KernelSpec(op="sp24_w4", block=SP24_BLOCK, dtype=dtype, trans="nt", arch=arch, tile=tile,
                      instr="mma", epilogue=epilogue, params={"kwarps": kwarps or 1, "groups": groups})


def _w4_tile(rows: int | None, narrow: bool, big_smem: bool, arch: int) -> tuple[TileConfig, int]:
    """(tile, k-warps) of sp24_w4_spec's rules for this token bucket."""
    if rows is not None and rows <= 8:  # (one n8 mma.sp step a W tile, half the X bytes of a 16-token stage)
        stages = (8 if big_smem else 6) if narrow else (6 if big_smem else 5)
        return (TileConfig(8, 2, 1, stages), 2) if narrow else (TileConfig(8, 4, 1, stages), 2)
    if rows is not None and rows <= 16:
        stages = 6 if big_smem else 5
        return (TileConfig(16, 2, 1, stages), 2) if narrow else (TileConfig(16, 4, 1, stages), 1)
    if rows is not None and rows <= 32:
        return TileConfig(32, 2, 1, 6 if big_smem else 4), 2
    if rows is not None:
        stages = 4 if big_smem else 2
        return (TileConfig(64, 2, 2, stages), 2) if narrow else (TileConfig(64, 4, 2, stages), 1)
    if not big_smem:
        return TileConfig(64, 2, 2, 3), 1
    return (TileConfig(128, 4, 2, 3), 1) if arch >= 90 else (TileConfig(128, 2, 4, 3), 1)


def w4_narrow(out_features: int, sm_count: int) -> bool:
    """Whether a 4-bit weight of `out_features` rows takes sp24_w4's narrow decode tiles: its
    256-row tiles would fill under a quarter of the SMs (a Llama-8B 4096-row projection on an
    H100 or H200: 16 tiles on 132 SMs)."""
    return 4 * -(-out_features // 256) < sm_count


def gated_product_spec(dtype: str, arch: int, geglu: bool) -> KernelSpec:
    """256 threads a block, one group of 8 outputs each."""
    return KernelSpec(op="gated_product", block=SP24_BLOCK, dtype=dtype, trans="nt", arch=arch, tile=THREADS_256,
                      instr="mma", params={"geglu": int(geglu)})


def _output_context(spec: KernelSpec) -> dict:
    """The 2:4 forward's accumulator and Y: int8 sums stay int32 (exact, s32 accumulators);
    everything else accumulates in f32 and is written in its own type, e4m3 as bf16."""
    dtype, scales = spec.dtype, _scales(spec)
    one_byte, integer = dtype in BYTE_DTYPES, dtype == "int8"  # one-byte values: raw bytes to the pruning kernels
    out = SCALED_OUTPUTS.get(scales, "bf16" if one_byte else dtype)  # Y's type, int8's int32 aside
    out_mma, int_out = MMA_TYPES[out], integer and not scales
    # wgmma.sp's trailing immediates: scale-a/b and transposes (16-bit), scales (fp8), none (int8)
    immediates = ", 1, 1, 0, 0" if not one_byte else "" if integer else ", 1, 1"
    quantizer = f"sg::QuantizeX<sg::{out_mma}, {'true' if integer else 'false'}>" if quantizes_x(spec) else ""
    return dict(out_policy="Int32Out" if int_out else f"FloatOut<sg::{out_mma}>", quantizer=quantizer,
                out_elem="int" if int_out else ELEM_TYPES[out], scaled="true" if scales else "false",
                acc_type="int" if integer else "float", acc_ptx="s32" if integer else "f32", acc_reg="r" if integer else "f",
                sp_k=64 if one_byte else 32, one_byte=one_byte, out_mma=out_mma, wgmma_immediates=immediates)


def _validate_quantize(spec: KernelSpec) -> None:
    check_trans(spec, "nt")
    expect(spec.dtype in BYTE_DTYPES, "a one-byte dtype (int8, e4m3) for sp24_quantize", spec.dtype, SpecError)
    least = MIN_ARCH.get(spec.dtype, 80)  # e4m3's conversion instruction comes with its tensor cores
    expect(spec.arch >= least, f"sm_{least} or later for {spec.dtype} conversions", f"sm_{spec.arch}", SpecError)


def _quantize_context(spec: KernelSpec) -> dict:
    src = SCALED_OUTPUTS[spec.param_values["src"]]
    return dict(src_type=src, src_mma=MMA_TYPES[src])


def _mask_context(spec: KernelSpec) -> dict:
    """The transposable mask's search: the row pairs and the 90 patterns it tries."""
    return dict(pairs=ROW_PAIRS, patterns=TRANSPOSABLE_PATTERNS, one_byte=spec.dtype in BYTE_DTYPES)


def _prune_context(spec: KernelSpec) -> dict:
    return dict(one_byte=spec.dtype in BYTE_DTYPES)


def sp24_spec(dtype: str, arch: int, tile: TileConfig | None = None, rows: int | None = None,
              instr: str | None = None, narrow: bool = False, epilogue: str = "none", scales: int = 0,
              quantize: int = 0, groups: int = 1) -> KernelSpec:
    """The 2:4 forward. On sm_90 (tile sweeps on an H200: tools/bench24.py --tune and a
    one-off one for `narrow`): wgmma.sp fed by TMA, two consumer warpgroups of 64 W rows,
    256 tokens per block, blocks in pairs sharing X (1.2-1.6x dense at M >= 1024, where
    mma.sp reached 0.6x; the pairs gave 1-5% over single blocks at M = 16384), 64 tokens up
    to M = 128 (`narrow`: one consumer warpgroup; otherwise 128 tokens, for 65-128 tokens on
    weights of N/128 >= half the SMs: dispatch.narrow_tiles) and 32 up to 32 (the host splits K
    across blocks there). Elsewhere mma.sp: each warp owns 64 output features (warps_m of them) and tile_m / warps_n
    tokens; 128 x 128 on sm_80, 128 x 64 with 99 KB of shared memory, 64 and 32 tokens for
    small batches. One-byte types take the same tiles (k64 products: wgmma.sp on sm_90);
    `quantize` ones (scaled, up to 64 tokens) at most 6 stages: each stage holds X's 16-bit box too."""
    big_smem, many_rows = SMEM_LIMIT[arch] > 160 * 1024, rows is None or rows > 128
    if instr is None:  # Hopper: wgmma.sp for every batch size and dtype
        instr = "tma" if tile is None and arch == 90 else "mma"
    if tile is None:
        if instr == "tma":  # two consumer warpgroups of 64 W rows x tile_m tokens, stages of K 64
            tile = (TileConfig(256, 8, 1, 4, cluster=2) if many_rows else TileConfig(32, 8, 1, 6) if rows <= 32
                    else TileConfig(64, 4, 1, 8) if narrow else TileConfig(128, 8, 1, 6))
        elif rows is not None and rows <= 32:
            tile = TileConfig(32, 2, 1, 4 if big_smem else 3)
        elif not many_rows or not big_smem:
            tile = TileConfig(64, 2, 2, 3 if big_smem else 2)
        else:
            tile = TileConfig(128, 4, 2, 3) if arch >= 90 else TileConfig(128, 2, 4, 3)
    if quantize and tile.stages > 6:
        tile = dataclasses.replace(tile, stages=6)
    return KernelSpec(op="sp24_dds", block=SP24_BLOCK, dtype=dtype, trans="nt", arch=arch, tile=tile,
                      instr=instr, epilogue=epilogue, params={"scales": scales, "quantize": quantize, "groups": groups})


def sp24_compress_spec(dtype: str, arch: int, op: str = "sp24_compress") -> KernelSpec:
    """256 threads a block, one metadata word (or, for op sp24_mask, one 4 x 4 tile) each."""
    return KernelSpec(op=op, block=SP24_BLOCK, dtype=dtype, trans="nt", arch=arch, tile=THREADS_256, instr="mma")


def sp24_quantize_spec(dtype: str, arch: int, src: int) -> KernelSpec:
    """One block of 256 threads per row of activations."""
    return KernelSpec(op="sp24_quantize", block=SP24_BLOCK, dtype=dtype, trans="nt", arch=arch, tile=THREADS_256,
                      instr="mma", params={"src": src})


def default_specs(arch: int, dtypes: tuple, blocks=None) -> list[KernelSpec]:
    """The forward per batch-size bucket (with the epilogues sparsegen.patch fuses into
    16-bit products), and the pruning and expanding kernels. `blocks` is the block-sparse
    layout's: 2:4 has one shape."""
    semi = [sp24_spec(d, arch, rows=rows, narrow=narrow) for d in dtypes if d != "fp32"
            for rows, narrow in ((None, False), (128, False), (128, True), (1, False))]
    fused = [dataclasses.replace(s, epilogue=e) for s in semi if s.dtype in ("bf16", "fp16") for e in epilogues.FUSED]
    # ScaledSparse24Linear's, for bf16 and fp16 models: plain, and with each epilogue patch fuses
    fused += [dataclasses.replace(s, params={"scales": out}, epilogue=e) for s in semi if s.dtype in BYTE_DTYPES
              for out in SCALED_OUTPUTS for e in epilogues.EPILOGUES]
    # and their decode kernels that quantize X themselves (Hopper: wgmma.sp)
    fused += [sp24_spec(d, arch, rows=1, epilogue=e, scales=out, quantize=1)
              for d in dtypes if d in BYTE_DTYPES and arch == 90 for out in SCALED_OUTPUTS for e in epilogues.EPILOGUES]
    # a compiled decode step's q, k and v projections in one launch (grouped.py; wgmma.sp)
    fused += [sp24_spec(d, arch, rows=1, scales=0 if d in ("bf16", "fp16") else out, groups=MAX_GROUPS)
              for d in dtypes if d != "fp32" and arch == 90 for out in SCALED_OUTPUTS
              if d in BYTE_DTYPES or out == 1]
    semi += [sp24_compress_spec(d, arch, op) for d in dtypes if d != "fp32" for op in ("sp24_compress", "sp24_mask")]
    semi += [sp24_compress_spec(d, arch, op) for d in dtypes if d in ("bf16", "fp16")
             for op in ("sp24_expand", "sp24_transpose")]
    semi += [gated_product_spec(d, arch, geglu) for d in dtypes if d in ("bf16", "fp16") for geglu in (False, True)]
    semi += [sp24_quantize_spec(d, arch, src) for d in dtypes if d in BYTE_DTYPES for src in SCALED_OUTPUTS]
    # Int4Sparse24Linear's (W4A16), for bf16 and fp16 models, per batch-size bucket
    semi += [sp24_w4_spec(d, arch, rows=rows, epilogue=e, narrow=narrow) for d in dtypes if d in ("bf16", "fp16")
             for rows in W4_ROWS if rows is not None or arch < 90 for e in ("none", *epilogues.FUSED)
             for narrow in ((False, True) if rows in W4_NARROW_ROWS else (False,))]
    # and a compiled decode step's q, k and v projections in one launch (int4_nn.w4_group_plan), per bucket
    semi += [sp24_w4_spec(d, arch, rows=rows, narrow=narrow, groups=MAX_GROUPS) for d in dtypes if d in ("bf16", "fp16")
             for rows in (8, 16, 32) for narrow in ((False, True) if rows in W4_NARROW_ROWS else (False,))]
    semi += [sp24_compress_spec(d, arch, "sp24_w4_values") for d in dtypes if d in ("bf16", "fp16")]
    return semi + fused


registry.register(registry.Layout("semi24", (
    registry.OpRules("sp24_dds", "semi24/sp24_dds.cu.j2", _validate, _dds_smem, context=_output_context,
                     epilogues=True, args=registry.ProductArgs(("x", "values", "metadata", "bias")),
                     params=(SCALES, QUANTIZED_X, GROUPS), float_output=lambda spec: spec.dtype != "int8" or _scales(spec) > 0),
    registry.OpRules("sp24_w4", "semi24/sp24_w4.cu.j2", _validate_w4, _w4_smem, context=_output_context,
                     epilogues=True, params=(KWARPS, GROUPS), k_warps=_kwarps, tile_m_step=8),
    registry.OpRules("sp24_w4_values", "semi24/sp24_w4_values.cu.j2", _validate_16bit, _no_smem, tensor_cores=False),
    registry.OpRules("sp24_compress", "semi24/sp24_compress.cu.j2", _validate, _no_smem, context=_prune_context,
                     tensor_cores=False),
    registry.OpRules("sp24_mask", "semi24/sp24_mask.cu.j2", _validate, _no_smem, context=_mask_context,
                     tensor_cores=False),
    registry.OpRules("sp24_expand", "semi24/sp24_expand.cu.j2", _validate_16bit, _no_smem, tensor_cores=False),
    registry.OpRules("sp24_transpose", "semi24/sp24_transpose.cu.j2", _validate_16bit, _no_smem, tensor_cores=False),
    registry.OpRules("sp24_quantize", "semi24/sp24_quantize.cu.j2", _validate_quantize, _no_smem,
                     context=_quantize_context, tensor_cores=False, params=(SOURCE,)),
    registry.OpRules("gated_product", "semi24/gated_product.cu.j2", _validate_16bit, _no_smem, tensor_cores=False,
                     params=(GEGLU,)),
), default_specs, Path(__file__).parent, lowerings_module="compiled", faces_module="face", kit_module="ops"))
