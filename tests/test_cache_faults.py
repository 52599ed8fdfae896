"""Faults of the disk under the kernel cache: each keeps every build working (kernels stay in
memory, one warning), loses no entry already stored, and never hangs."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from test_cache import result_of, sha, start_worker

from sparsegen.jit import cache, diskstore, private_files
from sparsegen import env
from sparsegen.bsr.specs import forward_spec

SPEC = forward_spec((16, 16), "bf16", 80)
OTHERS = [forward_spec((16, 16), "fp16", 80), forward_spec((32, 32), "bf16", 80), forward_spec((32, 32), "fp16", 80)]


def stored_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def build_fresh(spec):
    cache.clear_memory()
    return cache.build(spec)


@contextlib.contextmanager
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_a_read_only_cache_loads_what_it_has_and_compiles_the_rest_in_memory(read_only_cache):
    root = env.cache_dir()
    before = stored_files(root)
    assert not build_fresh(SPEC).compiled  # what is stored still loads
    with pytest.warns(RuntimeWarning, match=f"cannot write the kernel cache at {root}") as caught:
        new = [cache.build(spec) for spec in OTHERS]
    assert all(b.compiled for b in new) and len(caught) == 1  # one warning for every kernel
    assert not any(b.compiled for b in map(cache.build, OTHERS))  # kept in memory
    assert stored_files(root) == before


@pytest.fixture
def full_disk(monkeypatch):
    """Every cache write hits a device with no space left: the new file's descriptor is
    /dev/full's, so the kernel itself answers ENOSPC (the file name is a real one in the folder)."""
    real = private_files._write_all

    def write_on_full_device(fd, data):
        os.dup2(os.open("/dev/full", os.O_WRONLY), fd)
        return real(fd, data)

    def fill(full: bool = True):
        monkeypatch.setattr(private_files, "_write_all", write_on_full_device if full else real)
    return fill


def test_a_full_disk_warns_once_keeps_kernels_in_memory_and_loses_nothing(full_disk):
    stored = cache.build(SPEC)
    root = env.cache_dir()
    before = stored_files(root)
    full_disk()
    with pytest.warns(RuntimeWarning, match="No space left on device") as caught:
        new = [build_fresh(spec) for spec in OTHERS]
    assert all(b.compiled for b in new) and len(caught) == 1
    assert not list(root.rglob(".tmp-*"))  # no half-written temporary left behind
    after = stored_files(root)
    assert {k: after[k] for k in before} == before
    assert not build_fresh(SPEC).compiled and build_fresh(SPEC).cubin == stored.cubin
    full_disk(False)  # space again: the next compile is stored
    assert build_fresh(OTHERS[0]).compiled and not build_fresh(OTHERS[0]).compiled


def test_the_cache_deleted_while_running_is_made_again():
    first = cache.build(SPEC)
    shutil.rmtree(env.cache_dir())
    with no_warnings():
        assert cache.build(OTHERS[0]).compiled  # stored in a new directory
        assert not cache.build(SPEC).compiled  # still in memory
        rebuilt = build_fresh(SPEC)
    assert rebuilt.compiled and rebuilt.cubin == first.cubin
    assert cache.info()["entries"] == 2


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def hold_lock_in_other_process(key: str) -> subprocess.Popen:
    folder = env.cache_dir() / "locks"
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(env.cache_dir(), 0o700)
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder / f"{key[:32]}.lock")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_lock_held_by_a_killed_process_does_not_block_a_build():
    holder = hold_lock_in_other_process(cache._source(SPEC)[2])
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    start = time.monotonic()
    with no_warnings():
        assert cache.build(SPEC).compiled
    assert time.monotonic() - start < diskstore.LOCK_WAIT_S / 4


def test_a_lock_held_by_a_hung_process_is_waited_for_a_bounded_time(monkeypatch):
    monkeypatch.setattr(diskstore, "LOCK_WAIT_S", 0.5)
    holder = hold_lock_in_other_process(cache._source(SPEC)[2])
    try:
        with pytest.warns(RuntimeWarning, match="held over"):
            built = cache.build(SPEC)
        assert built.compiled and not build_fresh(SPEC).compiled  # built and stored all the same
    finally:
        holder.kill()
        holder.wait()


def test_eight_processes_compiling_the_same_and_different_kernels_at_once():
    specs = [SPEC, *OTHERS] * 2  # four kernels, each asked for by two processes
    procs = [start_worker(spec, "slow") for spec in specs]
    results = [result_of(p) for p in procs]
    for spec in specs[:4]:
        mine = [r for s, r in zip(specs, results) if s == spec]
        assert mine[0]["sha"] == mine[1]["sha"]
        assert sorted(r["compiled"] for r in mine) == [False, True]  # the lock: one compile each
        assert sha(build_fresh(spec).cubin) == mine[0]["sha"]
    assert cache.info()["entries"] == 4
    assert not list(env.cache_dir().rglob(".tmp-*"))
