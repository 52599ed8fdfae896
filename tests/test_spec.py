"""KernelSpec: every field reaches .name and .key; invalid combinations fail early."""
import dataclasses
import itertools
import re

import pytest

import sparsegen
from sparsegen.jit import spec as specmod
from sparsegen.jit.epilogues import EPILOGUES
from sparsegen.errors import SpecError
from sparsegen.jit.spec import KernelSpec, TileConfig

SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Valid for both instruction families, so that every field can change on its own.
BASE = KernelSpec(op="bsr_dds", block=(64, 64), dtype="bf16", trans="nt", arch=90,
                  tile=TileConfig(tile_m=128, warps_m=4, warps_n=1, stages=3), instr="mma")


def ids(spec):
    return spec.name


def with_tile(**changes) -> KernelSpec:
    return dataclasses.replace(BASE, tile=dataclasses.replace(BASE.tile, **changes))


# One valid alternative per field (several where cheap); each differs from BASE in one field.
VARIANTS = {
    "block=64x32": dataclasses.replace(BASE, block=(64, 32)),
    "block=32x64": dataclasses.replace(BASE, block=(32, 64)),
    "block=128x128": dataclasses.replace(BASE, block=(128, 128)),
    "dtype=fp16": dataclasses.replace(BASE, dtype="fp16"),
    "dtype=fp32": dataclasses.replace(BASE, dtype="fp32"),
    **{f"arch={a}": dataclasses.replace(BASE, arch=a) for a in specmod.ARCHS if a != BASE.arch},
    **{f"instr={i}": dataclasses.replace(BASE, instr=i) for i in specmod.INSTRS
       if i not in (BASE.instr, *specmod.SWAP_INSTRS)},
    # W as wgmma's A needs two consumers
    **{f"instr={i}": dataclasses.replace(BASE, instr=i, tile=TileConfig(256, 8, 1, 3)) for i in specmod.SWAP_INSTRS},
    "tile_m=64": with_tile(tile_m=64),
    "tile_m=256": with_tile(tile_m=256),
    "warps_m=1": with_tile(warps_m=1),
    "warps_m=8": with_tile(warps_m=8),
    "warps_n=2": with_tile(warps_n=2),
    "warps_n=4": with_tile(warps_n=4),
    "stages=2": with_tile(stages=2),
    "stages=4": with_tile(stages=4),
    **{f"epilogue={e}": dataclasses.replace(BASE, epilogue=e) for e in EPILOGUES if e != "none"},
}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_each_field_changes_name_and_key(variant):
    assert variant != BASE
    assert variant.name != BASE.name
    assert variant.key != BASE.key


def test_every_field_has_a_variant():
    # A field added to KernelSpec or TileConfig must get a variant above (or a rejection test).
    # cluster: below; params: tests/test_layout_params.py (no shipped op declares any yet)
    covered = {key.split("=")[0] for key in VARIANTS} | {"op", "trans", "cluster", "params", "acc"}
    fields = {f.name for f in dataclasses.fields(KernelSpec)} - {"tile"}
    fields |= {f.name for f in dataclasses.fields(TileConfig)}
    assert fields <= covered, f"no variant for {sorted(fields - covered)}"


def test_cluster_changes_sp24_name_and_key_and_round_trips():
    # Only sp24_dds on TMA takes a cluster, so it has no variant of BASE.
    single = sparsegen.semi24.specs.sp24_spec("bf16", 90, tile=TileConfig(256, 8, 1, 4), instr="tma")
    paired = sparsegen.semi24.specs.sp24_spec("bf16", 90, tile=TileConfig(256, 8, 1, 4, cluster=2), instr="tma")
    assert paired.name == single.name + "c2" and paired.key != single.key
    assert KernelSpec.from_name(paired.name) == paired and KernelSpec.from_name(single.name) == single


def test_sp24_scales_change_name_and_key_only_when_set():
    # scales is named only where set: 2:4 kernels built before it existed keep names and keys
    plain = sparsegen.semi24.specs.sp24_spec("int8", 90)
    assert "scales" not in plain.name and specmod.fields_tuple(plain) == dataclasses.astuple(plain)[:-2]
    for code in (1, 2):
        scaled = sparsegen.semi24.specs.sp24_spec("int8", 90, scales=code)
        assert scaled.name == plain.name + f"_xscales{code}" and scaled.key != plain.key
        assert KernelSpec.from_name(scaled.name) == scaled
    fused = sparsegen.semi24.specs.sp24_spec("int8", 80, scales=1, epilogue="swiglu")  # float Y: epilogues allowed
    assert fused.name.endswith("_eswiglu_xscales1") and KernelSpec.from_name(fused.name) == fused


@pytest.mark.parametrize("changes, message", [
    (dict(dtype="bf16", params={"scales": 1}), "a one-byte dtype .* for scales"),
    (dict(dtype="e4m3", params={"scales": 3}), "scales one of"),
    (dict(dtype="int8", epilogue="gelu"), "float outputs for an epilogue"),
])
def test_sp24_scales_need_one_byte_inputs(changes, message):
    with pytest.raises(SpecError, match=message):
        KernelSpec(op="sp24_dds", block=(16, 32), arch=90, instr="tma", tile=TileConfig(256, 8, 1, 4), **changes)


FP16 = dataclasses.replace(BASE, dtype="fp16")


def test_accumulator_changes_name_and_key_and_round_trips():
    # acc needs fp16 operands, so its variant is of an fp16 BASE
    f16 = dataclasses.replace(FP16, acc="f16")
    assert f16.name == FP16.name + "_af16" and f16.key != FP16.key
    assert KernelSpec.from_name(f16.name) == f16
    fused = dataclasses.replace(f16, epilogue="gelu_tanh")
    assert fused.name.endswith("_egelutanh_af16") and KernelSpec.from_name(fused.name) == fused


def test_default_accumulator_is_not_in_the_key():
    # kernels built before acc existed keep their cache keys: f32 is left out of the hash
    assert specmod.fields_tuple(FP16) == dataclasses.astuple(FP16)[:-2]  # neither params nor acc
    assert specmod.fields_tuple(dataclasses.replace(FP16, acc="f16"))[-1] == "f16"


@pytest.mark.parametrize("changes, message", [
    (dict(acc="f64"), "acc one of"),
    (dict(acc="f16", dtype="bf16"), "dtype one of \\('fp16',\\) for acc 'f16'"),
    (dict(acc="f16", instr="wgmma"), "instr 'mma' for acc 'f16'"),
    (dict(acc="f16", op="bsr_sdd", trans="tn"), "an op with f16 accumulators"),
])
def test_accumulator_combinations_without_a_kernel_are_refused(changes, message):
    with pytest.raises(SpecError, match=message):
        dataclasses.replace(FP16, **changes)


def test_names_and_keys_are_pairwise_distinct():
    specs = [BASE, *VARIANTS.values()]
    assert len({s.name for s in specs}) == len(specs)
    assert len({s.key for s in specs}) == len(specs)


@pytest.mark.parametrize("field, value", [("op", "bsr_sdd"), ("op", "dense"), ("op", ""),
                                          ("trans", "nn"), ("trans", "tn"), ("trans", "NT")])
def test_single_valued_fields_reject_other_values(field, value):
    # op and trans have one valid value each today: a second one must be refused, not renamed.
    with pytest.raises(sparsegen.SpecError, match="Expected"):
        dataclasses.replace(BASE, **{field: value})


def test_equal_specs_share_name_and_key():
    again = KernelSpec(op="bsr_dds", block=[64, 64], dtype="bf16", trans="nt", arch=90,
                       tile=TileConfig(128, 4, 1, 3), instr="mma")
    assert again == BASE and hash(again) == hash(BASE)
    assert again.block == (64, 64)
    assert (again.name, again.key) == (BASE.name, BASE.key)


def every_default_spec():
    return [s for arch in specmod.ARCHS for s in specmod.default_specs(arch)]


def test_names_are_symbol_safe():
    for s in [BASE, *VARIANTS.values(), *every_default_spec()]:
        assert SYMBOL.fullmatch(s.name), s.name


@pytest.mark.parametrize("s", [VARIANTS["block=32x64"], VARIANTS["instr=wgmma"],
                               VARIANTS["instr=tma"]], ids=ids)
def test_name_spells_out_every_field(s):
    t = s.tile
    for part in (s.op, f"{s.block[0]}x{s.block[1]}", s.dtype, s.trans, f"sm{s.arch}", s.instr,
                 f"t{t.tile_m}", f"w{t.warps_m}x{t.warps_n}", f"s{t.stages}"):
        assert part in s.name


@pytest.mark.parametrize("instr", ["wgmma", "tma", "pingpong"])
def test_hopper_instructions_target_the_arch_specific_sm90a(instr):
    s = VARIANTS[f"instr={instr}"]
    assert s.target == "sm_90a" and BASE.target == "sm_90"
    assert "_sm90a_" in s.name and "_sm90_" in BASE.name


def test_tma_adds_a_producer_warpgroup():
    assert VARIANTS["instr=tma"].threads == BASE.tile.threads + 128
    assert VARIANTS["instr=wgmma"].threads == BASE.threads == BASE.tile.threads


def test_name_round_trips_through_from_name():
    for s in [BASE, *VARIANTS.values(), *every_default_spec()]:
        assert KernelSpec.from_name(s.name) == s


def test_tile_tag_round_trips_and_a_bad_tag_is_a_spec_error():
    for s in every_default_spec():
        assert TileConfig.from_tag(s.tile.tag) == s.tile
    for bad in ("t64w8x1", "64w8x1s4", "t64w8x1s4c", "t64w8x1s4 "):
        with pytest.raises(SpecError, match="tile tag"):
            TileConfig.from_tag(bad)


BAD = {
    "dtype": dict(dtype="fp64"),
    "block side 48": dict(block=(48, 32)),
    "block of 3 sides": dict(block=(32, 32, 32)),
    "arch 70": dict(arch=70),
    "too much shared memory": dict(block=(128, 128), tile=TileConfig(256, 2, 2, 8)),
    "warps_n not dividing block": dict(block=(16, 16), tile=TileConfig(128, 4, 2, 3)),
    "tile_m not dividing warps": dict(tile=TileConfig(96, 4, 1, 3)),
    "one stage": dict(tile=TileConfig(128, 2, 2, 1)),
    "too many threads": dict(block=(128, 128), tile=TileConfig(128, 8, 8, 2)),
    "instr": dict(instr="tcgen05"),
    "wgmma on sm_80": dict(instr="wgmma", arch=80),
    "wgmma in fp32": dict(instr="wgmma", dtype="fp32"),
    "wgmma with warps_n 2": dict(instr="wgmma", tile=TileConfig(128, 4, 2, 3)),
    "wgmma with part of a warpgroup": dict(instr="wgmma", tile=TileConfig(128, 2, 1, 3)),
    "wgmma with 2 stages": dict(instr="wgmma", tile=TileConfig(128, 4, 1, 2)),
    "tma on sm_89": dict(instr="tma", arch=89),
    "tma in fp32": dict(instr="tma", dtype="fp32"),
    "tma with warps_n 2": dict(instr="tma", tile=TileConfig(128, 4, 2, 3)),
    "tma over 1024 threads": dict(instr="tma", tile=TileConfig(512, 32, 1, 2)),
    "swap with one consumer": dict(instr="swap", tile=TileConfig(128, 4, 1, 3)),
    "swap with 32-row blocks": dict(instr="swap", block=(32, 64), tile=TileConfig(256, 8, 1, 3)),
    "swap past wgmma's n256": dict(instr="swap", block=(128, 64), tile=TileConfig(512, 8, 1, 2)),
    "pairs of 128-row blocks": dict(instr="pairs", block=(128, 64), tile=TileConfig(256, 8, 1, 3)),
    "pairs past wgmma's n256": dict(instr="pairs", tile=TileConfig(512, 8, 1, 2)),
    "swap with 96 tokens a consumer": dict(instr="swap", tile=TileConfig(192, 8, 1, 3)),
    "cluster on bsr_dds": dict(tile=TileConfig(128, 4, 1, 3, cluster=2)),
    "cluster of 3": dict(op="sp24_dds", block=(16, 32), instr="tma", tile=TileConfig(96, 8, 1, 4, cluster=3)),
    "cluster splitting X below 8 rows": dict(op="sp24_dds", block=(16, 32), instr="tma",
                                             tile=TileConfig(16, 8, 1, 4, cluster=4)),
}


@pytest.mark.parametrize("changes", BAD.values(), ids=BAD.keys())
def test_invalid_specs_raise_spec_error(changes):
    with pytest.raises(sparsegen.SpecError, match=r"Expected .*\. Got ") as info:
        dataclasses.replace(BASE, **changes)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, sparsegen.SparsegenError)


def test_shared_memory_limit_depends_on_arch():
    tile = TileConfig(128, 2, 2, 4)
    needed = tile.stages * (tile.tile_m + 128) * specmod.STAGE_BYTES_PER_ROW
    for arch, limit in specmod.SMEM_LIMIT.items():
        if needed <= limit:
            assert KernelSpec(block=(128, 128), arch=arch, tile=tile).smem_bytes() == needed
        else:
            with pytest.raises(sparsegen.SpecError, match=f"sm_{arch}"):
                KernelSpec(block=(128, 128), arch=arch, tile=tile)


def test_default_tile_is_valid_for_every_block_arch_and_m():
    sides = specmod.BLOCK_SIDES
    for arch, block, dtype, rows in itertools.product(
            specmod.ARCHS, itertools.product(sides, sides), sparsegen.bsr.specs.BLOCK_DTYPES, (None, 1, 64, 1000)):
        s = sparsegen.bsr.specs.forward_spec(block, dtype, arch, rows=rows)  # validates, or raises SpecError
        assert s.smem_bytes() <= specmod.SMEM_LIMIT[arch]


def test_one_byte_dtypes_take_only_the_24_forward_on_archs_that_have_them():
    for arch, dtype, rows in itertools.product(specmod.ARCHS, specmod.BYTE_DTYPES, (None, 128, 1)):
        if dtype not in specmod.supported_dtypes(arch):
            with pytest.raises(SpecError, match=rf"Expected .*{dtype}.*Got sm_{arch}"):
                sparsegen.semi24.specs.sp24_spec(dtype, arch, rows=rows)
            continue
        s = sparsegen.semi24.specs.sp24_spec(dtype, arch, rows=rows)
        assert s.instr == ("tma" if arch == 90 else "mma")
        assert s.smem_bytes() <= specmod.SMEM_LIMIT[arch]
    for make in (lambda: sparsegen.bsr.specs.forward_spec((32, 32), "int8", 90),
                 lambda: sparsegen.semi24.specs.sp24_compress_spec("fp32", 90),
                 lambda: sparsegen.semi24.specs.sp24_spec("e4m3", 90, instr="mma")):
        with pytest.raises(SpecError, match="Expected"):
            make()


def test_default_specs_cover_every_dtype_once_per_block():
    specs = specmod.default_specs(90)
    assert len({s.name for s in specs}) == len(specs)
    assert {s.dtype for s in specs} == set(specmod.supported_dtypes(90)) == set(specmod.DTYPES)
    assert all(s.arch == 90 for s in specs)
    assert {s.op for s in specs} == set(sparsegen.jit.registry.ops())
    assert {s.dtype for s in specs if s.op == "bsr_sdd"} == {"bf16", "fp16"}  # fp32 dW: dense GEMM


def test_input_grad_spec_refuses_a_family_that_cannot_read_w_transposed():
    with pytest.raises(SpecError, match="'swap' or 'pairs'"):
        sparsegen.bsr.specs.input_grad_spec((64, 64), "bf16", 90, instr="mma")
    assert sparsegen.bsr.specs.input_grad_spec((64, 64), "bf16", 90).instr == "pairs"
    assert sparsegen.bsr.specs.input_grad_spec((128, 64), "bf16", 90).instr == "swap"
    assert sparsegen.bsr.specs.input_grad_spec((64, 64), "bf16", 80) is None  # elsewhere: a transposed copy
