"""Rendering KernelSpecs to CUDA source: contents, golden files, StrictUndefined.

Regenerate the golden files after an intended template change with:
    SPARSEGEN_UPDATE_GOLDEN=1 python -m pytest tests/test_codegen.py
"""
import os
import re
import shutil
from pathlib import Path

import jinja2
import jinja2.meta
import pytest

import sparsegen
from sparsegen.jit import codegen, epilogues
from sparsegen.jit import registry, spec as specmod
from sparsegen.jit.spec import INSTRS, KernelSpec, TileConfig
from sparsegen.bsr.specs import forward_spec, input_grad_spec

GOLDEN_DIR = Path(__file__).parent / "golden"
# Pinned tiles (not the tuned defaults), so that only a template change moves a golden file.
GOLDEN_SPECS = [
    KernelSpec(block=(128, 64), dtype="fp32", arch=80, tile=TileConfig(128, 2, 2, 3), instr="mma"),
    KernelSpec(block=(16, 16), dtype="fp16", arch=90, tile=TileConfig(128, 8, 1, 4), instr="wgmma"),
    KernelSpec(block=(64, 32), dtype="bf16", arch=90, tile=TileConfig(256, 8, 1, 4), instr="tma"),
    KernelSpec(block=(128, 64), dtype="fp16", arch=90, tile=TileConfig(256, 8, 1, 4), instr="swap"),
    KernelSpec(block=(64, 64), dtype="bf16", arch=90, tile=TileConfig(256, 8, 1, 4), instr="pairs", epilogue="swiglu"),
]
# The other ops' templates, pinned the same way.
OTHER_GOLDEN = [
    KernelSpec(op="bsr_sdd", block=(64, 64), dtype="bf16", trans="tn", arch=80, tile=TileConfig(32, 2, 2, 4)),
    KernelSpec(op="bsr_sdd", block=(128, 64), dtype="fp16", trans="tn", arch=90, tile=TileConfig(64, 8, 1, 4),
               instr="tma"),
    KernelSpec(op="sp24_dds", block=(16, 32), dtype="fp16", trans="nt", arch=90, tile=TileConfig(128, 4, 2, 3)),
    KernelSpec(op="sp24_dds", block=(16, 32), dtype="bf16", trans="nt", arch=90,
               tile=TileConfig(256, 8, 1, 4, cluster=2), instr="tma"),
    KernelSpec(op="sp24_dds", block=(16, 32), dtype="bf16", trans="nt", arch=90, tile=TileConfig(64, 8, 1, 6),
               instr="tma", epilogue="swiglu"),
    KernelSpec(op="sp24_dds", block=(16, 32), dtype="fp16", trans="nt", arch=80, tile=TileConfig(64, 2, 2, 3),
               epilogue="gelu"),
    KernelSpec(op="sp24_dds", block=(16, 32), dtype="int8", trans="nt", arch=90,
               tile=TileConfig(256, 8, 1, 4, cluster=2), instr="tma", epilogue="swiglu", params={"scales": 1}),
    KernelSpec(op="sp24_dds", block=(16, 32), dtype="e4m3", trans="nt", arch=89, tile=TileConfig(64, 2, 2, 2),
               params={"scales": 2}),
    KernelSpec(op="sp24_dds", block=(16, 32), dtype="e4m3", trans="nt", arch=90, tile=TileConfig(32, 8, 1, 6),
               instr="tma", epilogue="swiglu", params={"scales": 1, "quantize": 1}),
    KernelSpec(op="sp24_compress", block=(16, 32), dtype="bf16", trans="nt", arch=80, tile=TileConfig(64, 4, 2, 2)),
    KernelSpec(op="sp24_mask", block=(16, 32), dtype="fp16", trans="nt", arch=90, tile=TileConfig(64, 4, 2, 2)),
    KernelSpec(op="sp24_expand", block=(16, 32), dtype="bf16", trans="nt", arch=90, tile=TileConfig(64, 4, 2, 2)),
    KernelSpec(op="bsr_scatter", block=(16, 32), dtype="bf16", trans="nt", arch=80, tile=TileConfig(64, 4, 2, 2)),
    KernelSpec(op="bell_dds", block=(32, 64), dtype="fp16", arch=80, tile=TileConfig(128, 4, 1, 4)),
    KernelSpec(op="bell_dds", block=(64, 64), dtype="bf16", arch=90, tile=TileConfig(256, 8, 1, 4), instr="pingpong",
               epilogue="gelu"),
]


# sparsegen's own ops: their golden files are here. A plugin's ops are rendered and compiled by
# its own tests (docs/adding-a-layout.md's by tests/test_tutorial.py), not compared with files
# sparsegen cannot hold for it.
SHIPPED_OPS = {rules.op for layout in registry.layouts() if layout.package is None for rules in layout.ops}


def registry_golden() -> list:
    """Each shipped op without a pinned spec above gets its layout's first default kernel on
    sm_80 and on sm_90: a new layout's templates are golden-tested with no edit here."""
    pinned, found = {s.op for s in GOLDEN_SPECS + OTHER_GOLDEN}, {}
    for spec in specmod.default_specs(80) + specmod.default_specs(90):
        if spec.op not in pinned and spec.op in SHIPPED_OPS:
            found.setdefault((spec.op, spec.arch), spec)
    return list(found.values())


OTHER_GOLDEN += registry_golden()
SPECS = GOLDEN_SPECS + [
    forward_spec((16, 128), "bf16", 86),
    forward_spec((64, 64), "fp16", 90, instr="wgmma"),
    forward_spec((64, 64), "fp16", 90, instr="mma"),
    forward_spec((128, 32), "bf16", 90, instr="tma", rows=1),
    forward_spec((64, 64), "bf16", 90, instr="pingpong"),
    input_grad_spec((128, 64), "fp16", 90),  # swap, trans nn
    input_grad_spec((64, 64), "bf16", 90),  # pairs, trans nn
    forward_spec((64, 128), "fp16", 90, instr="pairs"),
    forward_spec((64, 64), "bf16", 90, TileConfig(256, 8, 1, 4, cluster=2), "swap"),
    KernelSpec(block=(64, 16), dtype="fp16", arch=89, tile=TileConfig(64, 2, 2, 2)),
    KernelSpec(block=(128, 32), dtype="fp32", arch=80, tile=TileConfig(256, 4, 4, 3)),
    forward_spec((64, 64), "bf16", 90, instr="swap", epilogue="swiglu"),
    forward_spec((32, 32), "fp16", 80, epilogue="gelu_tanh"),
    forward_spec((128, 128), "bf16", 90, instr="tma", epilogue="geglu"),
]
MMA = {"bf16": "Bf16", "fp16": "Fp16", "fp32": "Tf32"}
ELEM = {"bf16": "unsigned short", "fp16": "unsigned short", "fp32": "float"}


def ids(spec):
    return spec.name


# Per instruction family: the head of the kernel type the template instantiates.
KERNEL_TYPE = {"mma": r"sg::GatheredDds<\s*", "wgmma": r"sg::BsrDdsWgmma<\s*Wgmma,\s*",
               "tma": r"sg::GatheredDdsTma<\s*Wgmma,\s*", "pingpong": r"sg::GatheredDdsTma<\s*Wgmma,\s*",
               "swap": r"sg::BsrDdsSwap<\s*Wgmma,\s*", "pairs": r"sg::BsrDdsSwap<\s*Wgmma,\s*"}


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_source_names_the_kernel_and_its_mma(spec):
    source = codegen.render(spec)
    cluster = rf"__cluster_dims__\({spec.tile.cluster}, 1, 1\) " if spec.tile.cluster > 1 else ""
    assert re.search(rf'extern "C" __global__ void {cluster}__launch_bounds__\({spec.threads}(, *\d+)?\)\s*'
                     rf'{spec.name}\(', source)
    assert f"sg::{MMA[spec.dtype]}," in source
    assert [m for m in MMA.values() if f"sg::{m}" in source] == [MMA[spec.dtype]]


def kernel_type_pattern(spec) -> str:
    """The template instantiation the source must contain, constants in template order."""
    t = spec.tile
    constants = [f"sg::{MMA[spec.dtype]}", ELEM[spec.dtype], t.tile_m, *spec.block]
    if spec.instr == "mma":
        constants += [t.warps_m, t.warps_n, t.stages]
    elif spec.instr in ("swap", "pairs"):  # always two consumers; trans nn reads W's stored blocks as W^T's
        constants += [t.stages, str(spec.trans == "nn").lower(), str(spec.instr == "pairs").lower(), t.cluster]
    else:  # wgmma and the TMA kernels: whole warpgroups of consumers
        constants += [t.warps_m // 4, t.stages]
    if spec.instr in ("tma", "pingpong"):  # the schedule: consumers alternate whole tiles?
        constants += [str(spec.instr == "pingpong").lower()]
    if spec.instr in ("mma", "tma", "pingpong"):  # the common gathered-K kernels: the row policy
        constants += ["sg::CsrRows"]
    constants += [re.escape(epilogues.device_struct(spec.epilogue))]
    return KERNEL_TYPE[spec.instr] + r",\s*".join(map(str, constants)) + r"\s*>"


def test_every_instruction_family_is_covered():
    assert set(KERNEL_TYPE) == set(INSTRS) == {s.instr for s in SPECS}


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_source_carries_the_template_constants(spec):
    source = codegen.render(spec)
    assert re.search(kernel_type_pattern(spec), source), source
    elem = ELEM[spec.dtype]
    assert f"const {elem}* __restrict__ bias, {elem}* __restrict__ y" in source


@pytest.mark.parametrize("spec", [s for s in SPECS if s.instr != "mma"], ids=ids)
def test_wgmma_source_issues_the_right_instruction(spec):
    ptx = {"bf16": "bf16", "fp16": "f16"}[spec.dtype]
    # W as A: tokens are N (pairs: each consumer's one block row takes all the tile's tokens)
    n = {"swap": spec.tile.tile_m * spec.block[0] // 128, "pairs": spec.tile.tile_m}.get(spec.instr, spec.block[0])
    instruction = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx}"
    assert instruction in codegen.render(spec)


def test_golden_files_cover_every_op():
    assert {s.op for s in GOLDEN_SPECS + OTHER_GOLDEN} == SHIPPED_OPS and SHIPPED_OPS <= set(registry.ops())


@pytest.mark.parametrize("spec", OTHER_GOLDEN, ids=ids)
def test_other_ops_name_their_kernel(spec):
    source = codegen.render(spec)
    cluster = rf"__cluster_dims__\({spec.tile.cluster}, 1, 1\) " if spec.tile.cluster > 1 else ""
    assert re.search(rf'extern "C" __global__ void {cluster}__launch_bounds__\({spec.threads}(, 1)?\)\s*{spec.name}\(',
                     source)
    if spec.op == "sp24_dds":
        check_sp24_product(spec, source)


def check_sp24_product(spec, source: str) -> None:
    """The 2:4 forward's instruction, its input, accumulator and output types, and whether it
    scales (one-byte inputs: k64 products; scaled ones write the scales' 16-bit type)."""
    ptx = {"bf16": "bf16", "fp16": "f16", "int8": "s8", "e4m3": "e4m3"}[spec.dtype]
    one_byte, scales = spec.dtype in specmod.BYTE_DTYPES, spec.param_values.get("scales", 0)
    k, acc = 64 if one_byte else 32, "s32" if spec.dtype == "int8" else "f32"
    out = sparsegen.semi24.specs.SCALED_OUTPUTS.get(scales, "bf16" if one_byte else spec.dtype)
    tail = rf"{re.escape(epilogues.device_struct(spec.epilogue))}, {'true' if scales else 'false'}"
    if sparsegen.semi24.specs.quantizes_x(spec):  # X in the output's 16-bit type, quantized to the weight's
        tail += rf", sg::QuantizeX<sg::{MMA[out]}, {'true' if spec.dtype == 'int8' else 'false'}>"
        assert re.search(r"const unsigned short\* __restrict__ x16, const float\* __restrict__ x_scale", source)
    tail += ">"
    if spec.instr == "tma":
        assert f"wgmma.mma_async.sp.sync.aligned.m64n{spec.tile.tile_m}k{k}.{acc}.{ptx}.{ptx} " in source
        assert re.search(rf"sg::Sp24DdsTma<WgmmaSp, sg::{MMA[out]}, unsigned short, {spec.tile.tile_m}, "
                         rf"{spec.tile.warps_m // 4}, {spec.tile.stages}, {spec.tile.cluster}, {1 if one_byte else 2}, "
                         + tail, source)
    else:
        elem = {"int8": "signed char", "e4m3": "unsigned char"}.get(spec.dtype, "unsigned short")
        assert f"mma.sp::ordered_metadata.sync.aligned.m16n8k{k}.row.col.{acc}.{ptx}.{ptx}.{acc}" in source
        assert re.search(rf"sg::Sp24Dds<SpMma, sg::FloatOut<sg::{MMA[out]}>, {elem}, {spec.tile.tile_m}, "
                         rf"{spec.tile.warps_m}, {spec.tile.warps_n}, {spec.tile.stages}, " + tail, source)


def test_render_is_deterministic():
    for spec in SPECS:
        assert codegen.render(spec) == codegen.render(spec)


def test_every_include_is_a_header_handed_to_nvrtc():
    headers = codegen.headers()
    assert headers, "no .cuh headers found"
    texts = [codegen.render(s) for s in SPECS] + list(headers.values())
    included = {name for text in texts for name in re.findall(r'#include\s+"([^"]+)"', text)}
    assert included and included <= set(headers)


def test_templates_use_only_variables_the_context_provides():
    """Every registered op's template, against the context of one of its specs (the core's
    fields plus what its layout adds); and no template is left that no op renders (common/
    holds macros the templates import)."""
    env, rendered = codegen.environment(), set()
    for spec in {s.op: s for s in specmod.default_specs(90)}.values():
        used = jinja2.meta.find_undeclared_variables(env.parse(env.loader.get_source(env, spec.rules.template)[0]))
        provided = set(codegen.template_context(spec))
        assert used <= provided, f"{spec.rules.template} uses {sorted(used - provided)}"
        rendered.add(spec.rules.template)
    on_disk = {p.relative_to(root).as_posix() for root in codegen.template_roots() for p in root.rglob("*.j2")
               if p.parent.name != "common"}  # (the core's templates and each plugin's)
    assert on_disk == rendered


def test_undefined_variable_is_an_error():
    env = codegen.environment()
    assert env.undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError, match="not_a_spec_field"):
        env.from_string("void {{ name }}_{{ not_a_spec_field }}();").render(name="k")


def test_template_with_undefined_variable_fails_to_render(tmp_path, monkeypatch):
    copy = tmp_path / "templates"
    shutil.copytree(codegen.templates_dir(), copy)
    (copy / SPECS[0].rules.template).write_text("// {{ name }} {{ tile_k }}\n")
    monkeypatch.setattr(codegen, "templates_dir", lambda: copy)
    codegen._environment.cache_clear()
    try:
        with pytest.raises(jinja2.UndefinedError, match="tile_k"):
            codegen.render(SPECS[0])
    finally:
        codegen._environment.cache_clear()


@pytest.mark.parametrize("spec", GOLDEN_SPECS + OTHER_GOLDEN, ids=ids)
def test_matches_golden_file(spec):
    path = GOLDEN_DIR / f"{spec.name}.cu"
    source = codegen.render(spec)
    if os.environ.get("SPARSEGEN_UPDATE_GOLDEN", "") not in ("", "0"):
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(source)
    assert path.exists(), f"missing {path}; regenerate with SPARSEGEN_UPDATE_GOLDEN=1"
    assert source == path.read_text(), (
        f"{spec.name} renders differently from {path}; if the template change is intended, "
        "regenerate with SPARSEGEN_UPDATE_GOLDEN=1")


def test_no_stale_golden_files():
    wanted = {f"{spec.name}.cu" for spec in GOLDEN_SPECS + OTHER_GOLDEN}
    stale = [p for p in GOLDEN_DIR.glob("*.cu") if p.name not in wanted]
    if os.environ.get("SPARSEGEN_UPDATE_GOLDEN", "") not in ("", "0"):
        for path in stale:
            path.unlink()
        stale = []
    assert not stale, f"golden files of no current spec: {stale} (SPARSEGEN_UPDATE_GOLDEN=1)"


def test_each_kernel_template_names_its_own_path_in_the_source_it_generates():
    """A generated kernel's first line says which template made it: the path a reader opens."""
    root = Path(__file__).parent.parent
    kernels = [p for p in (root / "templates").rglob("*.cu.j2")]
    assert kernels
    for path in kernels:
        first = path.read_text().splitlines()[0]
        assert f"generated by sparsegen from {path.relative_to(root)} " in first, (path, first)
