"""The two-level CUBIN cache: memory and disk hits, other processes, damage, invalidation."""
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import sparsegen
from sparsegen.jit import cache, codegen, compiler
from sparsegen import env
from sparsegen.bsr.specs import forward_spec

SPEC = forward_spec((16, 16), "bf16", 80)  # the quickest default kernel to compile
PACKAGE_ROOT = str(Path(sparsegen.__file__).resolve().parent.parent)

# Builds one spec in a fresh interpreter and prints what it got. mode "forbid" fails if
# NVRTC is called; "slow" holds NVRTC for 2 s so that concurrent builds overlap.
WORKER = """
import hashlib, json, sys, time
from sparsegen.jit import cache, compiler
from sparsegen.bsr.specs import forward_spec
bm, bk, dtype, arch, mode = sys.argv[1:]
real = compiler.compile_cubin
def compile_cubin(*args):
    assert mode != "forbid", "NVRTC was called"
    if mode == "slow":
        time.sleep(2.0)
    return real(*args)
compiler.compile_cubin = compile_cubin
built = cache.build(forward_spec((int(bm), int(bk)), dtype, int(arch)))
print(json.dumps({"compiled": built.compiled, "sha": hashlib.sha256(built.cubin).hexdigest()}))
"""


def start_worker(spec, mode: str) -> subprocess.Popen:
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
    args = [*map(str, spec.block), spec.dtype, str(spec.arch), mode]
    return subprocess.Popen([sys.executable, "-c", WORKER, *args], env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def forbid(monkeypatch, module, name):
    def fail(*args, **kwargs):
        raise AssertionError(f"{module.__name__}.{name} must not be called")

    monkeypatch.setattr(module, name, fail)


def test_miss_then_hit(nvrtc_calls):
    first = cache.build(SPEC)
    second = cache.build(SPEC)
    assert first.compiled and not second.compiled
    assert nvrtc_calls == [SPEC.name]
    assert second.cubin == first.cubin and second.key == first.key
    assert cache.info()["entries"] == 1


def test_disk_hit_then_memory_hit(nvrtc_calls, monkeypatch):
    first = cache.build(SPEC)
    cache.clear_memory()
    from_disk = cache.build(SPEC)
    assert not from_disk.compiled and from_disk.cubin == first.cubin
    assert nvrtc_calls == [SPEC.name]
    forbid(monkeypatch, cache, "_store")  # a memory hit touches neither disk nor NVRTC
    from_memory = cache.build(SPEC)
    assert not from_memory.compiled and from_memory.cubin == first.cubin


def test_new_process_hits_disk_cache():
    built = cache.build(SPEC)
    got = result_of(start_worker(SPEC, "forbid"))
    assert got == {"compiled": False, "sha": sha(built.cubin)}


def test_two_processes_compiling_at_once_agree():
    procs = [start_worker(SPEC, "slow") for _ in range(2)]
    results = [result_of(p) for p in procs]
    assert results[0]["sha"] == results[1]["sha"]
    # The build lock lets one process compile; the other then finds the entry on disk.
    assert sorted(r["compiled"] for r in results) == [False, True]
    here = cache.build(SPEC)
    assert not here.compiled and sha(here.cubin) == results[0]["sha"]
    assert cache.info()["entries"] == 1


DAMAGE = {
    "garbage": lambda blob: b"definitely not a sealed cubin" * 8,
    "empty": lambda blob: b"",
    "truncated": lambda blob: blob[: len(blob) // 2],
    "bit flip": lambda blob: blob[:-100] + bytes([blob[-100] ^ 1]) + blob[-99:],
    "a pickle": lambda blob: pickle.dumps(Explosive()),
}


class Explosive:
    """Unpickling this runs code: what a planted diskcache entry did before the file store."""

    def __reduce__(self):
        return (os.system, ('touch "$SPARSEGEN_CACHE_DIR/pwned"',))


def entry_file(kind: str, key: str) -> Path:
    return env.cache_dir() / kind / key


def assert_recompiled_with_warning(spec, original: bytes, nvrtc_calls):
    cache.clear_memory()
    with pytest.warns(RuntimeWarning, match=f"{spec.name} is damaged"):
        rebuilt = cache.build(spec)
    assert rebuilt.compiled and rebuilt.cubin == original
    assert nvrtc_calls == [spec.name, spec.name]
    cache.clear_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the repaired entry loads quietly
        again = cache.build(spec)
    assert not again.compiled and again.cubin == original
    assert not (env.cache_dir() / "pwned").exists()


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_damaged_entry_is_recompiled_with_warning(damage, nvrtc_calls):
    built = cache.build(SPEC)
    path = entry_file("kernels", built.key)
    path.write_bytes(damage(path.read_bytes()))
    assert_recompiled_with_warning(SPEC, built.cubin, nvrtc_calls)


@pytest.mark.parametrize("record", [pickle.dumps(Explosive()), b"", b"../../etc/passwd", b"\xff" * 64],
                         ids=["a pickle", "empty", "a path", "not ascii"])
def test_an_alias_record_that_is_not_a_key_is_ignored(record, nvrtc_calls):
    """An alias names a source key (64 hex digits) and is read as text, never unpickled: a
    planted record is a miss, and the kernel is found by its rendered source instead."""
    built = cache.build(SPEC)
    (alias_file,) = (env.cache_dir() / "aliases").iterdir()
    alias_file.write_bytes(record)
    cache.clear_memory()
    again = cache.build(SPEC)
    assert not again.compiled and again.cubin == built.cubin and nvrtc_calls == [SPEC.name]
    assert alias_file.read_bytes() == built.key.encode()  # the record is repaired
    assert not (env.cache_dir() / "pwned").exists()


def test_a_planted_diskcache_database_of_earlier_versions_is_never_read(nvrtc_calls):
    """Earlier versions kept entries in diskcache (cubins/cache.db), which unpickles what it
    reads; this version never opens that folder, whatever it holds."""
    legacy = env.cache_dir() / "cubins"
    legacy.mkdir(parents=True)
    (legacy / "cache.db").write_bytes(b"SQLite format 3\0" + pickle.dumps(Explosive()))
    assert cache.build(SPEC).compiled and nvrtc_calls == [SPEC.name]
    assert cache.clear() == (1, [f"{legacy} (an earlier version's, never read)"]) and legacy.exists()
    assert not (env.cache_dir() / "pwned").exists()


@pytest.fixture
def fresh_jinja():
    codegen._environment.cache_clear()  # its loader is bound to templates_dir()
    yield
    codegen._environment.cache_clear()


def use_template_copy(tmp_path, monkeypatch) -> Path:
    """From now on codegen reads its templates from a private copy that the test may edit."""
    copy = tmp_path / "templates"
    shutil.copytree(codegen.templates_dir(), copy)
    monkeypatch.setattr(codegen, "templates_dir", lambda: copy)
    codegen._environment.cache_clear()
    return copy


@pytest.mark.parametrize("pattern", [SPEC.rules.template, "*/*.cuh"])
def test_editing_a_template_invalidates_the_key(pattern, tmp_path, monkeypatch, fresh_jinja,
                                                nvrtc_calls):
    original = cache.build(SPEC)
    copy = use_template_copy(tmp_path, monkeypatch)
    unedited = cache.build(SPEC)  # same contents, another folder: same key
    assert not unedited.compiled and unedited.key == original.key
    path = sorted(copy.glob(pattern))[0]
    text = path.read_text()
    path.write_text(text + "\n// an edit\n")
    edited = cache.build(SPEC)
    assert edited.compiled and edited.key != original.key
    path.write_text(text)
    restored = cache.build(SPEC)
    assert not restored.compiled and restored.key == original.key
    assert nvrtc_calls == [SPEC.name, SPEC.name]


def test_new_compiler_or_options_invalidate_the_key(monkeypatch, nvrtc_calls):
    original = cache.build(SPEC)
    # A new NVRTC arrives as a new package version: both the alias and the key change.
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: "99.9")
    monkeypatch.setattr(compiler, "identity", lambda: ("nvidia-cuda-nvrtc=99.9",))
    new_nvrtc = cache.build(SPEC)
    monkeypatch.setattr(compiler, "BASE_OPTIONS", compiler.BASE_OPTIONS + ("-lineinfo",))
    new_options = cache.build(SPEC)
    assert new_nvrtc.compiled and new_options.compiled
    assert len({original.key, new_nvrtc.key, new_options.key}) == 3
    assert nvrtc_calls == [SPEC.name] * 3


def test_clear_empties_both_levels(nvrtc_calls):
    other = forward_spec((32, 32), "fp16", 80)
    cache.build(SPEC), cache.build(other)
    assert cache.info()["entries"] == 2
    assert cache.clear() == (2, [])
    assert cache.info()["entries"] == 0 and not (env.cache_dir() / "kernels").exists()
    assert cache.build(SPEC).compiled and cache.build(other).compiled
    assert nvrtc_calls == [SPEC.name, other.name] * 2


def test_no_disk_cache_keeps_disk_empty(nvrtc_calls, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_NO_DISK_CACHE", "1")
    assert cache.build(SPEC).compiled
    assert not cache.build(SPEC).compiled  # still remembered in memory
    cache.clear_memory()
    assert cache.build(SPEC).compiled
    assert nvrtc_calls == [SPEC.name] * 2
    assert cache.info()["entries"] == 0
