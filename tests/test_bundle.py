"""Kernel bundles: `sparsegen precompile --bundle DIR` with no GPU, then a fresh process that
cannot compile (NVRTC made unavailable) and cannot write its cache loads every kernel from it."""
import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest
from test_cache import PACKAGE_ROOT

from sparsegen.jit import bundle, cache
from sparsegen import cli, env
from sparsegen.jit.spec import KernelSpec
from sparsegen.bsr.specs import forward_spec
from sparsegen.jit.trust import UntrustedPathError

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
    for name, digest in manifest["kernels"].items():
        assert hashlib.sha256((shipped / f"{name}.cubin").read_bytes()).hexdigest() == digest
    assert manifest["generator"] == bundle.generator_digest() and manifest["nvrtc"].count(".") == 1
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
    assert got == {name: [False, digest] for name, digest in manifest["kernels"].items()}


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


@pytest.mark.parametrize("damage", ["cubin", "stale", "garbage", "bad name"])
def test_a_damaged_or_stale_bundle_is_skipped_with_a_warning(damage, shipped, tmp_path, monkeypatch):
    folder = copy_bundle(shipped, tmp_path / "copy")
    cubin = folder / f"{SPEC.name}.cubin"
    if damage == "cubin":
        data = cubin.read_bytes()
        cubin.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "stale":
        edit_manifest(folder, lambda d: d.update(generator="0" * 64))
    elif damage == "garbage":
        (folder / "manifest.json").write_bytes(b"\x80not json")
    else:
        edit_manifest(folder, lambda d: d["kernels"].update({"../../x": "0" * 64}))
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", str(folder))
    bundle._load.cache_clear()
    with pytest.warns(RuntimeWarning, match="bundle|manifest"):
        built = cache.build(SPEC)
    assert built.compiled  # compiled here instead; nothing from the bundle ran


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


def test_a_kernel_the_bundle_lacks_comes_from_the_user_cache(shipped, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", str(shipped))
    other = KernelSpec.from_name(forward_spec((32, 32), "fp16", 80).name)
    assert cache.build(other).compiled and cache.info()["entries"] == 1
