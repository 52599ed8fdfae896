"""Two-level CUBIN cache: a dict in this process, diskcache on disk.

The key hashes the rendered source, the headers, NVRTC's version, the options and the
arch, so an edited template or a new compiler invalidates old entries by itself.
Entries carry a checksum: a damaged one is recompiled with a warning, never loaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import warnings
from dataclasses import dataclass

from . import codegen, compiler, env
from .spec import KernelSpec

_MAGIC = b"SGCUBIN1"
_memory: dict[str, bytes] = {}


@dataclass(frozen=True)
class Built:
    spec: KernelSpec
    key: str
    cubin: bytes
    compiled: bool  # False when it came from a cache


def cache_key(source: str, headers: dict[str, str], target: str) -> str:
    h = hashlib.sha256()
    for part in (source, *headers.values(), compiler.nvrtc_version(), *compiler.options(target)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


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


def build(spec: KernelSpec) -> Built:
    """The CUBIN for spec: from memory, else disk, else NVRTC (then stored in both)."""
    source, headers = codegen.render(spec), codegen.headers()
    key = cache_key(source, headers, spec.target)
    if key in _memory:
        return Built(spec, key, _memory[key], compiled=False)
    if env.disable_disk_cache():
        return _remember(Built(spec, key, compiler.compile_cubin(source, spec.name, spec.target, headers), True))
    with _disk() as disk:
        cubin = _read_disk(disk, key, spec.name)
        if cubin is not None:
            return _remember(Built(spec, key, cubin, compiled=False))
        with _build_lock(key):
            # Another process may have built it while we waited for the lock.
            cubin = _read_disk(disk, key, spec.name)
            if cubin is not None:
                return _remember(Built(spec, key, cubin, compiled=False))
            cubin = compiler.compile_cubin(source, spec.name, spec.target, headers)
            disk.set(key, _seal(cubin))
    return _remember(Built(spec, key, cubin, compiled=True))


def _remember(built: Built) -> Built:
    _memory[built.key] = built.cubin
    return built


def clear_memory() -> None:
    _memory.clear()


def info() -> dict:
    folder = env.cache_dir()
    with _disk() as disk:
        return {"directory": str(folder), "entries": len(disk), "bytes": disk.volume()}


def clear() -> int:
    """Empty the disk and memory caches; returns how many disk entries were removed."""
    clear_memory()
    with _disk() as disk:
        count = len(disk)
        disk.clear()
    return count
