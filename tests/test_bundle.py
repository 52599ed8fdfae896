"""Kernel bundles: `sparsegen precompile --bundle DIR` with no GPU, then a fresh process that
cannot compile (NVRTC made unavailable) and cannot write its cache loads every kernel from it."""
import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest
from test_cache import PACKAGE_ROOT, fresh_jinja, use_template_copy  # noqa: F401 (a fixture)
from pathlib import Path

from sparsegen.jit import bundle, cache, codegen
from sparsegen import cli, env
from sparsegen.jit.spec import KernelSpec
from sparsegen.bsr.specs import forward_spec
from sparsegen.jit.trust import UntrustedPathError

TOOLS = Path(__file__).resolve().parents[1] / "tools"
SELECTION = ["--arch", "sm_80", "--dtype", "bf16", "--block", "16"]
SPEC = forward_spec((16, 16), "bf16", 80)

# A new interpreter in which `import cuda.bindings.nvrtc` fails, as on a machine without it.
# It builds every kernel the manifest names and prints what it got.
LOAD_ALL = """
import hashlib, json, sys, warnings
sys.modules["cuda.bindings.nvrtc"] = None
warnings.simplefilter("error")  # a write to the read-only cache would warn
warnings.filterwarnings("ignore", message=".*nonexistent-first")  # a missing bundle is only skipped
from sparsegen.jit import cache, compiler
from sparsegen.jit.spec import KernelSpec
try:
    compiler.compile_cubin("", "probe", "sm_80", {})
    sys.exit("NVRTC is still available")
except ImportError:
    pass
manifest = json.load(open(sys.argv[1]))
got = {}
for name in manifest["kernels"]:
    built = cache.build(KernelSpec.from_name(name))
    got[name] = [built.compiled, hashlib.sha256(built.cubin).hexdigest()]
print(json.dumps(got))
"""


def precompile_bundle(folder, cache_dir) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p), CUDA_VISIBLE_DEVICES="",
        SPARSEGEN_CACHE_DIR=str(cache_dir))
    return subprocess.run([sys.executable, "-m", "sparsegen", "precompile", *SELECTION, "-j", "2",
                           "--bundle", str(folder)], env=environ, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A bundle precompiled with no GPU (CUDA_VISIBLE_DEVICES empty), in its own cache."""
    where = tmp_path_factory.mktemp("ship")
    done = precompile_bundle(where / "bundle", where / "cache")
    assert done.returncode == 0, done.stderr
    return where / "bundle"


def test_a_bundle_holds_every_selected_kernel_read_only_with_its_hash(shipped, capsys):
    cli.main(["show", "--list", *SELECTION])
    names = capsys.readouterr().out.split()
    manifest = json.loads((shipped / "manifest.json").read_text())
    assert sorted(manifest["kernels"]) == sorted(names) and len(names) > 10
    texts = codegen.generator_texts()
    for name, entry in manifest["kernels"].items():
        spec = KernelSpec.from_name(name)
        assert entry == {"cubin": hashlib.sha256((shipped / f"{name}.cubin").read_bytes()).hexdigest(),
                         "source": bundle.source_digest(spec), "origin": bundle.origin_digest(spec, texts)}
    assert manifest["format"] == bundle.FORMAT and manifest["nvrtc"].count(".") == 1
    assert stat.S_IMODE(shipped.stat().st_mode) == 0o555
    assert {stat.S_IMODE(p.stat().st_mode) for p in shipped.iterdir()} == {0o444}


def test_a_process_without_nvrtc_and_a_read_only_cache_loads_every_kernel(shipped, read_only_cache):
    manifest = json.loads((shipped / "manifest.json").read_text())
    environ = dict(os.environ, SPARSEGEN_KERNEL_BUNDLE=os.pathsep.join(["/nonexistent-first", str(shipped)]),
                   PYTHONPATH=os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
    environ.pop("SPARSEGEN_NO_DISK_CACHE", None)
    done = subprocess.run([sys.executable, "-c", LOAD_ALL, str(shipped / "manifest.json")], env=environ,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {name: [False, entry["cubin"]] for name, entry in manifest["kernels"].items()}


def test_the_bundle_comes_before_the_user_cache(shipped, monkeypatch):
    name = SPEC.name
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", str(shipped))
    built = cache.build(SPEC)
    assert not built.compiled and built.cubin == (shipped / f"{name}.cubin").read_bytes()
    assert cache.info()["entries"] == 0  # nothing copied into the user cache


def copy_bundle(shipped, to):
    to.mkdir()
    for path in shipped.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    os.chmod(to, 0o700)
    return to


def edit_manifest(folder, change):
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("damage", ["cubin", "old format", "garbage", "bad name", "bad entry"])
def test_a_damaged_bundle_is_skipped_with_a_warning(damage, shipped, tmp_path, monkeypatch):
    folder = copy_bundle(shipped, tmp_path / "copy")
    cubin = folder / f"{SPEC.name}.cubin"
    if damage == "cubin":
        data = cubin.read_bytes()
        cubin.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "old format":
        edit_manifest(folder, lambda d: d.update(format="sparsegen-kernel-bundle/1"))
    elif damage == "garbage":
        (folder / "manifest.json").write_bytes(b"\x80not json")
    elif damage == "bad name":
        edit_manifest(folder, lambda d: d["kernels"].update({"../../x": d["kernels"][SPEC.name]}))
    else:
        edit_manifest(folder, lambda d: d["kernels"].update({SPEC.name: "0" * 64}))
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", str(folder))
    bundle._load.cache_clear()
    with pytest.warns(RuntimeWarning, match="bundle|manifest"):
        built = cache.build(SPEC)
    assert built.compiled  # compiled here instead; nothing from the bundle ran


@pytest.mark.parametrize("edit", [SPEC.rules.template, "common/sg_mma.cuh"])
def test_an_edited_template_makes_only_its_kernels_compile_again(edit, shipped, tmp_path, monkeypatch, fresh_jinja):
    """An edited template makes its kernels' bundled CUBINs stale: those are compiled from
    today's source, silently; a kernel whose source is unchanged still loads (every kernel
    gets every header: an edited header makes them all stale)."""
    other = next(KernelSpec.from_name(p.stem) for p in sorted(shipped.glob("sp24_compress*.cubin")))
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", str(shipped))
    path = use_template_copy(tmp_path, monkeypatch) / edit
    path.write_text(path.read_text() + "\n// an edit\n")
    assert cache.build(SPEC).compiled
    assert cache.build(other).compiled == edit.endswith(".cuh")
    assert cache.info()["entries"] == 1 + edit.endswith(".cuh")


def test_a_bundle_others_can_write_is_refused(shipped, tmp_path, monkeypatch):
    folder = copy_bundle(shipped, tmp_path / "copy")
    os.chmod(folder, 0o775)
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", str(folder))
    bundle._load.cache_clear()
    with pytest.raises(UntrustedPathError, match="writable by its group"):
        cache.build(SPEC)


def test_precompile_refuses_a_bundle_directory_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "something").write_text("")
    assert cli.main(["precompile", *SELECTION, "--bundle", str(tmp_path)]) == cli.USAGE_ERROR
    assert "--bundle naming a new directory (or an empty one of yours" in capsys.readouterr().err
    assert env.cache_dir().exists() is False  # refused before compiling anything


def test_cache_info_names_each_bundle_searched_and_its_kernels(shipped, tmp_path, monkeypatch, capsys):
    damaged = copy_bundle(shipped, tmp_path / "damaged")
    (damaged / "manifest.json").write_bytes(b"not json")
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", os.pathsep.join([str(shipped), str(damaged)]))
    count = len(json.loads((shipped / "manifest.json").read_text())["kernels"])
    with pytest.warns(RuntimeWarning, match="ignoring the kernel bundle .*damaged"):
        assert cli.main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"bundle: {shipped} ({count} kernels)" in out and f"bundle: {damaged} (not loaded: see the warning" in out


def test_a_kernel_the_bundle_lacks_comes_from_the_user_cache(shipped, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", str(shipped))
    other = KernelSpec.from_name(forward_spec((32, 32), "fp16", 80).name)
    assert cache.build(other).compiled and cache.info()["entries"] == 1


def test_the_installed_kernels_package_is_searched_after_the_named_bundles(tmp_path, monkeypatch):
    package = tmp_path / env.SHIPPED_KERNELS_PACKAGE
    for arch in ("sm_90", "sm_80", "notes"):
        (package / arch).mkdir(parents=True)
        if arch != "notes":  # (a folder without a manifest is no bundle)
            (package / arch / "manifest.json").write_text("{}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", "/mine")
    assert bundle.folders() == [Path("/mine"), package / "sm_80", package / "sm_90"]
    monkeypatch.setenv("SPARSEGEN_SHIPPED_KERNELS", "0")  # (measuring a compile, or not trusting it)
    assert bundle.folders() == [Path("/mine")]


@pytest.mark.slow
def test_the_kernels_wheel_once_installed_serves_every_kernel_with_no_nvrtc(tmp_path, read_only_cache):
    """tools/build_kernels.py builds the sparsegen-kernels wheel; pip installs it; a process
    with no NVRTC, no bundle named and a read-only cache finds every kernel in it."""
    build = subprocess.run([sys.executable, str(TOOLS / "build_kernels.py"), "--out", str(tmp_path / "dist"),
                            *SELECTION, "-j", "2"], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel, = (tmp_path / "dist").glob("sparsegen_kernels-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                    str(tmp_path / "site"), str(wheel)], check=True, capture_output=True, timeout=300)
    manifest = tmp_path / "site" / env.SHIPPED_KERNELS_PACKAGE / "sm_80" / "manifest.json"
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(tmp_path / "site"), PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
    environ.pop("SPARSEGEN_KERNEL_BUNDLE", None)
    done = subprocess.run([sys.executable, "-c", LOAD_ALL, str(manifest)], env=environ,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    kernels = json.loads(manifest.read_text())["kernels"]
    assert len(got) > 10 and got == {name: [False, entry["cubin"]] for name, entry in kernels.items()}


def test_the_kernels_wheel_tool_asks_for_the_setuptools_it_needs_before_compiling(tmp_path):
    fake = tmp_path / "old" / "setuptools-60.0.dist-info"  # (found first on the path: version 60)
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: setuptools\nVersion: 60.0\n")
    done = subprocess.run([sys.executable, str(TOOLS / "build_kernels.py"), "--out", str(tmp_path / "dist")],
                          env=dict(os.environ, PYTHONPATH=str(tmp_path / "old")), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "Expected setuptools>=77 in this environment" in done.stderr, done.stderr
    assert "Got 60.0." in done.stderr and not (tmp_path / "dist").exists()
