"""The kernel cache on disk: one file per entry, read as raw bytes, written atomically.

Files, not a database: an entry is `<root>/<kind>/<key>`, and reading one is `os.read`, so
nothing read can run (diskcache unpickles whatever an entry says it holds). A write goes
to a private temporary file in the same folder and is renamed over the entry, so readers
see the old entry or the new one, never half of one, and two processes writing the same
key both leave a whole file. Every folder and file passes trust.check before it is read.

Faults never stop a build: a folder that cannot be written (read-only, full, deleted
under us) costs one warning per process and the kernel stays in memory.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
import warnings
from pathlib import Path

from . import private_files, trust

KERNELS, ALIASES, LOCKS = "kernels", "aliases", "locks"
LEGACY = ("cubins", "jinja")  # diskcache's folder and jinja's bytecode of earlier versions: never read
KEY_RE = re.compile(r"[0-9a-f]{64}")
LOCK_RE = re.compile(r"[0-9a-f]{32}\.lock")
TEMPORARY_RE = re.compile(r"\.tmp-[0-9a-f]{16}")  # private_files.replace_file's names
_OWN_NAMES = {KERNELS: KEY_RE, ALIASES: KEY_RE, LOCKS: LOCK_RE}
ENTRY_MAGIC = b"SGCUBIN1"  # what every kernel entry starts with (cache._seal)
LOCK_WAIT_S = 120.0  # a build lock held longer than this (a hung process) is ignored
_warned: set[tuple] = set()


def warn_once(what: tuple, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"sparsegen: {message}", RuntimeWarning, stacklevel=4)


class DiskStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def read(self, kind: str, key: str) -> bytes | None:
        """The entry's bytes; None when missing or unreadable. Raises UntrustedPathError for
        a folder or file someone else could have written."""
        folder = self.root / kind
        try:
            trust.check_path(self.root)
            return trust.read_file(folder / key)
        except FileNotFoundError:
            return None
        except OSError as error:  # unreadable, or a symbolic link where an entry belongs
            warn_once(("read", str(folder)), f"cannot read the kernel cache entry {folder / key} ({error}); "
                                             "recompiling it")
            return None

    def write(self, kind: str, key: str, data: bytes) -> bool:
        """Store the entry atomically; False (with one warning per process) where the disk
        refuses: the kernel then lives in this process's memory only."""
        folder = self.root / kind
        try:
            trust.make_dirs(folder)
            trust.check_path(self.root)
            _replace_atomically(folder, key, data)
            return True
        except OSError as error:
            warn_once(("write", str(self.root)), f"cannot write the kernel cache at {self.root} ({error}); "
                                                 "kernels compiled now stay in memory for this process")
            return False

    def delete(self, kind: str, key: str) -> None:
        with contextlib.suppress(OSError):
            private_files.remove_file(self.root / kind / key)

    def keys(self, kind: str) -> list[str]:
        folder = self.root / kind
        if not folder.is_dir():
            return []
        trust.check_path(folder)
        return [name for name in private_files.list_names(folder) if KEY_RE.fullmatch(name)]

    def volume(self, kind: str) -> int:
        return sum(private_files.size_of(self.root / kind / key) for key in self.keys(kind))

    def clear(self) -> tuple[int, list[str]]:
        """Remove the entries, aliases, locks and temporaries sparsegen writes - names it
        recognises holding what it writes there (_holds_ours), nothing else - and the folders
        they leave empty; keep crossover tables. Returns (entries removed, "PATH (why)" for
        each path left)."""
        removed, left = 0, []
        for kind, pattern in _OWN_NAMES.items():
            folder = self.root / kind
            if not os.path.isdir(folder) or os.path.islink(folder):
                continue
            trust.check_path(folder)
            for path in (folder / name for name in private_files.list_names(folder)):
                ours = pattern.fullmatch(path.name) or TEMPORARY_RE.fullmatch(path.name)  # (a write that died half-way)
                why = "not a name sparsegen writes" if not ours else _holds_ours(kind, path)
                if why:
                    left.append(f"{path} ({why})")
                    continue
                private_files.remove_file(path)
                removed += kind == KERNELS and not TEMPORARY_RE.fullmatch(path.name)  # (entries counted)
            private_files.remove_empty_dir(folder)  # (only if empty)
        left += [f"{self.root / name} (an earlier version's, never read)" for name in LEGACY
                 if os.path.lexists(self.root / name)]
        return removed, left

    @contextlib.contextmanager
    def build_lock(self, key: str):
        """One process builds a given kernel at a time; the others wait, then find it cached.
        flock dies with its process, so a killed builder leaves no stale lock; a hung one is
        waited for LOCK_WAIT_S at most. Where no lock file can be made, build unlocked."""
        handle = self._open_lock(key)
        if handle is None:
            yield
            return
        with handle:
            locked = _flock_within(handle, LOCK_WAIT_S)
            if not locked:
                warn_once(("lock", key), f"a build lock in {self.root / LOCKS} was held over {LOCK_WAIT_S:.0f} s; "
                                         "building without it")
            try:
                yield
            finally:
                if locked:
                    fcntl.flock(handle, fcntl.LOCK_UN)

    def _open_lock(self, key: str):
        folder = self.root / LOCKS
        try:
            trust.make_dirs(folder)
            return private_files.open_lock(folder / f"{key[:32]}.lock", trust.file_mode(folder))
        except OSError:
            return None  # read-only or full: the write that follows warns


def _holds_ours(kind: str, path: Path) -> str | None:
    """Why a file named as sparsegen names its own is not one it wrote, or None where it is:
    a regular file holding a kernel entry (its magic tag), an alias (64 hex digits) or a lock
    (empty). A temporary may be cut short: its start is judged."""
    try:
        if not private_files.is_plain_file(path):
            return "not a regular file"
        head = private_files.read_head(path, 64)
    except OSError as error:
        return f"unreadable: {error.strerror or error}"
    partial = TEMPORARY_RE.fullmatch(path.name) is not None
    if kind == KERNELS:
        ok = head.startswith(ENTRY_MAGIC) or partial and ENTRY_MAGIC.startswith(head)
    elif kind == ALIASES:
        ok = KEY_RE.fullmatch(head.decode("ascii", "replace")) is not None or partial and re.fullmatch(rb"[0-9a-f]*", head)
    else:
        ok = head == b""
    return None if ok else "its contents are not what sparsegen writes there"


def _flock_within(handle, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def _replace_atomically(folder: Path, name: str, data: bytes) -> None:
    private_files.replace_file(folder, name, data, trust.file_mode(folder))

