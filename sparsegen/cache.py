"""Two-level CUBIN cache: a dict in this process, diskcache on disk.

The key hashes the rendered source, the headers, NVRTC's version, the options and the
arch, so an edited template or a new compiler invalidates old entries by itself.
Entries carry a checksum: a damaged one is recompiled with a warning, never loaded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import warnings
from dataclasses import dataclass

from . import codegen, compiler, env
from .spec import KernelSpec

_MAGIC = b"SGCUBIN1"
_ALIAS = "alias:"  # disk entries mapping a spec's alias_key to the rendered source's key
_memory: dict[str, tuple[str, bytes]] = {}


@dataclass(frozen=True)
class Built:
    spec: KernelSpec
    key: str
    cubin: bytes
    compiled: bool  # False when it came from a cache


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def cache_key(source: str, headers: dict[str, str], target: str) -> str:
    return _digest(source, *headers.values(), compiler.nvrtc_version(), *compiler.options(target))


def _disk():
    import diskcache

    folder = env.cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return diskcache.Cache(str(folder / "cubins"))


def _seal(cubin: bytes) -> bytes:
    return _MAGIC + hashlib.sha256(cubin).digest() + cubin


def _unseal(blob) -> bytes | None:
    """The CUBIN inside a disk entry, or None if the entry is damaged."""
    if not isinstance(blob, bytes) or not blob.startswith(_MAGIC) or len(blob) < 40 + 8:
        return None
    digest, cubin = blob[8:40], blob[40:]
    return cubin if hashlib.sha256(cubin).digest() == digest else None


def _read_disk(disk, key: str, name: str) -> bytes | None:
    blob = disk.get(key)
    if blob is None:
        return None
    cubin = _unseal(blob)
    if cubin is None:
        warnings.warn(f"sparsegen: cache entry for {name} is damaged; recompiling it.",
                      RuntimeWarning, stacklevel=3)
        disk.delete(key)
    return cubin


@contextlib.contextmanager
def _build_lock(key: str):
    """One process builds a given kernel at a time; the others wait, then find it cached."""
    folder = env.cache_dir() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{key[:32]}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def alias_key(spec: KernelSpec) -> str:
    """Everything the rendered source and the CUBIN follow from, without rendering or loading
    NVRTC (together ~100 ms in a new process): the spec, the template files, and the
    installed versions of jinja2 and the compiler packages."""
    return _digest(repr(dataclasses.astuple(spec)), *codegen.template_texts(), *compiler.identity(),
                   *compiler.options(spec.target))


def build(spec: KernelSpec) -> Built:
    """The CUBIN for spec: from memory, else disk, else NVRTC (then stored in both)."""
    alias = alias_key(spec)
    if alias in _memory:
        return Built(spec, *_memory[alias], compiled=False)
    if env.disable_disk_cache():
        return _remember(alias, _compile(spec, *_source(spec)))
    with _disk() as disk:
        key = disk.get(_ALIAS + alias)
        cubin = _read_disk(disk, key, spec.name) if key else None
        built = Built(spec, key, cubin, False) if cubin is not None else _build_on_disk(disk, spec)
        if built.key != key:  # a write on every hit would cost a new process milliseconds
            disk.set(_ALIAS + alias, built.key)
    return _remember(alias, built)


def _source(spec: KernelSpec) -> tuple[str, dict[str, str], str]:
    source, headers = codegen.render(spec), codegen.headers()
    return source, headers, cache_key(source, headers, spec.target)


def _compile(spec: KernelSpec, source: str, headers: dict[str, str], key: str) -> Built:
    return Built(spec, key, compiler.compile_cubin(source, spec.name, spec.target, headers), True)


def _build_on_disk(disk, spec: KernelSpec) -> Built:
    """Look the rendered source's key up; compile under a lock only if it is missing."""
    source, headers, key = _source(spec)
    cubin = _read_disk(disk, key, spec.name)
    if cubin is not None:
        return Built(spec, key, cubin, compiled=False)
    with _build_lock(key):
        # Another process may have built it while we waited for the lock.
        cubin = _read_disk(disk, key, spec.name)
        if cubin is not None:
            return Built(spec, key, cubin, compiled=False)
        built = _compile(spec, source, headers, key)
        disk.set(key, _seal(built.cubin))
    return built


def _remember(alias: str, built: Built) -> Built:
    _memory[alias] = (built.key, built.cubin)
    return built


def clear_memory() -> None:
    _memory.clear()


def info() -> dict:
    """entries: compiled kernels on disk (the alias records that point at them not counted)."""
    folder = env.cache_dir()
    with _disk() as disk:
        kernels = sum(1 for key in disk.iterkeys() if not str(key).startswith(_ALIAS))
        return {"directory": str(folder), "entries": kernels, "bytes": disk.volume()}


def clear() -> int:
    """Empty the disk and memory caches; returns how many disk entries were removed."""
    clear_memory()
    count = info()["entries"]
    with _disk() as disk:
        disk.clear()
    return count
