"""Files of another user, for the trust tests: really (chown, as root, which CI is), or
simulated where the suite runs as an ordinary user - os.lstat, os.stat and os.fstat then report
the given owner for the given paths - so those tests run everywhere instead of skipping."""
import os

import pytest


class Owners:
    """give(path, uid, gid): `path` (itself, not what a link points to) belongs to uid:gid."""

    def __init__(self, monkeypatch):
        self.real = os.geteuid() == 0
        self._links, self._files = {}, {}
        if not self.real:
            for name, key in (("lstat", self._link_key), ("stat", self._file_key), ("fstat", self._fd_key)):
                monkeypatch.setattr(os, name, self._faked(getattr(os, name), key))

    def give(self, path, uid: int, gid: int | None = None) -> None:
        gid = os.getegid() if gid is None else gid
        if self.real:
            os.lchown(path, uid, gid)
            return
        self._links[os.path.abspath(path)] = (uid, gid)
        if not os.path.islink(path):
            self._files[os.path.realpath(path)] = (uid, gid)

    def _faked(self, real, key):
        def call(target, *args, **kwargs):
            info = real(target, *args, **kwargs)
            owner = key(target, args, kwargs)
            if owner is None:
                return info
            fields = list(info)
            fields[4:6] = owner
            return os.stat_result(fields)
        return call

    def _link_key(self, target, args, kwargs):
        return self._links.get(os.path.abspath(target)) if isinstance(target, (str, os.PathLike)) else None

    def _file_key(self, target, args, kwargs):
        if not isinstance(target, (str, os.PathLike)):
            return None
        table = self._links if kwargs.get("follow_symlinks") is False else self._files
        return table.get(os.path.abspath(target) if table is self._links else os.path.realpath(target))

    def _fd_key(self, fd, args, kwargs):
        return self._files.get(os.path.realpath(f"/proc/self/fd/{fd}"))


@pytest.fixture
def owners(monkeypatch) -> Owners:
    return Owners(monkeypatch)
