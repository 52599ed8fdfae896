"""Which block-sparse kernel serves a call: kernels per block, dtype and batch size, and the
rules measured on H100s and H200s - the dense path at high density, the swap family's
pairs and clusters, and the sampled weight gradient against cuBLAS.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..launch import calls, runtime
from . import format as bsr
from .specs import forward_spec, has_call_variants, input_grad_spec, scatter_spec, sdd_spec


def input_grad_kernel(dy, block):
    if not (calls.runs_16bit_kernels(dy) and dy.numel() > 0):
        return None
    small = dy.numel() // dy.shape[-1] <= 64
    return transposed_kernel(tuple(block), dy.dtype, dy.device.index or 0, small)


@functools.lru_cache(maxsize=None)
def transposed_kernel(block: tuple[int, int], dtype: torch.dtype, device_index: int, small: bool,
                       tile=None, instr=None):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    spec = input_grad_spec(block, calls.DTYPE_NAMES[dtype], arch, rows=1 if small else None, tile=tile, instr=instr)
    return runtime.kernel(spec, device_index) if spec else None


@functools.lru_cache(maxsize=None)
def forward_kernel(block: tuple[int, int], dtype: torch.dtype, device_index: int, small: bool,
                    tile=None, instr=None, epilogue: str = "none", acc: str = "f32"):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    # The CUBIN is built for the device's own compute capability: sm_80 code won't load on sm_90.
    spec = forward_spec(block, calls.DTYPE_NAMES[dtype], arch, tile, instr, rows=1 if small else None,
                        epilogue=epilogue, acc=acc)
    return runtime.kernel(spec, device_index)


# Small blocks at high density lose to cuBLAS on the same weight made dense: on an H100
# (BENCHMARKS.md) block 16 ran 0.6-0.84x dense at d 0.1 and 0.2x at 0.5, block 32 0.9-1.03x
# at 0.25 and 0.45-0.54x at 0.5, while scattering the blocks into a dense weight (the
# generated bsr_scatter kernel: 25 us for 4096 x 4096, 58 us for 11008 x 4096) costs 5-14%
# of the GEMM at M = 4096-8192. Per smaller block side, the density from which the forward
# takes that path, for DENSE_MIN_ROWS tokens or more (with fewer the GEMM does too little
# work to pay for reading and writing a dense weight).
DENSE_FROM_DENSITY = {16: 0.08, 32: 0.3}


DENSE_MIN_ROWS = 1024


def dense_pays(block, stored_blocks: int, m: int, k: int, out_features: int) -> bool:
    if m < DENSE_MIN_ROWS:  # first: the cheapest test, and the one small batches fail
        return False
    least = DENSE_FROM_DENSITY.get(min(block))
    return least is not None and stored_blocks >= least * (out_features // block[0]) * (k // block[1])


@functools.lru_cache(maxsize=None)
def scatter_kernel(block: tuple[int, int], dtype: torch.dtype, device_index: int):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    return runtime.kernel(scatter_spec(block, calls.DTYPE_NAMES[dtype], arch), device_index)


def pair_index(row_offsets, col_indices, perm) -> tuple[torch.Tensor, ...]:
    """bsr.pair_index, which reads the index on the host: built once per layout."""
    return calls.per_layout("pairs", row_offsets, bsr.pair_index, row_offsets, col_indices, perm, reads_host=True)


def swap_variant(kern, dtype: torch.dtype, m: int, row_offsets, col_indices, perm):
    """The swap family's choices at 64-row blocks that depend on the call (H100 sweeps,
    BENCHMARKS.md): the forward runs `pairs` where the layout's pairs share enough columns
    (dX always does), and clusters of two blocks share W's copies where tiles are many and
    long (cluster_pays)."""
    spec = kern.spec
    if not has_call_variants(spec):
        return kern
    pairs = spec.instr == "pairs" or (perm is None and pairs_pay(row_offsets, col_indices))
    instr = "pairs" if pairs else "swap"
    cluster = 2 if cluster_pays(-(-m // spec.tile.tile_m), col_indices.numel() * spec.block[1] // 64,
                                 row_offsets.numel() - 1) else 1
    if (instr, cluster) == (spec.instr, spec.tile.cluster):
        return kern
    tile = dataclasses.replace(spec.tile, cluster=cluster)
    return runtime.kernel(dataclasses.replace(spec, tile=tile, instr=instr), kern.device_index)


def cluster_pays(token_tiles: int, stages: int, block_rows: int) -> bool:
    """Clusters of two (sharing W's copies) from 32 token tiles and 16 stages (64 columns of
    K) a block row on average. On an H100 they gained 0-5% at (8192, 4096, 11008) and
    (8192, 11008, 4096) with 16-86 stages a row (dX 3-5%), lost up to 3.5% with 6.4, and 5-6%
    at (4096, 4096, 4096) (16 token tiles) and (16384, 1024, 4096) (4 stages a row)."""
    return token_tiles >= 32 and stages >= 16 * max(block_rows, 1)


def pairs_pay(row_offsets, col_indices) -> bool:
    """Whether the forward's swap kernel should run over pairs of block rows instead. The
    rule fits an H100 (tmp_probe-style sweep over issue #2's shapes at block 64, BENCHMARKS.md):
    pairs won 6-24% where the two rows of a pair shared a fifth of their columns or more
    (1.2+ blocks per union column, density ~0.4 and up) over long rows, and lost up to 16%
    at density 0.1-0.25 or with 16 blocks a row (K = 1024). Fitted with neighbouring rows as
    pairs; with pairs matched by shared columns, d 0.25 qualifies at (8192, 4096, 11008) and
    (8192, 11008, 4096) and ran 12-16% faster than swap."""
    pair_offsets, _, halves, _ = pair_index(row_offsets, col_indices, None)
    union, pairs = halves.shape[0], pair_offsets.numel() - 1
    return col_indices.numel() >= 1.2 * union and union >= 24 * pairs


# Measured on an H200 (tools/bench.py --train): the sdd kernel beats cuBLAS + gather below
# about d = 0.3 (mma.sync). The wgmma one (sm_90) took 0.86 ms at block 64, d 0.5, against
# 0.94 ms for cuBLAS's whole dense dW; 0.6 extrapolates from its time growing with the
# blocks kept (cuBLAS's does not), not from a measurement at 0.6.
SDD_MAX_DENSITY = {"mma": 0.3, "tma": 0.6}


@functools.lru_cache(maxsize=None)
def _sdd_spec(block: tuple[int, int], dtype: torch.dtype, device_index: int, many_blocks: bool = False):
    return sdd_spec(block, calls.DTYPE_NAMES[dtype], runtime.device_arch(torch.device("cuda", device_index)),
                    many_blocks=many_blocks)


@functools.lru_cache(maxsize=None)
def _sdd_kernel(block: tuple[int, int], dtype: torch.dtype, device_index: int, many_blocks: bool):
    return runtime.kernel(_sdd_spec(block, dtype, device_index, many_blocks), device_index)


# Stored blocks per SM from which the sdd kernel's wide tile (sdd_spec's many_blocks, items
# of 8 blocks) pays at 64-row blocks. On an H100 (tmp_probe sweep, BENCHMARKS.md), wide over
# narrow time: 0.83-0.85 at 7.8 and 15.5 blocks an SM, 0.90-0.94 at 21-42, 0.99 at 8.3 (short
# rows: partial items); 1.25-1.58 at 0.8-3.9, where the narrow tile's items still fit one
# round on the SMs and the wide one leaves half of them idle.
SDD_WIDE_BLOCKS_PER_SM = 6


def sdd_max_density(dy2: torch.Tensor, block) -> float:
    """From the spec alone: deciding on cuBLAS must not compile or load the kernel."""
    return SDD_MAX_DENSITY[_sdd_spec(tuple(block), dy2.dtype, dy2.device.index or 0).instr]


def sdd_kernel_for(dy2: torch.Tensor, flat_index: torch.Tensor, block):
    """The sdd kernel ops.weight_grad runs for this many stored blocks on dy2's GPU: the wide
    tile from SDD_WIDE_BLOCKS_PER_SM blocks an SM (at 64-row blocks on sm_90)."""
    device_index = dy2.device.index or 0
    many_blocks = flat_index.numel() >= SDD_WIDE_BLOCKS_PER_SM * runtime.sm_count(device_index)
    return _sdd_kernel(tuple(block), dy2.dtype, device_index, many_blocks)
