"""Which cache directories and files sparsegen may read kernels from, checked as ssh checks keys.

A CUBIN read from disk runs on the GPU inside the user's process, and its checksum guards
against damage, not forgery. So a directory or file is used only if nobody but its owner
could have written it:
- owned by the current user (or root);
- not writable by group or others.
A team cache is opt-in: SPARSEGEN_TEAM_CACHE_DIR names a directory whose group the user
belongs to; its group may write, and entries may belong to any member. Nothing may be
writable by others anywhere. Directories sparsegen creates are 0700 (team: 2770, setgid,
so teammates' entries keep the group).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from .. import env
from ..errors import SparsegenError

PRIVATE_DIR_MODE, PRIVATE_FILE_MODE = 0o700, 0o600
TEAM_DIR_MODE, TEAM_FILE_MODE = 0o2770, 0o640


class UntrustedPathError(SparsegenError):
    """A cache or bundle path that someone other than the user could have written. Not an
    OSError on purpose: the cache's fault handling (a full or read-only disk) must never
    swallow it."""

    def __init__(self, path, problem: str, fix: str):
        self.path, self.problem, self.fix = str(path), problem, fix
        super().__init__(f"Expected a cache path that only you can write. Got {path}: {problem}. "
                         f"Fix: {fix}. sparsegen loads nothing from it until then "
                         "(README: 'The cache's trust model').")


def team_root() -> Path | None:
    """The opt-in team cache directory (SPARSEGEN_TEAM_CACHE_DIR), resolved, or None."""
    named = env.team_cache_dir()
    return named.resolve() if named else None


def in_team_cache(path: Path) -> bool:
    team = team_root()
    return team is not None and Path(os.path.realpath(path)).is_relative_to(team)


def check(path: Path, info: os.stat_result, kind: str) -> None:
    """Raise UntrustedPathError unless `info` (path's stat) could only come from the user
    (or, in the team cache, from the team). kind: "directory" or "file"."""
    team = in_team_cache(path)
    if info.st_mode & stat.S_IWOTH:
        raise UntrustedPathError(path, f"the {kind} is writable by every user",
                                 f"chmod o-w {path}" + ("" if team else " (and g-w), or remove it"))
    if team:
        _check_team_member(path, info, kind)
        return
    if info.st_uid not in (os.geteuid(), 0):
        raise UntrustedPathError(path, f"the {kind} belongs to uid {info.st_uid}, not to you "
                                       f"(uid {os.geteuid()})",
                                 "remove it, or point SPARSEGEN_CACHE_DIR at a directory of your own")
    if info.st_mode & stat.S_IWGRP:
        raise UntrustedPathError(path, f"the {kind} is writable by its group (gid {info.st_gid})",
                                 f"chmod g-w {path}, or name it in SPARSEGEN_TEAM_CACHE_DIR to trust that group")


def _check_team_member(path: Path, info: os.stat_result, kind: str) -> None:
    if info.st_gid not in (*os.getgroups(), os.getegid()) and info.st_uid != os.geteuid():
        raise UntrustedPathError(path, f"the {kind} belongs to gid {info.st_gid}, a group you are not in",
                                 "chgrp it to the team's group, or remove it")


def check_path(path: Path, kind: str = "directory") -> None:
    """check() on a path's stat (symbolic links followed: what counts is what is read)."""
    check(path, os.stat(path), kind)


def read_file(path: Path, follow_links: bool = True) -> bytes:
    """A file's bytes, after checking the file actually opened (fstat: no race with a rename),
    and its folder."""
    check_path(Path(path).parent)
    flags = os.O_RDONLY | (0 if follow_links else os.O_NOFOLLOW)
    with os.fdopen(os.open(path, flags), "rb") as handle:
        check(path, os.fstat(handle.fileno()), "file")
        return handle.read()


def make_dirs(path: Path) -> None:
    """Create path and any missing parents with the cache's mode (0700, or 2770 in the team
    cache), then check path itself. chmod after mkdir: the umask may not drop bits we want
    kept, and must not add any."""
    missing = []
    probe = Path(path)
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:  # another process made it first
            continue
        os.chmod(folder, TEAM_DIR_MODE if in_team_cache(folder) else PRIVATE_DIR_MODE)
    check_path(path)


def file_mode(folder: Path) -> int:
    return TEAM_FILE_MODE if in_team_cache(folder) else PRIVATE_FILE_MODE
