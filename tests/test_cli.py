"""The `sparsegen` command line, in this process through main() and as `python -m sparsegen`."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsegen.jit import cache, registry
from sparsegen import cli
from sparsegen.errors import CompileError, SparsegenError, SpecError
from sparsegen.jit.spec import KernelSpec, default_specs
from sparsegen.bsr.specs import forward_spec

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--arch", "sm_80", "--dtype", "bf16", "--block", "32", "64", "--layout", "bell", "bdiag"]  # (8 kernels)
# However many tiles default_specs picks per block, counted the way the CLI counts them.
N = len(set(default_specs(80, ["bf16"], [(32, 32), (64, 64)], ["bell", "bdiag"])))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """An empty disk cache and memory cache, so counts of compiled kernels are exact."""
    folder = tmp_path / "cli-cache"
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(folder))
    cache.clear_memory()
    yield folder
    cache.clear_memory()


def run_main(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_module(*argv):
    """`python -m sparsegen` from the checkout, with this test's cache directory."""
    return subprocess.run([sys.executable, "-m", "sparsegen", *argv], cwd=REPO, env=os.environ,
                          capture_output=True, text=True, timeout=300)


def test_precompile_compiles_once_then_finds_all_cached(capsys):
    code, out, _ = run_main(capsys, "precompile", *SMALL)
    assert code == 0
    assert f"precompile sm_80: {N} kernels, {N} compiled, 0 cached" in out
    cache.clear_memory()  # a new process would start with an empty memory cache
    code, out, _ = run_main(capsys, "precompile", *SMALL)
    assert code == 0
    assert f"precompile sm_80: {N} kernels, 0 compiled, {N} cached" in out


def test_module_precompile_with_jobs_fills_the_disk_cache(capsys):
    result = run_module("precompile", *SMALL, "--jobs", "2")
    assert result.returncode == 0, result.stderr
    assert f"{N} kernels, {N} compiled, 0 cached" in result.stdout
    assert "precompile sm_80" in result.stderr  # the progress bar goes to stderr
    _, out, _ = run_main(capsys, "precompile", *SMALL)
    assert f"{N} kernels, 0 compiled, {N} cached" in out


def test_cache_info_then_clear(capsys, cache_dir):
    run_main(capsys, "precompile", *SMALL)
    code, out, _ = run_main(capsys, "cache", "info")
    assert code == 0
    assert f"directory: {cache_dir}" in out and f"entries: {N}" in out
    assert int(out.split("bytes: ")[1].split()[0]) > 0
    code, out, _ = run_main(capsys, "cache", "clear")
    assert code == 0 and f"removed {N} entries" in out
    assert "entries: 0" in run_main(capsys, "cache", "info")[1]


def test_show_prints_generated_source(capsys):
    name = forward_spec((32, 32), "bf16", 80).name
    code, out, _ = run_main(capsys, "show", name)
    assert code == 0
    assert name in out and "mma" in out and "__global__" in out


def test_show_list_prints_default_names(capsys):
    code, out, _ = run_main(capsys, "show", "--list", "--arch", "sm_90", "--dtype", "bf16")
    assert code == 0
    assert out.split() == list(dict.fromkeys(spec.name for spec in default_specs(90, ["bf16"])))


@pytest.mark.parametrize("arch", [80, 90])
def test_from_name_inverts_name(arch):
    for spec in default_specs(arch):
        assert KernelSpec.from_name(spec.name) == spec


@pytest.mark.parametrize("name", ["nope", "bsr_dds_b32x32_bf16_nt_sm80_t128w4x1s4",
                                  "bsr_dds_b32x32_bf16_nt_sm90_wgmma_t128w8x1s4"])
def test_from_name_rejects_malformed_names(name):
    with pytest.raises(SpecError, match=r"Expected .*Got"):
        KernelSpec.from_name(name)


@pytest.mark.parametrize("argv", [
    ["precompile", "--arch", "sm_70"],
    ["precompile", "--arch", "sm_xx"],
    ["precompile", "--arch", "80", "--block", "32y"],
    ["precompile", "--arch", "80", "--block", "48"],
    ["precompile", "--arch", "80", "--dtype", "int4"],
    ["precompile", "--arch", "80", "--dtype", "e4m3"],
    ["precompile", "--arch", "80", "--jobs", "0"],
    ["show", "bsr_dds_nonsense"],
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("sparsegen: error: Expected") and err.count("\n") == 1


def test_missing_arch_without_gpu_asks_for_arch(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_main(capsys, "precompile")
    assert code == 2 and "--arch" in err


def test_module_bad_arch_exits_2_without_traceback():
    result = run_module("precompile", "--arch", "sm_70")
    assert result.returncode == 2
    assert result.stderr.startswith("sparsegen: error:") and "Traceback" not in result.stderr


def test_worker_errors_survive_the_trip_back_from_the_pool(monkeypatch):
    def failing_build(spec):
        raise CompileError(spec.name, "error: boom", "/tmp/x.cu")

    monkeypatch.setattr(cache, "build", failing_build)
    with pytest.raises(SparsegenError) as caught:
        cli._build_in_worker(forward_spec((32, 32), "bf16", 80))
    assert "boom" in str(pickle.loads(pickle.dumps(caught.value)))


@pytest.mark.parametrize("arch, dtype", [("80", "int8"), ("89", "e4m3"), ("90", "int8"), ("90", "e4m3")])
def test_a_one_byte_dtype_selects_only_its_24_kernels(capsys, arch, dtype):
    code, out, _ = run_main(capsys, "show", "--list", "--arch", arch, "--dtype", dtype)
    names = [s.name for s in default_specs(int(arch), [dtype])]
    assert code == 0 and out.split() == names
    assert names and all(n.startswith("sp24_") and f"_b16x32_{dtype}_" in n for n in names)


def test_precompile_of_a_one_byte_dtype_builds_them_all(capsys):
    """(One arch: test_compile compiles every default kernel, the one-byte ones included.)"""
    code, out, _ = run_main(capsys, "precompile", "--arch", "89", "--dtype", "e4m3")
    names = [s.name for s in default_specs(89, ["e4m3"])]
    assert code == 0 and f"{len(names)} kernels, {len(names)} compiled" in out, out


def test_default_precompile_set_adds_e4m3_only_where_the_arch_has_fp8_tensor_cores():
    dtypes = lambda arch: {s.dtype for s in default_specs(arch)}  # noqa: E731
    assert "int8" in dtypes(80) and "e4m3" not in dtypes(80)
    assert {"int8", "e4m3"} <= dtypes(89) and {"int8", "e4m3"} <= dtypes(90)


def test_help_is_whole_sentences_and_names_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1].replace("\n", " ")
    assert description.endswith(".") and "(tune)" in description, description
    for command in ("precompile", "cache", "show", "tune"):
        assert command in out


def test_import_is_silent():
    """Loading sparsegen prints nothing (torch warns without numpy: numpy is a dependency)."""
    done = subprocess.run([sys.executable, "-W", "always", "-c", "import sparsegen; sparsegen.load()"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "", done.stderr


NO_TORCH = """
import sys
from sparsegen import cli
for argv in {argv!r}:
    try:
        code = cli.main(argv)
    except SystemExit as done:  # (argparse's --help, --version and usage errors)
        code = done.code
    print("CODE", code)
assert "torch" not in sys.modules, "torch imported"
"""


def test_help_and_bad_command_lines_answer_without_importing_torch():
    """--help, --version and every error in what the command line says (not what the GPU or
    the cache does) answer before torch is imported: a few hundredths of a second, not seconds."""
    argv = [["--help"], ["--version"], ["precompile", "--help"], ["nonsense"], ["precompile", "--arch", "sm_70"],
            ["precompile", "--block", "32x"], ["precompile", "-j", "0"], ["show", "--list", "--arch", "sm_7"],
            ["cache"], ["tune", "--help"]]
    done = subprocess.run([sys.executable, "-c", NO_TORCH.format(argv=argv)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    codes = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("CODE ")]
    assert codes == [0, 0, 0, 2, 2, 2, 2, 2, 2, 0], done.stdout


def test_layout_selects_only_that_layouts_kernels(capsys):
    """--layout picks layouts' kernels out of the default set (precompile and show --list
    share it); an unknown name is one line and exit 2, naming the layouts there are."""
    by_layout = {}
    for layout in ("bsr", "semi24", "bell", "bdiag"):
        code, out, _ = run_main(capsys, "show", "--list", "--arch", "sm_90", "--layout", layout)
        by_layout[layout] = out.split()
        assert code == 0 and by_layout[layout]
        assert all(registry.layout_of(KernelSpec.from_name(name).op) == layout for name in by_layout[layout])
    code, out, _ = run_main(capsys, "show", "--list", "--arch", "sm_90")
    assert sorted(out.split()) == sorted(name for names in by_layout.values() for name in names)
    code, _, err = run_main(capsys, "precompile", "--arch", "sm_90", "--layout", "banded")
    assert code == 2 and "Expected a layout in ['bsr', 'semi24', 'bell', 'bdiag']. Got 'banded'." in err


def test_cache_list_names_each_entrys_kernel_from_the_entry_itself(capsys, tmp_path):
    """`cache list` reads the kernel's name from each entry's CUBIN (not from a side record), with
    its layout; an entry whose contents name no kernel is listed as such."""
    import os
    specs = [forward_spec((32, 32), "bf16", 80), default_specs(90, ["bf16"], layouts=["semi24"])[0]]
    built = [cache.build(spec) for spec in specs]
    kernels = Path(os.environ["SPARSEGEN_CACHE_DIR"]) / "kernels"
    (kernels / ("ef" * 32)).write_bytes(b"not an entry")
    code, out, _ = run_main(capsys, "cache", "list")
    assert code == 0
    lines = dict(line.split("  ", 1) for line in out.splitlines())
    for spec, entry in zip(specs, built):
        assert lines[entry.key[:16]] == f"{spec.name}  layout {registry.layout_of(spec.op)}"
    assert lines["ef" * 8] == "(damaged, or names no kernel)"
