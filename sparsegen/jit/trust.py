"""Which cache directories and files sparsegen may read kernels from, checked as ssh checks keys.

A CUBIN read from disk runs on the GPU inside the user's process, and its checksum guards
against damage, not forgery. So a directory or file is used only if nobody but its owner
could have written it:
- owned by the current user (or root);
- not writable by group or others.
A team cache is opt-in: SPARSEGEN_TEAM_CACHE_DIR names a directory whose group the user
belongs to; its group may write, and entries may belong to any member but must carry the
directory's group. Nothing may be writable by others anywhere. Directories sparsegen
creates are 0700 (team: 2770, setgid, so teammates' entries keep the group).

A path that is a symbolic link is judged twice: the link itself (lstat: who made it) and
what it points to. A link another user planted, even one to the user's own folder, is
refused. Advice never asks anyone to weaken a directory they do not own (a shared /tmp).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from .. import env
from ..errors import SparsegenError
from . import private_files

PRIVATE_DIR_MODE, PRIVATE_FILE_MODE = 0o700, 0o600
MAX_READ_BYTES = 64 << 20  # a kernel, manifest or table is well under this
TEAM_DIR_MODE, TEAM_FILE_MODE = 0o2770, 0o640


class UntrustedPathError(SparsegenError):
    """A cache or bundle path that someone other than the user could have written. Not an
    OSError on purpose: the cache's fault handling (a full or read-only disk) must never
    swallow it."""

    def __init__(self, path, problem: str, fix: str):
        self.path, self.problem, self.fix = str(path), problem, fix
        super().__init__(f"Expected a cache path that only you can write. Got {path}: {problem}. "
                         f"Fix: {fix}. sparsegen loads nothing from it until then "
                         "(docs/trust-model.md).")


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
        raise UntrustedPathError(path, f"the {kind} is writable by every user", _fix_for_shared(path, info, team))
    if team:
        _check_team_member(path, info, kind)
        return
    if not _own(info):
        fix = ("remove it, or " if kind == "file" else "") + _ELSEWHERE
        raise UntrustedPathError(path, f"the {kind} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()})", fix)
    if info.st_mode & stat.S_IWGRP:
        raise UntrustedPathError(path, f"the {kind} is writable by its group (gid {info.st_gid})",
                                 f"chmod g-w {path}, or name it in SPARSEGEN_TEAM_CACHE_DIR to trust that group")


_ELSEWHERE = "point SPARSEGEN_CACHE_DIR at a new directory of your own (sparsegen creates it)"


def _own(info: os.stat_result) -> bool:
    return info.st_uid in (os.geteuid(), 0)


def _fix_for_shared(path: Path, info: os.stat_result, team: bool) -> str:
    """chmod only for a path the user owns and that is no shared scratch space (sticky)."""
    if not _own(info) or info.st_mode & stat.S_ISVTX:
        return _ELSEWHERE
    return f"chmod o-w {path}" + ("" if team else " (and g-w), or remove it")


def _check_team_member(path: Path, info: os.stat_result, kind: str) -> None:
    team_gid = os.stat(team_root()).st_gid
    if info.st_gid != team_gid:
        raise UntrustedPathError(path, f"the {kind} belongs to gid {info.st_gid}, not to the team directory's "
                                       f"group (gid {team_gid})", "chgrp it to the team's group, or remove it")
    if team_gid not in (*os.getgroups(), os.getegid()) and info.st_uid != os.geteuid():
        raise UntrustedPathError(path, f"the {kind} belongs to gid {info.st_gid}, a group you are not in",
                                 "ask to join the team's group, or unset SPARSEGEN_TEAM_CACHE_DIR")


def check_ancestors(path: Path, _links: int = 0) -> None:
    """Raise UntrustedPathError unless no one but the user (and root) can change what `path`
    names: walking its absolute form from /, every existing component up to path's parent is
    the user's or root's; a directory that others can write must be sticky (/tmp), and then
    the next component must be the user's or root's (a sticky folder's entries can be renamed
    by their owners only); a link is followed and its target walked the same way. Components
    inside the team cache are judged by the team's rules (check), not here. A missing
    component ends the walk: sparsegen creates the rest itself, with exact modes."""
    if _links > 40:  # (a cycle of links: the kernel stops at 40 too)
        raise UntrustedPathError(path, "too many levels of symbolic links", _ELSEWHERE)
    team, current = team_root(), Path(os.path.abspath(path))
    for ancestor in reversed(current.parents[:-1] if len(current.parents) > 1 else ()):
        if team is not None and ancestor.is_relative_to(team):
            return
        if not _walk_component(ancestor, _links):
            return


def _walk_component(component: Path, links: int) -> bool:
    """Check one component of an ancestor walk; False where it does not exist (yet)."""
    try:
        info = os.lstat(component)
    except FileNotFoundError:
        return False
    if not _own(info):
        raise UntrustedPathError(component, f"a folder above it belongs to uid {info.st_uid}, not to you "
                                            f"(uid {os.geteuid()}) or root, who could swap what is below", _ELSEWHERE)
    if stat.S_ISLNK(info.st_mode):
        check_ancestors(Path(os.path.realpath(component)) / "_", links + 1)  # (the target's own chain)
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX and not _group_is_mine(info):
        raise UntrustedPathError(component, "a folder above it is writable by others and not sticky, so anyone "
                                            "in its group could rename what is below", _ELSEWHERE)
    return True


def _group_is_mine(info: os.stat_result) -> bool:
    """A folder writable only by its owner's own group (user private groups: group and user of
    one name) or by nobody else: group write that lets no one else in."""
    if info.st_mode & stat.S_IWOTH:
        return False
    try:
        import grp
        import pwd

        group, user = grp.getgrgid(info.st_gid), pwd.getpwuid(os.geteuid())
    except (ImportError, KeyError):
        return False
    return info.st_uid == os.geteuid() and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def check_path(path: Path, kind: str = "directory") -> None:
    """check() on a path, after its ancestors (check_ancestors); a symbolic link is checked
    itself (who made it) and then what it points to (what is read and written)."""
    check_ancestors(path)
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and not (_own(link) or in_team_cache(path) and _team_link(link)):
        raise UntrustedPathError(path, f"it is a symbolic link made by uid {link.st_uid}, not by you", _ELSEWHERE)
    check(path, os.stat(path), kind)


def _team_link(link: os.stat_result) -> bool:
    return link.st_gid == os.stat(team_root()).st_gid


def read_file(path: Path) -> bytes:
    """A regular file's bytes (MAX_READ_BYTES at most), never through a link, after checking
    its folder and the file actually opened (fstat: no race with a rename)."""
    check_path(Path(path).parent)
    return private_files.read_regular(Path(path), MAX_READ_BYTES, lambda p, info: check(p, info, "file"))


def make_dirs(path: Path) -> None:
    """Create path and any missing parents with the cache's mode (0700, or 2770 in the team
    cache), set on the new directory itself, then check path."""
    missing = []
    probe = Path(path)
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        try:
            private_files.make_dir(folder, TEAM_DIR_MODE if in_team_cache(folder) else PRIVATE_DIR_MODE)
        except FileExistsError:  # another process made it first: checked below like any other
            continue
    check_path(path)


def make_parents(path: Path) -> None:
    """The folders above `path` that are missing, created 0700 whatever the umask, after and
    before checking the chain above them (check_ancestors): where sparsegen writes a file or
    folder of the user's choosing (a bundle, a tune table) outside the cache."""
    check_ancestors(path)
    nearest, missing = nearest_existing(path), []
    for probe in Path(os.path.abspath(path)).parents:
        if probe == nearest:
            break
        missing.append(probe)
    for folder in reversed(missing):
        private_files.make_dir(folder, PRIVATE_DIR_MODE)
    check_ancestors(path)


def nearest_existing(path: Path) -> Path:
    """The nearest folder above `path` that exists (what a new path below it is made in)."""
    probe = Path(os.path.abspath(path)).parent
    while not os.path.lexists(probe):
        probe = probe.parent
    return probe


def file_mode(folder: Path) -> int:
    return TEAM_FILE_MODE if in_team_cache(folder) else PRIVATE_FILE_MODE
