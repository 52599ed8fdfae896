"""The layout kit, kernel side: what every fixed-rows layout's forward op says of its kernels.

A fixed-rows layout stores W [N, K] as N / bm block rows that each keep the same number of
[bm, bk] blocks, `rowblocks` (a row's start is a multiply), as values [N / bm, rowblocks, bm,
bk]. Its parameters reach the kernel at launch unless the layout compiles one in. What tells one such layout from
another is which block column a row's blk-th block sits in: read from an index (block-ELL)
or computed (block-diagonal). Its forward op renders the common gathered-K kernels
(templates/common/sg_gathered_dds*.cuh) through the macro in templates/common/sg_fixed_rows.j2;
this module checks those specs, sizes their shared memory, picks their default tiles and
builds the op's registry entry. The launch side is gathered.py.
"""
from __future__ import annotations

from .registry import OpRules, Param, ProductArgs, op_rules
from ..errors import SpecError, expect
from .spec import (SMEM_LIMIT, STAGE_BYTES_PER_ROW, KernelSpec, TileConfig, check_acc_on_mma, check_choice, check_trans,
                   stages_that_fit, tma_ring_bytes)

DTYPES = ("bf16", "fp16", "fp32")
INSTRS = ("mma", "tma", "pingpong")  # mma.sync anywhere; wgmma fed by TMA on sm_90a (16-bit)
ROWBLOCKS = Param("rowblocks", 4, doc="stored blocks in every block row")
MAX_PARAM = 4096  # a kernel per value: a bound on what a name may ask to compile
SMALL_ROWS = 64  # M up to this takes the 64-row tile (no work on padding rows)


def product_rules(op: str, template: str, params: tuple[Param, ...] = (), index: str | None = None,
                  check=None, compile_time: tuple[str, ...] = ()) -> OpRules:
    """The registry entry of a fixed-rows forward op: `rowblocks` then the layout's own
    `params`; its custom op takes (x, values, bias[, index], *params, out_features, epilogue).
    Each parameter reaches the kernel at launch (OpRules.run_params: one kernel for every layer
    shape) unless named in `compile_time` (then it is compiled in, a kernel per value: a
    constant where that pays). `check(spec)`, the layout's own rule on its specs (raising
    SpecError: "Expected X. Got Y."), runs after the kit's."""
    tensors = ("x", "values", "bias") + ((index,) if index else ())
    declared = (ROWBLOCKS, *params)
    unknown = set(compile_time) - {p.name for p in declared}
    expect(not unknown, f"compile_time among the parameters {tuple(p.name for p in declared)}", sorted(unknown),
           SpecError)
    return OpRules(op, template, validate if check is None else _then(check), smem_bytes, epilogues=True,
                   params=tuple(p for p in declared if p.name in compile_time),
                   run_params=tuple(p for p in declared if p.name not in compile_time), accs=("f32", "f16"),
                   args=ProductArgs(tensors, tuple(p.name for p in declared)), known_spills=known_spills)


def _then(check):
    def validate_then_check(spec: KernelSpec) -> None:
        validate(spec)
        check(spec)
    return validate_then_check


def known_spills(spec: KernelSpec) -> tuple[int, str]:
    """(spill instructions, stack bytes as a pattern) the SASS test allows. One known case, found
    by it: the ping-pong kernels at 256-row tiles and 16 or more blocks a row, or a row count
    taken at run time (block-ELL's since it shipped, block-diagonal's) keep one row address on
    the stack around the epilogue's store (one STL and one LDL a tile, outside the main loop)."""
    if spec.instr == "pingpong" and spec.tile.tile_m == 256 and spec.param_values.get("rowblocks", 16) >= 16:
        return 2, "(?:0|8)"
    return 0, "0"


def smem_bytes(spec: KernelSpec) -> int:
    rows = spec.tile.tile_m + spec.block[0]
    return spec.tile.stages * rows * STAGE_BYTES_PER_ROW if spec.instr == "mma" else tma_ring_bytes(spec.tile.stages, rows)


def validate(spec: KernelSpec) -> None:
    check_trans(spec, "nt")
    check_choice("dtype", spec.dtype, DTYPES)
    check_choice("instr", spec.instr, INSTRS)
    check_choice("cluster", spec.tile.cluster, (1,))
    check_acc_on_mma(spec)
    for name, value in spec.params:
        expect(1 <= value <= MAX_PARAM, f"{name} in [1, {MAX_PARAM}]", value, SpecError)
    if spec.instr == "mma":
        _validate_mma_tile(spec)
    else:
        _validate_tma_tile(spec)


def _validate_mma_tile(spec: KernelSpec) -> None:
    """Warps split tile_m rows of X and the block's rows of W."""
    t, bm = spec.tile, spec.block[0]
    expect(t.tile_m % (16 * t.warps_m) == 0 and bm % (16 * t.warps_n) == 0,
           "tile_m a multiple of 16 x warps_m and block rows of 16 x warps_n", f"{t.tag}, block {spec.block}",
           SpecError)


def _validate_tma_tile(spec: KernelSpec) -> None:
    t = spec.tile
    consumers = t.warps_m // 4
    per_consumer = t.tile_m if spec.instr == "pingpong" else t.tile_m // max(consumers, 1)
    expect(spec.arch == 90 and spec.dtype != "fp32", f"sm_90 and a 16-bit dtype for {spec.instr}",
           f"sm_{spec.arch}, {spec.dtype}", SpecError)
    expect(t.warps_n == 1 and t.warps_m % 4 == 0 and per_consumer % 64 == 0 and t.stages >= 2,
           "warps_n 1, whole consumer warpgroups owning whole m64 tiles, at least 2 stages", t.tag, SpecError)


def forward_spec(op: str, block, dtype: str, arch: int, params: dict, rows: int | None = None,
                 epilogue: str = "none", tile: TileConfig | None = None, instr: str | None = None,
                 acc: str = "f32") -> KernelSpec:
    """The forward kernel; `rows` (M) up to SMALL_ROWS takes a 64-row tile, another
    accumulator than f32 the mma.sync kernel (unless told)."""
    block, small = tuple(block), rows is not None and rows <= SMALL_ROWS
    compiled_in = {p.name for p in op_rules(op).params}
    params = {name: value for name, value in params.items() if name in compiled_in}  # (the rest: at launch)
    instr = instr or ("mma" if arch != 90 or dtype == "fp32" or acc != "f32" else
                      "tma" if block[0] >= 128 and not small else "pingpong")
    return KernelSpec(op=op, block=block, dtype=dtype, trans="nt", arch=arch, instr=instr,
                      tile=tile or default_tile(block, arch, instr, small), epilogue=epilogue, params=params, acc=acc)


def default_tile(block, arch: int, instr: str, small: bool) -> TileConfig:
    """Block-CSR's measured tiles for the same kernels (bsr/specs.py)."""
    bm = block[0]
    if instr != "mma":
        if small:
            return TileConfig(64, 4, 1, 4)
        tile_m = 128 if bm >= 128 and instr == "pingpong" else 256
        return TileConfig(tile_m, 8, 1, stages_that_fit(tile_m + bm, arch, most=4 if instr == "tma" else 6))
    stages = 3 if bm >= 128 or SMEM_LIMIT[arch] <= 128 * 1024 else 4
    warps = (2, 2) if bm >= 64 else (4, 1)
    return TileConfig(64 if small else 128, *((4, 1) if small else warps), stages)
