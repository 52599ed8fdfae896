"""The gate: every filesystem operation sparsegen performs on a path from a user, the
environment, a cache, a bundle or a checkpoint is a function here (tests/test_structure.py fails
on a call of open, mkdir, unlink, listdir... anywhere else, but for the few it lists with their
reasons); trust.py decides which paths these may touch (check_path, check_ancestors). How each
works where another local user might have been first: never through a link, never on a name it
did not create, modes set on the open file.

- create_file: O_CREAT | O_EXCL | O_NOFOLLOW, so a name someone planted (a file, a link to
  the user's ~/.netrc) makes the call fail instead of being written through; fchmod on the
  descriptor, never chmod on a path that may have been swapped since.
- replace_file: a new temporary file of our own, renamed over the entry (rename replaces a
  link itself, never what it points to).
- make_dir: mkdir (which fails on any existing name, links included), then the mode set on
  the directory opened with O_NOFOLLOW.
- read_regular: O_NOFOLLOW | O_NONBLOCK, then fstat: only a regular file (a FIFO would block
  forever, a device would never end) of at most `limit` bytes is read.
- parse_json: every JSON file sparsegen reads (tables, manifests, a checkpoint's config and
  index) goes through it: nesting at most MAX_JSON_DEPTH deep (checked before the parser, which
  would recurse), integers within int64, finite floats, no NaN or Infinity; anything else is a
  ValueError for the caller to turn into its documented outcome.
"""
from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def create_file(folder: Path, name: str, data: bytes, mode: int) -> Path:
    """A new file folder/name holding data with `mode`; an OSError if the name exists."""
    path = Path(folder) / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, mode)  # (the descriptor stays writable whatever the mode says)
        _write_all(fd, data)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def replace_file(folder: Path, name: str, data: bytes, mode: int) -> Path:
    """folder/name replaced atomically by a file holding data: readers see the old or the new."""
    temporary = create_file(folder, f".tmp-{secrets.token_hex(8)}", data, mode)
    try:
        os.replace(temporary, Path(folder) / name)
    except BaseException:
        os.unlink(temporary)
        raise
    return Path(folder) / name


def make_dir(path: Path, mode: int) -> None:
    """A new directory with exactly `mode` (the umask neither drops nor adds bits)."""
    os.mkdir(path, 0o700)
    set_dir_mode(path, mode)


def set_dir_mode(path: Path, mode: int) -> None:
    """A directory's mode, set on the directory opened without following a link."""
    fd = os.open(path, _DIRECTORY)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def read_regular(path: Path, limit: int, check=None, follow_links: bool = False) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, opened without following a link
    (follow_links: through links, for a user's own folders such as a checkpoint in the Hugging
    Face cache, whose files are links); check(path, stat) may refuse the opened file before
    anything is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW))
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes, over the {limit}-byte limit", str(path))
        if check is not None:
            check(path, info)
        data = handle.read(limit + 1)
    if len(data) > limit:  # (it grew while being read)
        raise OSError(errno.EFBIG, f"over the {limit}-byte limit", str(path))
    return data


MAX_JSON_DEPTH = 64  # far deeper than any file sparsegen reads; the parser recurses per level
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")
_INT64 = 1 << 63


def parse_json(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH):
    """The value of a JSON text, or ValueError: not UTF-8, not JSON, nested over max_depth,
    an integer outside int64, a float that is not finite (1e400), NaN or Infinity."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw  # (UnicodeDecodeError is a ValueError)
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
        if deepest > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant)


def _bounded_int(digits: str) -> int:
    if len(digits) > 20 or not -_INT64 <= int(digits) < _INT64:
        raise ValueError(f"an integer outside int64 in JSON: {digits[:24]}")
    return int(digits)


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"a number that is not finite in JSON: {text[:24]}")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} in JSON")


def make_temp_dir(prefix: str, parent: Path | None = None) -> Path:
    """A fresh folder of a new random name, made exclusively, 0700 (mkdtemp)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def list_names(folder: Path) -> list[str]:
    """The names in a folder, sorted (what is behind them is for the caller to judge)."""
    return sorted(os.listdir(folder))


def is_plain_file(path: Path) -> bool:
    """A regular file itself (lstat: a link to one is not)."""
    return stat.S_ISREG(os.lstat(path).st_mode)


def size_of(path: Path) -> int:
    """A file's size in bytes, 0 where it cannot be read."""
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def remove_file(path: Path) -> None:
    """Unlink a name (a link is removed itself, never what it points to)."""
    os.unlink(path)


def remove_empty_dir(path: Path) -> bool:
    """Remove a folder if it is empty; False where it is not (or is gone)."""
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


def open_lock(path: Path, mode: int = 0o600):
    """A lock file, opened for reading (all flock needs), never through a link; one this
    call creates gets `mode` (a team cache's 0640: teammates open it and share the lock)."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, mode)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_head(path: Path, size: int) -> bytes:
    """The first `size` bytes of a regular file, opened without following a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return handle.read(size)
