"""KernelSpec: the one frozen value that names a generated kernel.

Every field that changes the generated code is a field here, so the name and the
cache key change whenever the code does (a test checks each field in turn).
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field

from . import epilogues
from .errors import SpecError, expect

DTYPES = ("fp16", "bf16", "fp32", "int8", "e4m3")
# One-byte inputs have only the 2:4 kernels (forward on k64 products, and pruning): int8
# (int32 out) from sm_80, fp8 e4m3 (bf16 out) from sm_89, the first arch with fp8 tensor cores.
BYTE_DTYPES = ("int8", "e4m3")
BLOCK_DTYPES = tuple(d for d in DTYPES if d not in BYTE_DTYPES)  # the block-sparse kernels' dtypes
MIN_ARCH = {"e4m3": 89}
BLOCK_SIDES = (16, 32, 64, 128)
# Y = X W^T with W block-sparse: output dense, lhs dense, rhs sparse (stk's naming).
# bsr_dds: Y = X W^T (W block-sparse; the forward, and dX on W^T). bsr_sdd: dW = dY^T X
# sampled at W's stored blocks (the weight gradient). stk's naming: output, lhs, rhs.
# sp24_dds: Y = X W^T with W 2:4 semi-structured (mma.sp); its "block" is the instruction's
# 16 x 32 tile of W, the granule its shapes come in. sp24_compress: prune a dense W to 2:4
# and pack values and metadata (one thread per metadata word; tile gives the block size).
# sp24_mask: the transposable 2:4 mask of a dense W (one thread per 4 x 4 tile).
# sp24_expand: a 2:4 W to dense, or a dense gradient's elements at W's stored positions
# (16-bit; one thread per metadata word) - Sparse24Linear's backward.
# bsr_scatter: the dense W of a block-sparse one (the forward's dense path, ops._dense_forward).
OPS = ("bsr_dds", "bsr_sdd", "sp24_dds", "sp24_compress", "sp24_mask", "sp24_expand", "bsr_scatter")
SP24_OPS = ("sp24_dds", "sp24_compress", "sp24_mask", "sp24_expand")
TRANSPOSES = ("nt", "tn", "nn")  # nn: bsr_dds reading W's stored blocks as W^T (dX = dY W; swap only)
OP_TRANS = {"bsr_dds": "nt", "bsr_sdd": "tn", "sp24_dds": "nt", "sp24_compress": "nt", "sp24_mask": "nt",
            "sp24_expand": "nt", "bsr_scatter": "nt"}  # operand layouts
SP24_BLOCK = (16, 32)
NO_MMA_OPS = ("sp24_compress", "sp24_mask", "sp24_expand", "bsr_scatter")  # copies and pruning, no tensor cores
# Tensor-core path: "mma" (mma.sync, sm_80 and later); on sm_90a, "wgmma" (Hopper warpgroup
# MMA fed by cp.async), "tma" (wgmma fed by TMA from a producer warpgroup, consumers split
# each tile) and "pingpong" (the same, consumers alternate whole tiles); "swap" (W as
# wgmma's A operand) and "pairs" (swap over pairs of 64-row block rows that share X's copies).
INSTRS = ("mma", "wgmma", "tma", "pingpong", "swap", "pairs")
HOPPER_INSTRS = ("wgmma", "tma", "pingpong", "swap", "pairs")
TMA_INSTRS = ("tma", "pingpong", "swap", "pairs")
SWAP_INSTRS = ("swap", "pairs")  # W as wgmma's A
# Opt-in shared memory per block, by compute capability (CUDA programming guide).
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024,
              100: 227 * 1024, 103: 227 * 1024, 120: 99 * 1024}
ARCHS = tuple(SMEM_LIMIT)
STAGE_BYTES_PER_ROW = 128  # one pipeline stage holds 128 bytes of K per row: 64 halves / 32 floats
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "int8": 1, "e4m3": 1}
# The inverse of KernelSpec.name; op may itself contain underscores (bsr_dds). The arch's
# "a" suffix follows from instr, so from_name checks it by rebuilding the name.
_TAG_PATTERN = r"t(?P<tile_m>\d+)w(?P<warps_m>\d+)x(?P<warps_n>\d+)s(?P<stages>\d+)(?:c(?P<cluster>\d+))?"
_NAME_RE = re.compile(r"(?P<op>[a-z][a-z0-9_]*?)_b(?P<bm>\d+)x(?P<bk>\d+)_(?P<dtype>[a-z0-9]+)"
                      r"_(?P<trans>[a-z]+)_sm(?P<arch>\d+)a?_(?P<instr>[a-z]+)_" + _TAG_PATTERN +
                      r"(?:_e(?P<epilogue>[a-z]+))?")
_NAME_FORM = "OP_bROWSxCOLS_DTYPE_TRANS_smARCH[a]_INSTR_tTILEMwWARPSMxWARPSNsSTAGES[cCLUSTER][_eEPILOGUE]"
# The forward ops, which can fuse an epilogue (epilogues.py) into their store.
EPILOGUE_OPS = ("bsr_dds", "sp24_dds")
PATCHED_EPILOGUES = ("gelu", "gelu_tanh", "swiglu")  # what patch fuses (precompiled)
CLUSTER_SIZES = (1, 2, 4)


@dataclass(frozen=True)
class TileConfig:
    """How one threadblock splits its output tile: rows of X, warp grid, pipeline depth, and
    how many blocks of a cluster share their X tile (sp24_dds on TMA only)."""

    tile_m: int = 128
    warps_m: int = 2
    warps_n: int = 2
    stages: int = 3
    cluster: int = 1

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def tag(self) -> str:
        cluster = f"c{self.cluster}" if self.cluster > 1 else ""
        return f"t{self.tile_m}w{self.warps_m}x{self.warps_n}s{self.stages}{cluster}"

    @classmethod
    def from_tag(cls, tag: str) -> "TileConfig":
        """The tile whose .tag is tag (t64w8x1s4, t64w8x1s4c2)."""
        match = re.fullmatch(_TAG_PATTERN, tag)
        expect(match is not None, "a tile tag like t64w8x1s4 or t64w8x1s4c2", repr(tag), SpecError)
        return cls._from_groups(match.groupdict())

    @classmethod
    def _from_groups(cls, g: dict) -> "TileConfig":
        return cls(**{k: int(g[k]) for k in ("tile_m", "warps_m", "warps_n", "stages")}, cluster=int(g["cluster"] or 1))


@dataclass(frozen=True)
class KernelSpec:
    """One specialization: op, block shape, dtype, operand transposes, arch, tile."""

    op: str = "bsr_dds"
    block: tuple[int, int] = (32, 32)
    dtype: str = "bf16"
    trans: str = "nt"
    arch: int = 90
    tile: TileConfig = field(default_factory=TileConfig)
    instr: str = "mma"
    epilogue: str = "none"  # epilogues.EPILOGUES: applied to X W^T + b in the forward's store

    def __post_init__(self):
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        self.validate()

    @property
    def name(self) -> str:
        """Readable, symbol-safe: bsr_dds_b32x32_bf16_nt_sm90a_wgmma_t128w8x1s4 (+ _esilu etc.
        where there is an epilogue)."""
        bm, bk = self.block
        epilogue = "" if self.epilogue == "none" else f"_e{epilogues.name_token(self.epilogue)}"
        return (f"{self.op}_b{bm}x{bk}_{self.dtype}_{self.trans}_{self.target.replace('_', '')}"
                f"_{self.instr}_{self.tile.tag}{epilogue}")

    @property
    def target(self) -> str:
        """NVRTC's --gpu-architecture: wgmma only exists on the arch-specific sm_90a."""
        return f"sm_{self.arch}a" if self.instr in HOPPER_INSTRS else f"sm_{self.arch}"

    @property
    def threads(self) -> int:
        """Threads per block: the tile's warps, plus the producer warpgroup for tma."""
        return self.tile.threads + (128 if self.instr in TMA_INSTRS else 0)

    @classmethod
    def from_name(cls, name: str) -> "KernelSpec":
        """The spec whose .name is name (for `sparsegen show NAME`); validates it too."""
        match = _NAME_RE.fullmatch(name)
        expect(match is not None, "a kernel name like bsr_dds_b32x32_bf16_nt_sm80_mma_t128w4x1s4 "
               f"({_NAME_FORM})", repr(name), SpecError)
        g = match.groupdict()
        tile = TileConfig._from_groups(g)
        epilogue = epilogues.from_name_token(g["epilogue"]) if g["epilogue"] else "none"
        expect(epilogue is not None, f"an epilogue in {epilogues.EPILOGUES} (letters only in the name)",
               repr(g["epilogue"]), SpecError)
        spec = cls(op=g["op"], block=(int(g["bm"]), int(g["bk"])), dtype=g["dtype"],
                   trans=g["trans"], arch=int(g["arch"]), tile=tile, instr=g["instr"], epilogue=epilogue)
        expect(spec.name == name, f"the name {spec.name} for these fields", repr(name), SpecError)
        return spec

    @property
    def key(self) -> str:
        """Short hash of every field (the disk cache adds source and compiler version)."""
        return hashlib.sha256(repr(dataclasses.astuple(self)).encode()).hexdigest()[:16]

    @property
    def sp24_w_rows(self) -> int:
        """sp24_dds: weight rows per block - 64 per consumer warpgroup (tma), per warp (mma)."""
        return (16 if self.instr == "tma" else 64) * self.tile.warps_m

    @property
    def sdd_gather(self) -> int:
        """bsr_sdd on tma: X's columns one work item gathers - 128 per consumer warpgroup at
        block rows of 64, 256 (the two consumers' rows) at 128."""
        consumers = self.tile.warps_m // 4
        return 128 * consumers if self.block[0] == 64 else 256

    @property
    def stage_k(self) -> int:
        """Elements of K one pipeline stage covers (128 bytes' worth)."""
        return STAGE_BYTES_PER_ROW // ELEMENT_BYTES[self.dtype]

    def smem_bytes(self) -> int:
        if self.op == "bsr_sdd" and self.instr == "tma":  # per stage: tile_m tokens of dY's bm and the X columns
            per_token = (self.block[0] + self.sdd_gather) * ELEMENT_BYTES[self.dtype]
            return self.tile.stages * self.tile.tile_m * per_token + 1024 + 16 * self.tile.stages
        if self.op == "bsr_sdd":  # stages of tile_m rows of dY (bm columns) and X (bk columns)
            return self.tile.stages * self.tile.tile_m * sum(self.block) * ELEMENT_BYTES[self.dtype]
        if self.op in NO_MMA_OPS:
            return 0
        if self.op == "sp24_dds" and self.instr == "tma":  # 128 bytes per X row, 64 + 8 (e4m3: 16) per W row
            staging = self.sp24_w_rows * 2 * (64 if self.tile.tile_m >= 128 else 32)  # the store's token chunks
            ring = self.tile.stages * (self.tile.tile_m * 128 + self.sp24_w_rows * (64 + 16 // ELEMENT_BYTES[self.dtype]))
            return ring + staging + 1024 + 16 * self.tile.stages
        if self.op == "sp24_dds":  # per stage: 256 bytes per X row; 128 of values + 16 (8-bit: 32) of metadata per W row
            return self.tile.stages * (self.tile.tile_m * 256 + self.sp24_w_rows * (128 + 32 // ELEMENT_BYTES[self.dtype]))
        rows = self.tile.tile_m + (128 if self.instr == "pairs" else self.block[0])  # pairs: two blocks a stage
        align = 1024 if self.instr in HOPPER_INSTRS else 0  # swizzle atoms are 1024-aligned
        # full + empty mbarriers per stage, and one that orders ping-pong mainloops
        barriers = 16 * self.tile.stages + 8 if self.instr in TMA_INSTRS else 0
        staging = 2 * 64 * STAGE_BYTES_PER_ROW if self.instr in SWAP_INSTRS else 0  # the transposing store's chunks
        return self.tile.stages * rows * STAGE_BYTES_PER_ROW + align + barriers + staging

    def validate(self) -> None:
        _check_choice("op", self.op, OPS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("trans", self.trans, TRANSPOSES)
        _check_choice("arch", self.arch, ARCHS)
        _check_choice("instr", self.instr, INSTRS)
        _check_choice("epilogue", self.epilogue, epilogues.EPILOGUES)
        if self.epilogue != "none":
            expect(self.op in EPILOGUE_OPS and self.trans == "nt" and self.dtype != "int8",
                   f"a forward op {EPILOGUE_OPS} with trans 'nt' and float outputs for an epilogue",
                   f"{self.op}, trans {self.trans!r}, {self.dtype}", SpecError)
        expect(len(self.block) == 2 and all(b in BLOCK_SIDES for b in self.block),
               f"block sides each one of {BLOCK_SIDES}", self.block, SpecError)
        transposed_read = self.op == "bsr_dds" and self.trans == "nn" and self.instr in SWAP_INSTRS
        expect(self.trans == OP_TRANS[self.op] or transposed_read,
               f"trans {OP_TRANS[self.op]!r} for {self.op} ('nn' only for bsr_dds on swap or pairs)", repr(self.trans),
               SpecError)
        if self.op == "bsr_sdd":
            _validate_sdd(self)
        if self.op == "bsr_scatter":
            expect(self.instr == "mma" and self.dtype in BLOCK_DTYPES, f"instr 'mma' and a dtype in {BLOCK_DTYPES} "
                   "for bsr_scatter (it copies, no tensor cores)", f"{self.instr}, {self.dtype}", SpecError)
        if self.op == "sp24_expand":
            expect(self.dtype in ("bf16", "fp16"), "a 16-bit dtype for sp24_expand (the trained layers')",
                   self.dtype, SpecError)
        if self.dtype in BYTE_DTYPES:
            _validate_byte_dtype(self)
        if self.op in SP24_OPS:
            _validate_sp24(self)
        _validate_tile(self)
        if self.instr in HOPPER_INSTRS and self.op not in SP24_OPS + ("bsr_sdd",):
            _validate_wgmma(self)


def _validate_sdd(spec: KernelSpec) -> None:
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


def _byte_instrs(spec: KernelSpec) -> tuple[str, ...]:
    """Pruning runs mma-family kernels; the forward mma.sp, and on sm_90 wgmma.sp too - only
    wgmma.sp for e4m3: sm_90 has no fp8 mma.sync (ptxas emulates it through the stack,
    320-360x slower than cuBLAS fp8 on an H100: tools/bench24.py --bytes)."""
    if spec.op != "sp24_dds" or spec.arch != 90:
        return ("mma",)
    return ("tma",) if spec.dtype == "e4m3" else ("mma", "tma")


def _validate_byte_dtype(spec: KernelSpec) -> None:
    instrs = _byte_instrs(spec)
    expect(spec.op in SP24_OPS and spec.instr in instrs, f"a 2:4 op on instr {' or '.join(map(repr, instrs))} "
           f"for {spec.dtype} on sm_{spec.arch} (one-byte types have the 2:4 forward and pruning kernels only)",
           f"{spec.op!r} on {spec.instr!r}", SpecError)
    if spec.op != "sp24_dds":  # pruning needs no tensor cores
        return
    least = MIN_ARCH.get(spec.dtype, 80)
    expect(spec.arch >= least, f"sm_{least} or later for {spec.dtype} tensor cores", f"sm_{spec.arch}", SpecError)


def _validate_sp24(spec: KernelSpec) -> None:
    t = spec.tile
    hopper = spec.op == "sp24_dds" and spec.arch == 90
    expect(spec.instr == "mma" or (hopper and spec.instr == "tma"),
           "instr 'mma' (mma.sp), or 'tma' (wgmma.sp) for sp24_dds on sm_90", repr(spec.instr), SpecError)
    expect(spec.dtype != "fp32", "a 16-bit or one-byte dtype for 2:4 kernels", spec.dtype, SpecError)
    expect(spec.block == SP24_BLOCK, f"block {SP24_BLOCK} (the mma.sp tile) for {spec.op}", spec.block, SpecError)
    if spec.instr == "tma":  # consumer warpgroups of 64 W rows; tile_m tokens are wgmma's N
        expect(t.warps_n == 1 and t.warps_m % 4 == 0 and t.tile_m <= 256 and t.tile_m % 8 == 0,
               "warps_n = 1, whole warpgroups (warps_m % 4 == 0) and tile_m <= 256 for tma",
               t.tag, SpecError)
        expect(t.tile_m % (8 * t.cluster) == 0, "tile_m a multiple of 8 x cluster (each block's share of X)",
               t.tag, SpecError)
        return
    expect(t.tile_m % (8 * t.warps_n) == 0, f"tile_m a multiple of 8 x warps_n = {8 * t.warps_n}",
           t.tile_m, SpecError)


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


def _check_choice(what: str, value, choices) -> None:
    expect(value in choices, f"{what} one of {choices}", repr(value), SpecError)


def _validate_tile(spec: KernelSpec) -> None:
    t, (bm, _) = spec.tile, spec.block
    _check_choice("cluster", t.cluster, CLUSTER_SIZES)
    shares = (spec.op == "sp24_dds" and spec.instr == "tma") or has_call_variants(spec)
    expect(t.cluster in (1, 2) or (t.cluster == 4 and spec.op == "sp24_dds"), "a cluster of 1 or 2 (4: sp24_dds)",
           t.cluster, SpecError)
    expect(t.cluster == 1 or shares, "cluster 1 (clusters share tiles only in sp24_dds on TMA, and in swap and "
           "pairs at 64-row blocks)", t.cluster, SpecError)
    if spec.op == "bsr_dds" and spec.instr not in SWAP_INSTRS:  # warps split tile_m rows of X and the block's rows of W
        expect(t.tile_m % (16 * t.warps_m) == 0,
               f"tile_m a multiple of 16 x warps_m = {16 * t.warps_m}", t.tile_m, SpecError)
        expect(bm % (16 * t.warps_n) == 0,
               f"block rows ({bm}) a multiple of 16 x warps_n = {16 * t.warps_n}; use fewer warps_n",
               t.warps_n, SpecError)
    expect(t.tile_m % 16 == 0, "tile_m a multiple of 16", t.tile_m, SpecError)
    expect(t.stages >= 2, "at least 2 pipeline stages", t.stages, SpecError)
    expect(spec.threads <= 1024, "at most 1024 threads per block", spec.threads, SpecError)
    limit = SMEM_LIMIT[spec.arch]
    expect(spec.smem_bytes() <= limit,
           f"shared memory within sm_{spec.arch}'s {limit} bytes; reduce tile_m or stages",
           f"{spec.smem_bytes()} bytes for {spec.tile.tag}", SpecError)


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
                              stages=_stages_that_fit(block, tile_m, arch, most=6))
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


def _stages_that_fit(block, tile_m: int, arch: int, most: int) -> int:
    """The deepest TMA ring (<= most) whose stages, barriers and alignment fit shared memory."""
    stage = (tile_m + block[0]) * STAGE_BYTES_PER_ROW
    fits = [s for s in range(2, most + 1) if s * stage + 16 * s + 8 + 1024 <= SMEM_LIMIT.get(arch, 0)]
    return max(fits, default=2)


def forward_spec(block, dtype: str, arch: int, tile: TileConfig | None = None,
                 instr: str | None = None, rows: int | None = None, epilogue: str = "none") -> KernelSpec:
    block = tuple(block)
    instr = instr or default_instr(dtype, arch, block, rows)
    return KernelSpec(op="bsr_dds", block=block, dtype=dtype, trans="nt", arch=arch,
                      tile=tile or default_tile(block, arch, instr, rows), instr=instr, epilogue=epilogue)


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
    At 64-row blocks with `many_blocks` (ops.SDD_WIDE_BLOCKS_PER_SM): four consumers gathering
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


def sp24_spec(dtype: str, arch: int, tile: TileConfig | None = None, rows: int | None = None,
              instr: str | None = None, narrow: bool = False, epilogue: str = "none") -> KernelSpec:
    """The 2:4 forward. On sm_90 (tile sweeps on an H200: tools/bench24.py --tune and a
    one-off one for `narrow`): wgmma.sp fed by TMA, two consumer warpgroups of 64 W rows,
    256 tokens per block, blocks in pairs sharing X (1.2-1.6x dense at M >= 1024, where
    mma.sp reached 0.6x; the pairs gave 1-5% over single blocks at M = 16384), 64 tokens up
    to M = 128 (`narrow`: one consumer warpgroup; otherwise 128 tokens, for 65-128 tokens on
    weights of N/128 >= half the SMs: ops._narrow_tiles) and 32 up to 32 (the host splits K
    across blocks there). Elsewhere mma.sp: each warp owns 64 output features (warps_m of them) and tile_m / warps_n
    tokens; 128 x 128 on sm_80, 128 x 64 with 99 KB of shared memory, 64 and 32 tokens for
    small batches. One-byte types take the same tiles (k64 products: wgmma.sp on sm_90)."""
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
    return KernelSpec(op="sp24_dds", block=SP24_BLOCK, dtype=dtype, trans="nt", arch=arch, tile=tile,
                      instr=instr, epilogue=epilogue)


# Kernels without tensor cores (pruning, scattering): of the tile only its 256 threads count.
THREADS_256 = TileConfig(64, 4, 2, 2)


def sp24_compress_spec(dtype: str, arch: int, op: str = "sp24_compress") -> KernelSpec:
    """256 threads a block, one metadata word (or, for op sp24_mask, one 4 x 4 tile) each."""
    return KernelSpec(op=op, block=SP24_BLOCK, dtype=dtype, trans="nt", arch=arch, tile=THREADS_256, instr="mma")


def scatter_spec(block, dtype: str, arch: int) -> KernelSpec:
    """The dense weight of a block-sparse one: 256 threads a block, 16 bytes each."""
    return KernelSpec(op="bsr_scatter", block=tuple(block), dtype=dtype, trans="nt", arch=arch, tile=THREADS_256,
                      instr="mma")


def has_call_variants(spec: KernelSpec) -> bool:
    """The swap family at 64-row blocks: the kernels whose pairs and cluster variants
    ops._swap_variant picks per call (and precompile builds)."""
    return spec.instr in SWAP_INSTRS and spec.block[0] == 64


def _clustered(spec: KernelSpec) -> KernelSpec:
    return dataclasses.replace(spec, tile=dataclasses.replace(spec.tile, cluster=2))


def supported_dtypes(arch: int) -> tuple[str, ...]:
    """The dtypes with kernels on `arch` (e4m3 needs sm_89's fp8 tensor cores)."""
    return tuple(d for d in DTYPES if arch >= MIN_ARCH.get(d, 80))


def default_specs(arch: int, dtypes=None, blocks=None) -> list[KernelSpec]:
    """The set `sparsegen precompile` builds: every square block plus common rectangles, and
    the 2:4 kernels (the only ones for one-byte dtypes)."""
    dtypes = dtypes or supported_dtypes(arch)
    wide = [d for d in dtypes if d in BLOCK_DTYPES]
    blocks = blocks or [(b, b) for b in BLOCK_SIDES] + [(32, 64), (64, 32)]
    forward = [forward_spec(b, d, arch, rows=rows) for d in wide for b in blocks for rows in (None, 1)]
    # the swap family's variants picked per call (ops._swap_variant): pairs of block rows,
    # clusters of two blocks sharing W's copies
    forward += [dataclasses.replace(s, instr="pairs") for s in forward if has_call_variants(s) and s.instr == "swap"]
    forward += [_clustered(s) for s in forward if has_call_variants(s)]
    # The backward: dX is the forward op on W^T (blocks transposed), dW the sdd op.
    backward = [forward_spec(b[::-1], d, arch) for d in wide for b in blocks if b[0] != b[1]]
    backward += [sdd_spec(b, d, arch, many_blocks=many) for d in wide if d != "fp32" for b in blocks
                 for many in (False, True)]
    backward += [s for d in wide for b in blocks if (s := input_grad_spec(b[::-1], d, arch))]
    backward += [_clustered(s) for s in backward if has_call_variants(s)]
    # the forward's dense path (ops._dense_forward_weight: crossover table, high density), any block
    forward += [scatter_spec(b, d, arch) for d in wide for b in blocks]
    semi = [sp24_spec(d, arch, rows=rows, narrow=narrow) for d in dtypes if d != "fp32"
            for rows, narrow in ((None, False), (128, False), (128, True), (1, False))]
    # the epilogues sparsegen.patch fuses into BERT, GPT-2 and Llama blocks, on 16-bit products
    fused = [dataclasses.replace(s, epilogue=e) for s in forward + semi if s.op in EPILOGUE_OPS
             and s.dtype in ("bf16", "fp16") for e in PATCHED_EPILOGUES]
    semi += [sp24_compress_spec(d, arch, op) for d in dtypes if d != "fp32" for op in ("sp24_compress", "sp24_mask")]
    semi += [sp24_compress_spec(d, arch, "sp24_expand") for d in dtypes if d in ("bf16", "fp16")]
    return list(dict.fromkeys(forward + backward + semi + fused))
