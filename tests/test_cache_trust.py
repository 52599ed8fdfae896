"""The cache trusts a directory or entry file as ssh trusts a key: only if nobody but the
user (or root) could have written it; a team directory only when named.

CI runs as root, which may chown: entries of "another user" are real files of uid 65534.
"""
import os
import stat

import pytest

from sparsegen.jit import cache
from sparsegen.launch import crossovers
from sparsegen import env
from sparsegen.bsr.specs import forward_spec
from sparsegen.jit.trust import UntrustedPathError

SPEC = forward_spec((16, 16), "bf16", 80)
OTHER_UID = 65534 if os.geteuid() != 65534 else 65533  # nobody (another uid where the suite runs as nobody)


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def built_entry():
    """Build SPEC into the user cache; its entry file and the cache directory."""
    built = cache.build(SPEC)
    cache.clear_memory()
    return env.cache_dir() / "kernels" / built.key, env.cache_dir()


def test_created_folders_are_0700_and_files_0600(tmp_path, monkeypatch):
    root = tmp_path / "a" / "b" / "cache"
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(root))
    old = os.umask(0o002)  # a permissive umask must not widen what sparsegen creates
    try:
        entry, _ = built_entry()
    finally:
        os.umask(old)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", root, root / "kernels", root / "aliases", root / "locks"):
        assert mode_of(folder) == 0o700, folder
    assert mode_of(entry) == 0o600
    assert not (root / "jinja").exists()  # no bytecode cache: jinja would run what it reads


@pytest.mark.parametrize("mode, problem", [(0o777, "writable by every user"), (0o770, "writable by its group"),
                                           (0o702, "writable by every user")])
def test_a_cache_directory_others_can_write_is_refused(mode, problem):
    _, root = built_entry()
    os.chmod(root, mode)
    with pytest.raises(UntrustedPathError, match=problem) as caught:
        cache.build(SPEC)
    message = str(caught.value)
    assert str(root) in message and "chmod" in message and caught.value.path == str(root)


@pytest.mark.parametrize("mode", [0o620, 0o606, 0o666])
def test_an_entry_file_others_can_write_is_refused(mode):
    entry, _ = built_entry()
    os.chmod(entry, mode)
    with pytest.raises(UntrustedPathError, match="writable by") as caught:
        cache.build(SPEC)
    assert caught.value.path == str(entry)


@pytest.mark.parametrize("what", ["directory", "entry"])
def test_a_cache_path_of_another_user_is_refused(what, owners):
    entry, root = built_entry()
    path = root if what == "directory" else entry
    owners.give(path, OTHER_UID, os.getgid())
    with pytest.raises(UntrustedPathError, match=f"uid {OTHER_UID}, not to you") as caught:
        cache.build(SPEC)
    assert caught.value.path == str(path)


def test_a_symbolic_link_where_an_entry_belongs_is_not_followed(tmp_path, nvrtc_calls):
    entry, _ = built_entry()
    elsewhere = tmp_path / "planted.cubin"
    elsewhere.write_bytes(entry.read_bytes())
    entry.unlink()
    entry.symlink_to(elsewhere)
    with pytest.warns(RuntimeWarning, match="cannot read the kernel cache entry"):
        assert cache.build(SPEC).compiled
    assert not entry.is_symlink()  # replaced by a real entry


def test_a_team_directory_named_in_the_variable_may_be_group_writable(tmp_path, monkeypatch, nvrtc_calls):
    team = tmp_path / "team"
    monkeypatch.setenv("SPARSEGEN_TEAM_CACHE_DIR", str(team))
    built = cache.build(SPEC)
    assert env.cache_dir() == team
    assert mode_of(team) == 0o2770 and mode_of(team / "kernels") == 0o2770
    assert mode_of(team / "kernels" / built.key) == 0o640
    os.chmod(team / "kernels" / built.key, 0o660)  # a teammate's group-writable entry
    cache.clear_memory()
    assert not cache.build(SPEC).compiled and nvrtc_calls == [SPEC.name]
    monkeypatch.delenv("SPARSEGEN_TEAM_CACHE_DIR")
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(team))  # the same folder, not named as a team's
    cache.clear_memory()
    with pytest.raises(UntrustedPathError, match="SPARSEGEN_TEAM_CACHE_DIR"):
        cache.build(SPEC)


def test_a_team_directory_writable_by_everyone_is_still_refused(tmp_path, monkeypatch):
    team = tmp_path / "team"
    monkeypatch.setenv("SPARSEGEN_TEAM_CACHE_DIR", str(team))
    cache.build(SPEC)
    cache.clear_memory()
    os.chmod(team, 0o777)
    with pytest.raises(UntrustedPathError, match="writable by every user"):
        cache.build(SPEC)


def test_team_entries_of_a_member_load_and_of_an_outsider_are_refused(tmp_path, monkeypatch, owners):
    team = tmp_path / "team"
    monkeypatch.setenv("SPARSEGEN_TEAM_CACHE_DIR", str(team))
    entry = team / "kernels" / cache.build(SPEC).key
    owners.give(entry, OTHER_UID, os.getegid())  # a teammate: another user in our group
    cache.clear_memory()
    assert not cache.build(SPEC).compiled
    outsider_gid = max(os.getgroups() + [os.getegid()]) + 1000
    owners.give(entry, OTHER_UID, outsider_gid)
    cache.clear_memory()
    with pytest.raises(UntrustedPathError, match="not to the team directory.s group"):
        cache.build(SPEC)


def test_a_crossover_table_others_can_write_is_ignored_with_a_warning(monkeypatch):
    """A table only steers kernel choice: an untrusted one is not read, and the model runs."""
    path = crossovers.user_table_path("Some GPU")
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_text('{"points": [{"layout": "sp24", "n": 64, "k": 64, "m": 1, "speedup": 0.5}]}')
    crossovers.reload()
    os.chmod(path, 0o666)
    try:
        with pytest.warns(RuntimeWarning, match="ignoring the crossover table .*crossovers.*writable by every user"):
            assert crossovers.table("Some GPU") == ()
    finally:
        crossovers.reload()
