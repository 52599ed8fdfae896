"""KernelSpec: the one frozen value that names a generated kernel.

Every field that changes the generated code is a field here, so the name and the
cache key change whenever the code does (a test checks each field in turn). The fields
every kernel has are checked here; what an op allows beyond them (block shapes, tiles,
instructions) its layout's rules check (registry.OpRules), and so does its shared memory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field

from . import epilogues, registry
from ..errors import SpecError, expect
from .names import ARCHS, BLOCK_SIDES, BYTE_DTYPES, DTYPES, MIN_ARCH, SMEM_LIMIT  # noqa: F401 (this module's vocabulary)

TRANSPOSES = ("nt", "tn", "nn")  # operand layouts of Y = X W^T (nn: W's stored blocks read as W^T)
# Tensor-core path: "mma" (mma.sync, sm_80 and later); on sm_90a, "wgmma" (Hopper warpgroup
# MMA fed by cp.async), "tma" (wgmma fed by TMA from a producer warpgroup, consumers split
# each tile) and "pingpong" (the same, consumers alternate whole tiles); "swap" (W as
# wgmma's A operand) and "pairs" (swap over pairs of 64-row block rows that share X's copies).
INSTRS = ("mma", "wgmma", "tma", "pingpong", "swap", "pairs")
HOPPER_INSTRS = ("wgmma", "tma", "pingpong", "swap", "pairs")
TMA_INSTRS = ("tma", "pingpong", "swap", "pairs")
SWAP_INSTRS = ("swap", "pairs")  # W as wgmma's A
STAGE_BYTES_PER_ROW = 128  # one pipeline stage holds 128 bytes of K per row: 64 halves / 32 floats
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "int8": 1, "e4m3": 1}
# The inverse of KernelSpec.name; op may itself contain underscores (bsr_dds). The arch's
# "a" suffix follows from instr, so from_name checks it by rebuilding the name.
_TAG_PATTERN = r"t(?P<tile_m>\d+)w(?P<warps_m>\d+)x(?P<warps_n>\d+)s(?P<stages>\d+)(?:c(?P<cluster>\d+))?"
_NAME_RE = re.compile(r"(?P<op>[a-z][a-z0-9_]*?)_b(?P<bm>\d+)x(?P<bk>\d+)_(?P<dtype>[a-z0-9]+)"
                      r"_(?P<trans>[a-z]+)_sm(?P<arch>\d+)a?_(?P<instr>[a-z]+)_" + _TAG_PATTERN +
                      r"(?:_e(?P<epilogue>[a-z]+))?(?:_a(?P<acc>f\d+))?(?P<params>(?:_x[a-z]+\d+)*)")
_PARAM_RE = re.compile(r"_x([a-z]+)(\d+)")
_NAME_FORM = ("OP_bROWSxCOLS_DTYPE_TRANS_smARCH[a]_INSTR_tTILEMwWARPSMxWARPSNsSTAGES[cCLUSTER][_eEPILOGUE]"
              "[_aACC][_xPARAMVALUE...]")
CLUSTER_SIZES = (1, 2, 4)
# Accumulator types: "f32" everywhere; "f16" (mma's f16 accumulator) for fp16 operands, in
# the kernels whose op lists it (registry.OpRules.accs). Named only where not the default.
ACCS = ("f32", "f16")
ACC_DTYPES = {"f32": DTYPES, "f16": ("fp16",)}


@dataclass(frozen=True)
class TileConfig:
    """How one threadblock splits its output tile: rows of X, warp grid, pipeline depth, and
    how many blocks of a cluster share their X tile (sp24_dds on TMA only)."""

    tile_m: int = 128
    warps_m: int = 2
    warps_n: int = 2
    stages: int = 3
    cluster: int = 1

    def __post_init__(self):
        """Every field a whole number of at least 1 (a 0 from a name like t64w0x1s4 would divide
        by zero in the rules that size a launch)."""
        fields = (self.tile_m, self.warps_m, self.warps_n, self.stages, self.cluster)
        expect(all(type(v) is int and v >= 1 for v in fields),
               "a tile of whole numbers >= 1 (tile_m, warps_m, warps_n, stages, cluster)", repr(fields), SpecError)

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


# Kernels without tensor cores (pruning, scattering): of the tile only its 256 threads count.
THREADS_256 = TileConfig(64, 4, 2, 2)


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
    # The op's own parameters (registry.Param), as ((name, value), ...) in the order the op
    # declares them, defaults filled in; a dict is accepted.
    params: tuple[tuple[str, int], ...] = ()
    acc: str = "f32"  # ACCS: what the tensor cores accumulate in

    def __post_init__(self):
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        object.__setattr__(self, "params", _with_defaults(self.op, self.params))
        self.validate()

    @property
    def name(self) -> str:
        """Readable, symbol-safe: bsr_dds_b32x32_bf16_nt_sm90a_wgmma_t128w8x1s4 (+ _esilu etc.
        where there is an epilogue)."""
        bm, bk = self.block
        epilogue = "" if self.epilogue == "none" else f"_e{epilogues.name_token(self.epilogue)}"
        acc = "" if self.acc == "f32" else f"_a{self.acc}"
        params = "".join(f"_x{name}{value}" for name, value in self.named_params)
        return (f"{self.op}_b{bm}x{bk}_{self.dtype}_{self.trans}_{self.target.replace('_', '')}"
                f"_{self.instr}_{self.tile.tag}{epilogue}{acc}{params}")

    @property
    def target(self) -> str:
        """NVRTC's --gpu-architecture: wgmma only exists on the arch-specific sm_90a."""
        return f"sm_{self.arch}a" if self.instr in HOPPER_INSTRS else f"sm_{self.arch}"

    @property
    def threads(self) -> int:
        """Threads per block: the tile's warps (times the op's k-warps), plus the producer
        warpgroup for tma."""
        return self.tile.threads * self.rules.k_warps(self) + (128 if self.instr in TMA_INSTRS else 0)

    @property
    def rules(self) -> registry.OpRules:
        """What the op's layout says of it (validation, shared memory, template)."""
        return registry.op_rules(self.op)

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
        params = tuple((name, int(value)) for name, value in _PARAM_RE.findall(g["params"]))
        spec = cls(op=g["op"], block=(int(g["bm"]), int(g["bk"])), dtype=g["dtype"], trans=g["trans"],
                   arch=int(g["arch"]), tile=tile, instr=g["instr"], epilogue=epilogue, params=params,
                   acc=g["acc"] or "f32")
        expect(spec.name == name, f"the name {spec.name} for these fields", repr(name), SpecError)
        return spec

    @property
    def key(self) -> str:
        """Short hash of every field (the disk cache adds source and compiler version)."""
        return hashlib.sha256(repr(fields_tuple(self)).encode()).hexdigest()[:16]

    @property
    def param_values(self) -> dict[str, int]:
        return dict(self.params)

    @property
    def named_params(self) -> tuple[tuple[str, int], ...]:
        """The parameters the name and key carry: all but those declared unnamed at their default."""
        declared = {p.name: p for p in registry.op_rules(self.op).params} if self.op in registry.ops() else {}
        return tuple((name, value) for name, value in self.params
                     if name not in declared or declared[name].named_at_default or value != declared[name].default)

    @property
    def stage_k(self) -> int:
        """Elements of K one pipeline stage covers (128 bytes' worth)."""
        return STAGE_BYTES_PER_ROW // ELEMENT_BYTES[self.dtype]

    def smem_bytes(self) -> int:
        return self.rules.smem_bytes(self)

    def validate(self) -> None:
        rules = registry.op_rules(self.op)  # (an unknown op: "Expected op one of (...)")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("trans", self.trans, TRANSPOSES)
        check_choice("arch", self.arch, ARCHS)
        check_choice("instr", self.instr, INSTRS)
        check_choice("epilogue", self.epilogue, epilogues.EPILOGUES)
        if self.epilogue != "none":
            forward = tuple(r.op for layout in registry.layouts() for r in layout.ops if r.epilogues)
            expect(rules.epilogues and self.trans == "nt" and rules.float_output(self),
                   f"a forward op {forward} with trans 'nt' and float outputs for an epilogue",
                   f"{self.op}, trans {self.trans!r}, {self.dtype}", SpecError)
        expect(len(self.block) == 2 and all(b in BLOCK_SIDES for b in self.block),
               f"block sides each one of {BLOCK_SIDES}", self.block, SpecError)
        _validate_acc(self, rules)
        _validate_params(self, rules)
        rules.validate(self)
        _validate_tile(self)


def fields_tuple(spec: KernelSpec) -> tuple:
    """Every field's value; the op's parameters only where it names some and the accumulator
    only where it is not f32 (so kernels that have neither keep the keys they had before
    either field existed)."""
    *values, _, acc = dataclasses.astuple(spec)
    params = spec.named_params
    return tuple(values) + ((params,) if params else ()) + ((acc,) if acc != "f32" else ())


def _validate_acc(spec: KernelSpec, rules: registry.OpRules) -> None:
    check_choice("acc", spec.acc, ACCS)
    if spec.acc == "f32":
        return
    with_it = tuple(op for op in registry.ops() if spec.acc in registry.op_rules(op).accs)
    expect(spec.acc in rules.accs, f"an op with {spec.acc} accumulators {with_it} for acc {spec.acc!r}",
           repr(spec.op), SpecError)
    expect(spec.dtype in ACC_DTYPES[spec.acc], f"dtype one of {ACC_DTYPES[spec.acc]} for acc {spec.acc!r} (the "
           "tensor cores accumulate in f16 only from f16 operands)", repr(spec.dtype), SpecError)


def _with_defaults(op: str, given) -> tuple[tuple[str, int], ...]:
    """The op's parameters in declared order, defaults filled in; unknown names are kept
    (at the end) for validate to name. An unknown op keeps what was given (validate says so)."""
    given = dict(given.items() if isinstance(given, dict) else given)
    if op not in registry.ops():
        return tuple(given.items())
    declared = registry.op_rules(op).params
    filled = [(p.name, given.pop(p.name, p.default)) for p in declared]
    return tuple(filled) + tuple(given.items())


def _validate_params(spec: KernelSpec, rules: registry.OpRules) -> None:
    declared = {p.name: p for p in rules.params}
    for name, value in spec.params:
        expect(name in declared, f"parameters of {spec.op} among {tuple(declared)}", repr(name), SpecError)
        param = declared[name]
        expect(isinstance(value, int) and not isinstance(value, bool), f"an integer for parameter {name!r}",
               repr(value), SpecError)
        if param.choices is not None:
            check_choice(name, value, param.choices)


def check_choice(what: str, value, choices) -> None:
    expect(value in choices, f"{what} one of {choices}", repr(value), SpecError)


def check_trans(spec: KernelSpec, allowed: str, note: str = "") -> None:
    expect(spec.trans == allowed, f"trans {allowed!r} for {spec.op}{note}", repr(spec.trans), SpecError)


def check_acc_on_mma(spec: KernelSpec) -> None:
    """For ops whose mma.sync kernel alone implements the other accumulators (wgmma keeps f32)."""
    expect(spec.acc == "f32" or spec.instr == "mma", f"instr 'mma' for acc {spec.acc!r} (its mma.sync kernel; "
           "the wgmma kernels accumulate in f32)", repr(spec.instr), SpecError)


def _validate_tile(spec: KernelSpec) -> None:
    """What every kernel's tile must satisfy; its op's rules checked the rest first."""
    t = spec.tile
    check_choice("cluster", t.cluster, CLUSTER_SIZES)
    step = spec.rules.tile_m_step
    expect(t.tile_m % step == 0, f"tile_m a multiple of {step} for {spec.op}", t.tile_m, SpecError)
    expect(t.stages >= 2, "at least 2 pipeline stages", t.stages, SpecError)
    expect(spec.threads <= 1024, "at most 1024 threads per block", spec.threads, SpecError)
    limit = SMEM_LIMIT[spec.arch]
    expect(spec.smem_bytes() <= limit,
           f"shared memory within sm_{spec.arch}'s {limit} bytes; reduce tile_m or stages",
           f"{spec.smem_bytes()} bytes for {spec.tile.tag}", SpecError)


def tma_ring_bytes(stages: int, rows: int) -> int:
    """Shared memory of a TMA-fed ring (the common gathered-K kernels and their kin): `stages`
    of `rows` 128-byte rows, 1024 bytes to align the swizzle atoms, a full and an empty
    mbarrier per stage and the one that orders ping-pong mainloops."""
    return stages * rows * STAGE_BYTES_PER_ROW + 1024 + 16 * stages + 8


def stages_that_fit(rows: int, arch: int, most: int) -> int:
    """The deepest TMA ring (<= most) of stages of `rows` rows that fits sm_<arch>'s shared memory."""
    return max((s for s in range(2, most + 1) if tma_ring_bytes(s, rows) <= SMEM_LIMIT.get(arch, 0)), default=2)


def clustered(spec: KernelSpec) -> KernelSpec:
    return dataclasses.replace(spec, tile=dataclasses.replace(spec.tile, cluster=2))


def supported_dtypes(arch: int) -> tuple[str, ...]:
    """The dtypes with kernels on `arch` (e4m3 needs sm_89's fp8 tensor cores)."""
    return tuple(d for d in DTYPES if arch >= MIN_ARCH.get(d, 80))


def default_specs(arch: int, dtypes=None, blocks=None, layouts=None) -> list[KernelSpec]:
    """The set `sparsegen precompile` builds: every registered layout's (or those named in
    `layouts`), in registry order (block-sparse: every square block plus common rectangles,
    or `blocks`)."""
    dtypes = tuple(dtypes or supported_dtypes(arch))
    known = [layout.name for layout in registry.layouts()]
    for name in layouts or ():
        expect(name in known, f"a layout in {known}", repr(name), SpecError)
    specs = [s for layout in registry.layouts() if not layouts or layout.name in layouts
             for s in layout.default_specs(arch, dtypes, blocks)]
    return list(dict.fromkeys(specs))
