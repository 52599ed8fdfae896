"""Which 2:4 kernel serves a call: the forward's tiles per batch-size bucket, K splits for
small batches (decode), and the pruning kernels; the rules come from H100 and H200 sweeps.
"""
from __future__ import annotations

import functools

import torch

from ..launch import calls, runtime
from .specs import SCALED_CODES, gated_product_spec, sp24_compress_spec, sp24_quantize_spec, sp24_spec, w_rows


# One-byte 2:4 products (Sparse24Tensor inference) and the dtype each writes Y in.
BYTE_DTYPE_NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "e4m3"}
DTYPE_NAMES = {**calls.DTYPE_NAMES, **BYTE_DTYPE_NAMES}


@functools.lru_cache(maxsize=None)
def forward_kernel(dtype: torch.dtype, device_index: int, rows_bucket: int | None, tile=None, instr=None,
                 narrow: bool = False, epilogue: str = "none", scales: int = 0, quantize: int = 0, groups: int = 1):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    spec = sp24_spec(DTYPE_NAMES[dtype], arch, tile, rows=rows_bucket, instr=instr, narrow=narrow,
                     epilogue=epilogue, scales=scales, quantize=quantize, groups=groups)
    return runtime.kernel(spec, device_index)


def rows_bucket(m: int) -> int | None:
    """The batch sizes sp24_spec tells apart (a few cached kernels, not one per M)."""
    return 32 if m <= 32 else 128 if m <= 128 else None


SP24_STAGE_K = 128  # dense K per pipeline stage of the sp24 kernel: K splits come in these


def k_splits(blocks: int, k: int, device_index: int, per_sm: int = 2, min_stages: int = 1) -> int:
    """Small batches give too few output tiles to fill the GPU: split K until about
    `per_sm` blocks per SM run (each split adds its partial sum in float32), each split
    `min_stages` stages of K at least."""
    stages = -(-k // SP24_STAGE_K)
    return max(1, min(stages // min_stages, (per_sm * runtime.sm_count(device_index)) // max(blocks, 1)))


def wanted_splits(splits: int | None, dtype: torch.dtype, scales: int = 0) -> int | None:
    """`splits` as asked (None: the grid decides), or 1 for unscaled int8: K splits add float32
    partial sums, which would round its int32 sums (scaled ones are float anyway). (Splits are
    deterministic: the last split adds every split's slice in split order, so
    torch.use_deterministic_algorithms needs no change.)"""
    return 1 if dtype == torch.int8 and not scales else splits


# Tokens a patched model's calls are likely to have: decode (up to 32), small batches (33-64 and
# 65-128) and prefill (more): one of each forward kernel sp24_spec tells apart (likely_specs).
LIKELY_ROWS = (1, 64, 128, 2048)


@functools.lru_cache(maxsize=256)  # (a model's layers repeat a few shapes: patch asks once a shape, not a layer)
def likely_specs(dtype: torch.dtype, arch: int, sm_count: int, out_features: int, epilogue: str,
                 activations: torch.dtype | None = None) -> tuple:
    """The forward kernels a layer of this weight dtype and epilogue takes at LIKELY_ROWS
    tokens on a GPU of `arch` and `sm_count` SMs; a one-byte weight's (scaled, its activations
    `activations`) with its quantizing decode kernel and sp24_quantize."""
    code = SCALED_CODES[activations] if dtype in BYTE_DTYPE_NAMES else 0
    name = DTYPE_NAMES[dtype]
    found = [sp24_spec(name, arch, rows=rows_bucket(m), narrow=_narrow(m, out_features, sm_count), epilogue=epilogue,
                       scales=code) for m in LIKELY_ROWS]
    if code and arch == 90:
        found.append(sp24_spec(name, arch, rows=rows_bucket(1), epilogue=epilogue, scales=code, quantize=1))
    if code:
        found.append(sp24_quantize_spec(name, arch, code))
    return tuple(found)


def narrow_tiles(m: int, n: int, device_index: int) -> bool:
    """33-128 tokens on Hopper: blocks of 64 W rows x 64 tokens, except 65-128 tokens on a
    weight whose 128-row tiles fill half the SMs or more: 128 W rows x 128 tokens. From a
    decode sweep on an H100 (tools/bench24.py --tune-decode, weights read from HBM): at M 128
    11008x4096 ran 1.45x dense that way against 1.17x narrow and 1.00x on 128 x 64 tiles,
    14336x4096 1.54x against 1.25x; 8192x8192 (64 tiles) 1.34x narrow against 1.23x; at M 64
    narrow was as fast or faster everywhere (4096x4096 0.95x against 0.80x)."""
    return _narrow(m, n, runtime.sm_count(device_index))


def _narrow(m: int, n: int, sm_count: int) -> bool:
    if rows_bucket(m) != 128:
        return False
    return m <= 64 or 2 * -(-n // 128) < sm_count


# K splits of wgmma.sp decode launches (the same sweep): one block per SM (a second split per SM
# only added atomics), and for 33-128 tokens at least 24 stages (3072 of K) a split - 4096x4096
# at M 64 ran 0.95x dense unsplit and 0.75x in two.
_DECODE_MIN_STAGES = {32: 1, 128: 24}
# sp24_w4 at 33-128 tokens: K splits for one block per SM, not two - each split's float32 sums
# (splits x M x N) outweigh a small 4-bit weight there: 4096x4096 at 64 tokens ran 0.69x
# cuBLAS bf16 in 4 splits and 0.51x in 8 (an H200, tools/probe_int4.py)
_W4_SMALL_BATCH_PER_SM = 1
# sp24_w4 at 1-32 tokens: a split keeps 4 stages (512 of K) at least. A k/v projection's
# 1024x4096 weight makes 8 tiles, which two blocks per SM split into 32 one-stage slices of
# float32 sums; in 8 splits it ran 1.03x cuBLAS bf16 at 8 tokens (0.82x in 32), 0.89x at 16
# (0.57x), 0.54x at 32 (0.30x) (an H200, tools/probe_int4.py --weights 1024x4096). Wider
# weights split 8 ways or fewer anyway.
_W4_DECODE_MIN_STAGES = 4


def grid(spec, m: int, k: int, n: int, device_index: int, splits: int | None, resident: int | None = None):
    """(grid, dense K per split): output tiles (mma.sp: in x and y; wgmma.sp: x, no more blocks
    than `resident` (default: one per SM), each walking tiles x, x + grid x, ...), K splits
    (whole stages) in z."""
    tiles_n, tiles_m = -(-n // w_rows(spec)), -(-m // spec.tile.tile_m)
    per_sm, min_stages = _split_rule(spec, m)
    wanted = splits or (k_splits(tiles_n * tiles_m, k, device_index, per_sm, min_stages) if m <= 256 else 1)
    k_split = -(-k // (wanted * SP24_STAGE_K)) * SP24_STAGE_K
    splits_k = -(-k // k_split)
    if spec.instr != "tma":
        return (tiles_n, tiles_m, splits_k), k_split
    cluster = spec.tile.cluster  # a cluster's blocks take neighbouring W tiles: work items of `cluster` tiles
    items = -(-tiles_n // cluster) * tiles_m
    slots = runtime.persistent_blocks(resident or runtime.sm_count(device_index)) // cluster
    return (cluster * (items if splits_k > 1 else min(items, slots)), 1, splits_k), k_split


def _split_rule(spec, m: int) -> tuple[int, int]:
    """(blocks per SM that K splits aim for, stages of K a split keeps at least) for M tokens."""
    if spec.instr == "tma" and rows_bucket(m) is not None:  # wgmma.sp decode
        return 1, _DECODE_MIN_STAGES[rows_bucket(m)]
    if spec.op == "sp24_w4":
        return (_W4_SMALL_BATCH_PER_SM, 1) if m > 32 else (2, _W4_DECODE_MIN_STAGES)
    return 2, 1


def split_space(spec, grid: tuple[int, int, int], m: int, n: int) -> tuple[int, int]:
    """(float32 split-K sums, int32 tile counters) a launch on `grid` needs: a slice of partial
    sums per split (templates/common/sg_split_k.cuh) and its counters; none unsplit."""
    return (grid[2] * m * n, tile_counts(spec, m, n)) if grid[2] > 1 else (0, 0)


def tile_counts(spec, m: int, n: int) -> int:
    """Arrival counters a split-K launch needs: at most one per token tile, W tile (its
    column count padded to whole clusters) and 64 features of it."""
    tiles_w = -(-(-(-n // w_rows(spec))) // spec.tile.cluster) * spec.tile.cluster
    return -(-m // spec.tile.tile_m) * tiles_w * (w_rows(spec) // 64)


@functools.lru_cache(maxsize=None)
def quantize_kernel(dtype: torch.dtype, source: torch.dtype, device_index: int):
    """sp24_quantize from `source` (bfloat16, float16) activations to one-byte `dtype`."""
    arch = runtime.device_arch(torch.device("cuda", device_index))
    return runtime.kernel(sp24_quantize_spec(DTYPE_NAMES[dtype], arch, SCALED_CODES[source]), device_index)


@functools.lru_cache(maxsize=None)
def prune_kernel(op: str, dtype: torch.dtype, device_index: int):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    return runtime.kernel(sp24_compress_spec(DTYPE_NAMES[dtype], arch, op), device_index)


@functools.lru_cache(maxsize=None)
def gated_kernel(dtype: torch.dtype, device_index: int, geglu: bool):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    return runtime.kernel(gated_product_spec(DTYPE_NAMES[dtype], arch, geglu), device_index)
