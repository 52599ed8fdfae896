"""NVRTC: every default kernel compiles to a CUBIN; its SASS uses tensor cores without spills."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sparsegen
from sparsegen.jit import cache, compiler, epilogues
from sparsegen.jit.spec import DTYPES, KernelSpec, TileConfig, default_specs
from sparsegen.bsr.specs import forward_spec
from sparsegen.bell.specs import forward_spec as ell_forward_spec
from sparsegen.semi24.specs import sp24_w4_spec

DEFAULT_SPECS = default_specs(80) + default_specs(90) + default_specs(89, ["e4m3"])  # sm_89: native fp8 mma.sp


def code_path(spec: KernelSpec) -> tuple:
    """What selects a template's code: all but the block and tile shapes, and of the epilogue
    its kind (none, an activation, a gated product: each activation is one device function of
    sg_epilogue.cuh, all of them compiled by --all-kernels and rendered by the golden tests)."""
    kind = "none" if spec.epilogue == "none" else "gated" if epilogues.is_gated(spec.epilogue) else "activation"
    return spec.op, spec.dtype, spec.arch, spec.instr, kind, spec.trans, spec.params, spec.acc


def one_per_code_path(specs: list) -> list:
    """A kernel of each code path, the paths' kernels taken in turn so that the block and tile
    shapes vary across them: the default run's sample. `--all-kernels` (CI runs it) compiles
    every one."""
    paths: dict[tuple, list] = {}
    for spec in specs:
        paths.setdefault(code_path(spec), []).append(spec)
    sample = [kernels[i % len(kernels)] for i, kernels in enumerate(paths.values())]
    shapes = {(s.block, s.tile) for s in sample}
    for spec in specs:  # and a kernel of each block or tile shape no path's pick has
        if not any(spec.block == block for block, _ in shapes) or not any(spec.tile == tile for _, tile in shapes):
            sample.append(spec)
            shapes.add((spec.block, spec.tile))
    return sample


COMPILED_SPECS = DEFAULT_SPECS if os.environ.get("SPARSEGEN_TEST_ALL_KERNELS") == "1" else one_per_code_path(DEFAULT_SPECS)
# Non-default tiles exercise other warp grids and pipeline depths of the same template.
EXTRA_SPECS = [
    KernelSpec(block=(64, 16), dtype="fp16", arch=89, tile=TileConfig(64, 2, 2, 2)),
    KernelSpec(block=(128, 32), dtype="fp32", arch=80, tile=TileConfig(256, 4, 4, 3)),
    KernelSpec(block=(16, 128), dtype="bf16", arch=86, tile=TileConfig(32, 2, 1, 3)),
    KernelSpec(block=(64, 16), dtype="fp16", arch=90, tile=TileConfig(64, 4, 1, 3), instr="wgmma"),
    KernelSpec(block=(128, 64), dtype="bf16", arch=90, tile=TileConfig(128, 8, 1, 5),
               instr="wgmma"),
    KernelSpec(block=(32, 128), dtype="fp16", arch=90, tile=TileConfig(128, 4, 1, 2), instr="tma"),
]
# fp16 accumulators (spec.ACCS): both layouts' mma.sync kernels, plain and gated stores.
ACC_SPECS = [forward_spec(b, "fp16", arch, acc="f16", epilogue=e) for arch in (80, 90) for b in ((64, 64), (128, 128))
             for e in ("none", "swiglu")] + [ell_forward_spec((32, 32), "fp16", 90, acc="f16")]


def test_the_sample_takes_every_code_path_and_every_block_and_tile():
    sample = one_per_code_path(DEFAULT_SPECS)
    assert {code_path(s) for s in sample} == {code_path(s) for s in DEFAULT_SPECS}
    assert {s.block for s in sample} == {s.block for s in DEFAULT_SPECS}
    assert {s.tile for s in sample} == {s.tile for s in DEFAULT_SPECS}


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for site in map(Path, sys.path):
        candidate = site / "nvidia" / "cu13" / "bin" / name
        if candidate.is_file():
            return str(candidate)
    return None


CUOBJDUMP, NVDISASM = find_tool("cuobjdump"), find_tool("nvdisasm")


@pytest.fixture
def sass_tools():
    """cuobjdump and nvdisasm, which the [test] extra installs: without them these tests fail
    (they used to skip, and a skipped test is a missing one)."""
    assert CUOBJDUMP and NVDISASM, "cuobjdump and nvdisasm not found: pip install -e '.[test]' installs them"


needs_tools = pytest.mark.usefixtures("sass_tools")


@pytest.mark.parametrize("spec", COMPILED_SPECS + EXTRA_SPECS + ACC_SPECS, ids=lambda s: s.name)
def test_compiles_to_cubin(spec):
    built = cache.build(spec)
    assert built.compiled
    assert built.cubin.startswith(b"\x7fELF")
    assert spec.name.encode() in built.cubin  # the kernel's symbol, for cuModuleGetFunction


def tensor_core_ops(sass: str) -> list[str]:
    return re.findall(r"\b(?:HMMA|HGMMA|IMMA|IGMMA|QMMA|QGMMA)\.\S+", sass)


SP24_MMA_OPS = ("sp24_dds", "sp24_w4")  # Sp24Dds's mma.sp kernels (sp24_w4: its 4-bit weights)


def expected_mma(spec: KernelSpec) -> str:
    """The SASS mnemonic: fp32 accumulate (fp16 where acc says); wgmma -> HGMMA 64xBMx16;
    mma.sync k16 (16-bit inputs, fp16 has no type suffix) or k8 (tf32)."""
    if spec.acc == "f16":  # mma.sync's f16 C/D on fp16 operands
        return "HMMA.16816.F16"
    if spec.dtype == "int8":  # 2:4 on one-byte types: mma.sp m16n8k64, or wgmma.sp k64 on sm_90
        return f"IGMMA.SP.64x{spec.tile.tile_m}x64.S8.S8" if spec.instr == "tma" else "IMMA.SP.16864.S8.S8"
    if spec.dtype == "e4m3":  # sm_89: mma.sp m16n8k64; sm_90: wgmma.sp m64 x tokens x k64
        return f"QGMMA.SP.64x{spec.tile.tile_m}x64.F32.E4M3.E4M3" if spec.instr == "tma" else "QMMA.SP.16864.F32.E4M3.E4M3"
    suffix = {"bf16": ".BF16", "fp16": "", "fp32": ".TF32"}[spec.dtype]
    if spec.op == "sp24_dds" and spec.instr == "tma":  # 2:4 on Hopper: wgmma.sp m64 x tokens x k32
        return f"HGMMA.SP.64x{spec.tile.tile_m}x32.F32{suffix}"
    if spec.op in SP24_MMA_OPS:  # 2:4: mma.sp m16n8k32
        return f"HMMA.SP.16832.F32{suffix}"
    if spec.op == "bsr_sdd" and spec.instr == "tma":  # each consumer: m64 x its gathered columns x k16
        return f"HGMMA.64x{256 if spec.block[0] == 128 else 128}x16.F32{suffix}"
    if spec.instr == "swap":  # W as A: m64 x each consumer's tokens x k16
        return f"HGMMA.64x{spec.tile.tile_m * spec.block[0] // 128}x16.F32{suffix}"
    if spec.instr == "pairs":  # W as A, one block row per consumer: m64 x all the tile's tokens x k16
        return f"HGMMA.64x{spec.tile.tile_m}x16.F32{suffix}"
    if spec.instr != "mma":  # wgmma and tma
        return f"HGMMA.64x{spec.block[0]}x16.F32{suffix}"
    return f"HMMA.{1688 if spec.dtype == 'fp32' else 16816}.F32{suffix}"


def mma_per_stage(spec: KernelSpec) -> int:
    """A 128-byte stage of K is 4 mma steps, each over every tile a warp (group) owns."""
    t = spec.tile
    if spec.op == "sp24_dds" and spec.instr == "tma":  # a stage of K 64: 2 k32 steps
        return 2
    if spec.op == "bsr_sdd" and spec.instr == "tma":  # a stage of tile_m tokens: tile_m / 16 k16 steps
        return t.tile_m // 16
    if spec.instr in ("swap", "pairs"):  # a stage of 64: 4 k16 steps
        return 4
    if spec.op in SP24_MMA_OPS:  # 4 k32 steps (shared by the k-warps), each over a warp's 4 m16 x (tokens / 8) n8 tiles
        return 4 // spec.param_values.get("kwarps", 1) * 4 * (t.tile_m // t.warps_n // 8)
    if spec.instr != "mma":  # each consumer warpgroup owns tile_m / groups rows, m64 at a time
        return 4 * (t.tile_m // (t.warps_m // 4) // 64)
    return 4 * (t.tile_m // t.warps_m // 16) * (spec.block[0] // t.warps_n // 8)


def disassemble(spec: KernelSpec, folder: Path) -> tuple[str, str]:
    path = folder / f"{spec.name}.cubin"
    path.write_bytes(cache.build(spec).cubin)
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return run(NVDISASM, str(path)), run(CUOBJDUMP, "-res-usage", str(path))


def largest_per_kind(specs):
    """Per (arch, dtype, instr, op), the default kernel with the largest block and tile: the one
    under the most register pressure."""
    largest = {}
    for s in specs:
        kind, size = (s.arch, s.dtype, s.instr, s.op), (s.block[0] * s.block[1], s.tile.tile_m)
        if kind not in largest or size > largest[kind][0]:
            largest[kind] = (size, s)
    return [s for _, s in largest.values()]


# sp24_w4's k-warps (two warps a tile share each stage's steps): a decode and a small-batch tile per arch
KWARPS_SPECS = [s for s in DEFAULT_SPECS if s.op == "sp24_w4" and s.param_values["kwarps"] > 1 and s.dtype == "bf16"
                and s.epilogue == "none" and s.tile.tile_m in (16, 64)]
# sp24_w4's grouped launches (q, k and v of one X), each decode tile per arch, those KWARPS_SPECS lacks
W4_GROUPED_SPECS = [s for s in DEFAULT_SPECS if s.op == "sp24_w4" and s.param_values["groups"] > 1
                    and s.dtype == "bf16" and s not in KWARPS_SPECS]
# sp24_w4's 8-token decode tiles (one n8 step a W tile; tools/probe_int4.py's, no default takes them yet),
# with and without k-warps, with an epilogue, on the mma.sp arches
W4_EIGHT_TOKEN_SPECS = [sp24_w4_spec(d, arch, TileConfig(8, w, 1, stages), epilogue=e, kwarps=k) for arch in (80, 90)
                        for d, w, stages, k, e in (("bf16", 4, 6, 1, "none"), ("fp16", 2, 8, 2, "swiglu"))]
SASS_SPECS = largest_per_kind([s for s in DEFAULT_SPECS if s.rules.tensor_cores]) + ACC_SPECS + KWARPS_SPECS + \
    W4_GROUPED_SPECS + W4_EIGHT_TOKEN_SPECS
# How each instruction family moves a stage into shared memory, as SASS spells it.
STAGE_LOAD = {"mma": "LDGSTS", "wgmma": "LDGSTS", "tma": "UTMALDG", "pingpong": "UTMALDG", "swap": "UTMALDG",
              "pairs": "UTMALDG"}


@needs_tools
@pytest.mark.parametrize("spec", SASS_SPECS, ids=lambda s: s.name)
def test_sass_uses_tensor_cores_without_spills(spec, tmp_path):
    sass, usage = disassemble(spec, tmp_path)
    assert re.search(rf"\.target\s+{spec.target}\s", sass)
    ops = tensor_core_ops(sass)
    assert set(ops) == {expected_mma(spec)}
    assert len(ops) % mma_per_stage(spec) == 0, len(ops)
    assert STAGE_LOAD[spec.instr] in sass
    spills, stack = spec.rules.known_spills(spec)  # (the layout's own allowance: OpRules.known_spills)
    assert len(re.findall(r"\b(LDL|STL)\b", sass)) <= spills, "local-memory spill in SASS"
    assert re.search(rf"Function {spec.name}:\s*REG:\d+ STACK:{stack} SHARED:\d+ LOCAL:0\b", usage), usage


@needs_tools
@pytest.mark.parametrize("spec", [s for s in DEFAULT_SPECS if s.op == "bsr_scatter" and s.arch == 90 and s.block == (16, 16)],
                         ids=lambda s: s.name)
def test_scatter_moves_16_bytes_a_thread_without_spills(spec, tmp_path):
    """The dense path's weight kernel: 128-bit loads and stores (one pass, coalesced), no spill."""
    sass, usage = disassemble(spec, tmp_path)
    assert re.search(r"\bSTG\.E\.128\b", sass) and re.search(r"\bLDG\.E\.(CONSTANT\.)?128\b", sass), sass[-2000:]
    assert not re.search(r"\b(LDL|STL)\b", sass)


def test_sass_checks_cover_every_dtype_and_instruction():
    assert {s.dtype for s in SASS_SPECS} == set(DTYPES)
    assert {s.instr for s in SASS_SPECS} == {s.instr for s in DEFAULT_SPECS} == set(STAGE_LOAD)


BROKEN = """extern "C" __global__ void broken_kernel(float* y) {
  y[threadIdx.x] = undeclared_identifier * 2.0f;
}
"""


def test_broken_source_raises_compile_error_with_log_and_source():
    with pytest.raises(sparsegen.CompileError) as info:
        compiler.compile_cubin(BROKEN, "broken_kernel", "sm_90", {"unused.cuh": "// header\n"})
    err = info.value
    assert isinstance(err, RuntimeError) and err.kernel_name == "broken_kernel"
    error_lines = [line for line in err.log.splitlines() if "error" in line]
    assert any("undeclared_identifier" in line for line in error_lines), err.log
    assert all(line in str(err) for line in error_lines)
    source = Path(err.source_path)
    assert source.is_file() and str(source) in str(err)
    assert source.read_text() == BROKEN
    assert (source.parent / "unused.cuh").read_text() == "// header\n"


def test_failed_compile_is_not_cached(monkeypatch):
    spec = forward_spec((32, 32), "bf16", 90)
    monkeypatch.setattr(sparsegen.jit.codegen, "render", lambda s: BROKEN.replace("broken", s.name))
    with pytest.raises(sparsegen.CompileError):
        cache.build(spec)
    assert cache.info()["entries"] == 0
    with pytest.raises(sparsegen.CompileError):
        cache.build(spec)


@needs_tools
@pytest.mark.parametrize("op", ["sp24_compress", "sp24_mask", "sp24_expand", "sp24_transpose"])
@pytest.mark.parametrize("arch", [80, 90])
def test_prune_kernels_have_no_spills(arch, op, tmp_path):
    """Their per-group choices index small arrays; unrolled, those stay in registers."""
    from sparsegen.semi24.specs import sp24_compress_spec

    spec = sp24_compress_spec("bf16", arch, op)
    sass, usage = disassemble(spec, tmp_path)
    assert re.search(rf"\.target\s+{spec.target}\s", sass)
    assert not re.search(r"\b(LDL|STL)\b", sass), "local-memory spill in SASS"
    assert re.search(rf"Function {spec.name}:\s*REG:\d+ STACK:0 SHARED:\d+ LOCAL:0\b", usage), usage


@needs_tools
@pytest.mark.parametrize("spec", [s for s in DEFAULT_SPECS if s.op == "sp24_dds" and s.instr == "tma"],
                         ids=lambda s: s.name)
def test_wgmma_sp_groups_in_flight_keep_their_metadata_registers(spec, tmp_path):
    """The tensor cores read wgmma.sp's metadata register while the products run, and one
    group stays in flight while the next is issued: consecutive groups must name disjoint
    metadata registers (one register reused corrupted results on an H200)."""
    sass, _ = disassemble(spec, tmp_path)
    groups, current = [], set()
    for line in sass.splitlines():
        found = re.search(r"[HQI]GMMA\.SP\.\S+ R\d+, gdesc\[\w+\], R\d+, (R\d+)", line)
        if found:
            current.add(found.group(1))
            if "gsb0" in line:  # the group's last product
                groups.append(current)
                current = set()
    assert len(groups) >= 2, sass
    assert all(not (a & b) for a, b in zip(groups, groups[1:])), groups


@needs_tools
@pytest.mark.parametrize("spec", [s for s in DEFAULT_SPECS if s.op == "sp24_dds" and s.tile.cluster > 1],
                         ids=lambda s: s.name)
def test_cluster_kernels_fence_the_gpu_only_at_the_cluster_barriers(spec, tmp_path):
    """A cluster-scope release on the per-stage barrier arrivals made ptxas put MEMBAR.ALL.GPU
    before each one, which waits for the wgmmas in flight: the kernel ran at half speed (H200).
    Only the two cluster-wide barriers (start and end) may fence the GPU."""
    sass, _ = disassemble(spec, tmp_path)
    assert "UTMALDG" in sass and "MULTICAST" in sass.upper(), "no multicast copy"
    assert len(re.findall(r"MEMBAR\.ALL\.GPU", sass)) <= 2
