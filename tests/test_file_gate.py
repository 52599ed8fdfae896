"""The folders above a path sparsegen writes or reads (issue 59): trust.check_ancestors walks
every component from /, so a folder another user owns, or can write without the sticky bit, or a
link they made anywhere in the middle, is refused before anything is written - for the cache
(check_path), a bundle (precompile --bundle) and a tune table (tune --out) alike. The other
user is real where the suite runs as root (chown: CI), simulated otherwise (ownership.py)."""
import os
import stat
from pathlib import Path

import pytest

from sparsegen import tune
from sparsegen.errors import SparsegenError
from sparsegen.jit import bundle, cache, trust

OTHER = 2000


def shared(tmp_path: Path) -> Path:
    """A sticky folder everyone can write (as /tmp), root's."""
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    return folder


def theirs(owners, path: Path, mode: int = 0o755) -> Path:
    path.mkdir()
    os.chmod(path, mode)
    owners.give(path, OTHER, OTHER)
    return path


def test_a_bundle_below_another_users_folder_is_refused_before_compiling(tmp_path, owners):
    parent = theirs(owners, shared(tmp_path) / "x")
    assert not bundle.is_free(parent / "b")
    with pytest.raises(SparsegenError, match="a new directory for the bundle"):
        bundle.write(parent / "b", {"k": b"cubin"})
    with pytest.raises(trust.UntrustedPathError, match="belongs to uid 2000"):
        trust.make_parents(parent / "b")
    assert not (parent / "b").exists()


def test_a_tune_table_through_another_users_link_is_refused_and_the_target_kept(tmp_path, owners):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "authorized_keys").write_text("mine\n")
    link = shared(tmp_path) / "out"
    link.symlink_to(victim)
    owners.give(link, OTHER, OTHER)
    with pytest.raises(trust.UntrustedPathError, match="belongs to uid 2000"):
        tune.write_table(link / "authorized_keys", "{}", in_cache=False)
    assert (victim / "authorized_keys").read_text() == "mine\n"


def test_ones_own_link_in_the_middle_is_followed(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (tmp_path / "via").symlink_to(mine)
    tune.write_table(tmp_path / "via" / "deeper" / "table.json", "{}\n", in_cache=False)
    assert (mine / "deeper" / "table.json").read_text() == "{}\n"


@pytest.mark.parametrize("mode, refused", [(0o777, True), (0o775, True), (0o1777, False), (0o755, False)])
def test_a_folder_above_others_can_write_must_be_sticky(tmp_path, mode, refused, owners):
    above = tmp_path / "above"
    above.mkdir()
    os.chmod(above, mode)
    owners.give(above, os.geteuid(), OTHER)  # (a group with others in it, not the owner's own)
    if refused:
        with pytest.raises(trust.UntrustedPathError, match="writable by others and not sticky"):
            trust.check_ancestors(above / "below" / "file")
    else:
        trust.check_ancestors(above / "below" / "file")


def test_in_a_sticky_folder_the_next_component_must_be_ones_own(tmp_path, owners):
    theirs(owners, shared(tmp_path) / "planted", 0o700)
    with pytest.raises(trust.UntrustedPathError, match="belongs to uid 2000"):
        trust.check_ancestors(tmp_path / "shared" / "planted" / "cache")


def test_a_cache_below_another_users_link_builds_nothing(tmp_path, monkeypatch, nvrtc_calls, owners):
    mine = tmp_path / "mine"
    (mine / "cache" / "kernels").mkdir(parents=True)
    entry = mine / "cache" / "kernels" / ("ab" * 32)  # (the victim's file, named like an entry)
    entry.write_text("the victim's")
    link = shared(tmp_path) / "sgcache"
    link.symlink_to(mine)
    owners.give(link, OTHER, OTHER)
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(link / "cache"))
    cache.clear_memory()
    from sparsegen.bsr.specs import forward_spec
    with pytest.raises(trust.UntrustedPathError):
        cache.build(forward_spec((16, 16), "bf16", 80))
    with pytest.raises(trust.UntrustedPathError):
        cache.clear()
    assert entry.read_text() == "the victim's"


def test_new_parents_are_0700_whatever_the_umask(tmp_path):
    before = os.umask(0)
    try:
        tune.write_table(tmp_path / "a" / "b" / "t.json", "{}\n", in_cache=False)
        assert not bundle.is_free(tmp_path / "a" / "b" / "t.json" / "x")  # (under a file: nothing to write)
        bundle.write(tmp_path / "c" / "d" / "bundle", {})
    finally:
        os.umask(before)
    for folder in ("a", "a/b", "c", "c/d"):
        assert stat.S_IMODE(os.stat(tmp_path / folder).st_mode) == 0o700, folder


def test_clear_removes_only_files_holding_what_sparsegen_wrote_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(tmp_path / "cache"))
    cache.clear_memory()
    from sparsegen.bsr.specs import forward_spec
    built = cache.build(forward_spec((16, 16), "bf16", 80))
    kernels = tmp_path / "cache" / "kernels"
    (kernels / ("cd" * 32)).write_text("my notes, named like an entry\n")
    (kernels / ".tmp-0123456789abcdef").write_bytes(b"SGCU")  # (a write cut short: ours)
    removed, left = cache.clear()
    assert removed == 1 and not (kernels / built.key).exists() and not (kernels / ".tmp-0123456789abcdef").exists()
    assert (kernels / ("cd" * 32)).read_text() == "my notes, named like an entry\n"
    assert left == [f"{kernels / ('cd' * 32)} (its contents are not what sparsegen writes there)"]


def test_a_team_caches_build_locks_are_readable_by_the_team(tmp_path, monkeypatch):
    """Teammates open each other's lock files (0640) and so share the build lock (0600 ones
    they could not open: each built unlocked)."""
    monkeypatch.setenv("SPARSEGEN_TEAM_CACHE_DIR", str(tmp_path / "team"))
    cache.clear_memory()
    from sparsegen.bsr.specs import forward_spec
    cache.build(forward_spec((16, 16), "bf16", 80))
    locks = [tmp_path / "team" / "locks" / name for name in os.listdir(tmp_path / "team" / "locks")]
    assert locks and all(stat.S_IMODE(os.stat(lock).st_mode) == 0o640 for lock in locks)


def test_tune_out_is_judged_before_anything_is_measured(tmp_path, capsys, owners):
    """`sparsegen tune --out` below another user's folder, at a folder, or under a file: one
    line and exit status 2, before the GPU check (no measuring starts)."""
    from sparsegen.cli import main as cli_main

    (tmp_path / "a_file").write_text("")
    for out in (theirs(owners, shared(tmp_path) / "x") / "t.json", tmp_path, tmp_path / "a_file" / "t.json"):
        assert cli_main(["tune", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("sparsegen: error: Expected") and err.count("\n") == 1, err


def test_precompile_bundle_below_another_users_folder_is_refused_before_compiling(tmp_path, capsys, nvrtc_calls, owners):
    from sparsegen.cli import main as cli_main

    parent = theirs(owners, shared(tmp_path) / "x")
    assert cli_main(["precompile", "--arch", "sm_80", "--bundle", str(parent / "b")]) == 2
    assert nvrtc_calls == [] and "--bundle" in capsys.readouterr().err
