"""CUBIN cache: a dict in this process, then read-only kernel bundles (bundle.py), then the
user's cache on disk (diskstore.py: raw files, trust-checked), then NVRTC.

The key hashes the rendered source, the headers, NVRTC's version, the options and the
arch, so an edited template or a new compiler invalidates old entries by itself.
Entries carry a checksum: a damaged one is recompiled with a warning, never loaded.
"""
from __future__ import annotations

import hashlib
import os
import queue
import re
import threading
import warnings
from concurrent.futures import Future
from dataclasses import dataclass

from . import bundle, codegen, compiler
from .. import env
from .diskstore import ALIASES, ENTRY_MAGIC, KERNELS, KEY_RE, DiskStore
from .spec import KernelSpec
from ..errors import SpecError

_memory: dict[str, tuple[str, bytes]] = {}


@dataclass(frozen=True)
class Built:
    spec: KernelSpec
    key: str
    cubin: bytes
    compiled: bool  # False when it came from a cache or a bundle


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def cache_key(source: str, headers: dict[str, str], target: str) -> str:
    return _digest(source, *headers.values(), compiler.nvrtc_version(), *compiler.options(target))


def _store() -> DiskStore:
    return DiskStore(env.cache_dir())


def _seal(cubin: bytes) -> bytes:
    return ENTRY_MAGIC + hashlib.sha256(cubin).digest() + cubin


def _unseal(blob: bytes) -> bytes | None:
    """The CUBIN inside a disk entry, or None if the entry is damaged."""
    if not blob.startswith(ENTRY_MAGIC) or len(blob) < 40 + 8:
        return None
    digest, cubin = blob[8:40], blob[40:]
    return cubin if hashlib.sha256(cubin).digest() == digest else None


def _read_kernel(store: DiskStore, key: str, name: str) -> bytes | None:
    blob = store.read(KERNELS, key)
    if blob is None:
        return None
    cubin = _unseal(blob)
    if cubin is None:
        warnings.warn(f"sparsegen: cache entry for {name} is damaged; recompiling it.", RuntimeWarning, stacklevel=4)
        store.delete(KERNELS, key)
    return cubin


def _read_alias(store: DiskStore, alias: str) -> str | None:
    """The source key an alias record names; a record that is not one is damaged (ignored)."""
    raw = store.read(ALIASES, alias)
    key = raw.decode("ascii", "replace") if raw is not None else None
    return key if key is not None and KEY_RE.fullmatch(key) else None


def alias_key(origin: str) -> str:
    """Everything the rendered source and the CUBIN follow from, without rendering or loading
    NVRTC (together ~100 ms in a new process): the kernel's origin (bundle.origin_digest: the
    spec, the templates and the code that renders them, NVRTC's options) and the installed
    versions of jinja2 and the compiler packages."""
    return _digest(origin, *compiler.identity())


def build(spec: KernelSpec) -> Built:
    """The CUBIN for spec: from memory, else a kernel bundle, else disk, else NVRTC (then
    stored on disk and in memory). A build of it that build_soon started is waited for (one
    not started yet is taken over here)."""
    origin = bundle.origin_digest(spec, codegen.generator_texts())  # (the alias's and the bundles' key)
    alias = alias_key(origin)
    pending = _pending.get(alias)
    if pending is not None and pending.cancel():
        _pending.pop(alias, None)
    elif pending is not None:
        try:
            pending.result()
        except Exception:  # (its error is this call's to raise: built again below)
            pass
    return _build(spec, origin, alias)


# Background builds (build_soon): NVRTC releases the GIL, so threads compile in parallel while
# the caller goes on. At most this many at once. Daemon threads of our own, not a
# ThreadPoolExecutor, whose exit hook would run every queued build before the process may end:
# a script that patches and exits should not wait for kernels it will never use (a build cut
# short leaves at most a temporary file, which `cache clear` removes).
BACKGROUND_THREADS = max(1, min(8, (os.cpu_count() or 2) - 1))
_pending: dict[str, Future] = {}
_pool_lock = threading.Lock()
_pool: list = []  # [the queue, its threads]


def build_soon(specs: list[KernelSpec]) -> int:
    """Start building `specs` on background threads (those not in memory yet, each once), so
    that a later build() of one finds it done or waits only for what is left of it. Errors
    are left for build() to raise. Returns how many were started."""
    texts = codegen.generator_texts()
    started = 0
    for spec in dict.fromkeys(specs):
        origin = bundle.origin_digest(spec, texts)
        alias = alias_key(origin)
        if alias in _memory or alias in _pending:
            continue
        _pending[alias] = _submit(_build_in_background, spec, origin, alias)
        started += 1
    return started


def _submit(fn, *args) -> Future:
    future: Future = Future()
    with _pool_lock:
        if not _pool:
            _pool.extend([queue.SimpleQueue(), []])
        work, threads = _pool
        work.put((future, fn, args))
        if len(threads) < BACKGROUND_THREADS:
            threads.append(threading.Thread(target=_serve, args=(work,), name="sparsegen-build", daemon=True))
            threads[-1].start()
    return future


def _serve(work: queue.SimpleQueue) -> None:
    while True:
        future, fn, args = work.get()
        if not future.set_running_or_notify_cancel():
            continue  # (cancelled: build() took it over)
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # (kept for build() to raise again)
            future.set_exception(error)


def _build_in_background(spec: KernelSpec, origin: str, alias: str) -> None:
    try:
        _build(spec, origin, alias)
    finally:
        _pending.pop(alias, None)


def _build(spec: KernelSpec, origin: str, alias: str) -> Built:
    if alias in _memory:
        return Built(spec, *_memory[alias], compiled=False)
    if env.disable_disk_cache():
        return _remember(alias, _compile(spec, *_source(spec)))
    bundled = bundle.lookup(spec, origin)
    if bundled is not None:
        return _remember(alias, Built(spec, "bundle:" + hashlib.sha256(bundled).hexdigest(), bundled, False))
    store = _store()
    key = _read_alias(store, alias)
    cubin = _read_kernel(store, key, spec.name) if key else None
    built = Built(spec, key, cubin, False) if cubin is not None else _build_on_disk(store, spec)
    if built.key != key:  # a write on every hit would cost a new process milliseconds
        store.write(ALIASES, alias, built.key.encode())
    return _remember(alias, built)


def _source(spec: KernelSpec) -> tuple[str, dict[str, str], str]:
    source, headers = codegen.render(spec), codegen.headers()
    return source, headers, cache_key(source, headers, spec.target)


def _compile(spec: KernelSpec, source: str, headers: dict[str, str], key: str) -> Built:
    return Built(spec, key, compiler.compile_cubin(source, spec.name, spec.target, headers), True)


def _build_on_disk(store: DiskStore, spec: KernelSpec) -> Built:
    """Look the rendered source's key up; compile under a lock only if it is missing."""
    source, headers, key = _source(spec)
    cubin = _read_kernel(store, key, spec.name)
    if cubin is not None:
        return Built(spec, key, cubin, compiled=False)
    with store.build_lock(key):
        # Another process may have built it while we waited for the lock.
        cubin = _read_kernel(store, key, spec.name)
        if cubin is not None:
            return Built(spec, key, cubin, compiled=False)
        built = _compile(spec, source, headers, key)
        store.write(KERNELS, key, _seal(built.cubin))
    return built


def _remember(alias: str, built: Built) -> Built:
    _memory[alias] = (built.key, built.cubin)
    return built


def clear_memory() -> None:
    _memory.clear()


def info() -> dict:
    """entries: compiled kernels on disk (the alias records that point at them not counted)."""
    store = _store()
    return {"directory": str(store.root), "entries": len(store.keys(KERNELS)), "bytes": store.volume(KERNELS)}


def entries() -> list[tuple[str, KernelSpec | None]]:
    """(key, spec) of each compiled kernel on disk, the spec read from the entry itself: the
    kernel's name among its CUBIN's symbols (None where the entry is damaged or names none)."""
    store = _store()
    listed = []
    for key in store.keys(KERNELS):
        blob = store.read(KERNELS, key)
        cubin = _unseal(blob) if blob is not None else None
        listed.append((key, None if cubin is None else kernel_in(cubin)))
    return listed


_SYMBOL_RE = re.compile(rb"[a-z][a-z0-9_]{10,250}")


def kernel_in(cubin: bytes) -> KernelSpec | None:
    """The spec whose kernel the CUBIN holds: the first of its symbols that parses as a
    kernel name (the kernels' functions are named by KernelSpec.name)."""
    for token in _SYMBOL_RE.findall(cubin):
        try:
            return KernelSpec.from_name(token.decode("ascii"))
        except SpecError:
            continue
    return None


def clear() -> tuple[int, list[str]]:
    """Empty the memory cache and remove sparsegen's entries from the disk cache; returns how
    many entries were removed and the paths left there (files sparsegen did not write)."""
    clear_memory()
    return _store().clear()
