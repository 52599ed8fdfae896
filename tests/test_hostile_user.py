"""A hostile second user on the same machine (issue 38's findings, one test each).

CI runs as root: a forked child drops to uid/gid 65534 (nobody) to do what an attacker can -
make folders in a shared, sticky directory (as /tmp is) and plant links and files there.
The victim (this process) then runs sparsegen, and each test checks that the victim's own
files and their modes are unchanged and that nothing of theirs was read or removed.
"""
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

from sparsegen.errors import SparsegenError
from sparsegen.cli import main as cli_main
from sparsegen import env
from sparsegen.jit import bundle, cache, codegen, compiler, trust
from sparsegen.jit.trust import UntrustedPathError
from sparsegen.bsr.specs import forward_spec
from sparsegen.launch import crossovers

ATTACKER = 65534  # nobody
SPEC = forward_spec((16, 16), "bf16", 80)
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root (CI runs as root)")


def as_attacker(action, *args) -> None:
    """Run action(*args) in a child process as uid/gid 65534; it must succeed."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(ATTACKER)
            os.setuid(ATTACKER)
            action(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker's step failed"


@pytest.fixture
def shared():
    """A world-writable sticky directory, as /tmp is."""
    folder = Path(tempfile.mkdtemp(prefix="sg-shared-", dir="/tmp"))
    os.chmod(folder, 0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def victim():
    """The victim's home: secrets and dotfiles with their modes, and a fingerprint of it all."""
    home = Path(tempfile.mkdtemp(prefix="sg-victim-"))
    (home / ".netrc").write_text("machine example login me password secret\n")
    os.chmod(home / ".netrc", 0o600)
    (home / ".bashrc").write_text("export PATH=$HOME/bin:$PATH\n")
    os.chmod(home / ".bashrc", 0o644)
    (home / "project").mkdir()
    (home / "project" / "notes.txt").write_text("mine\n")
    yield home
    shutil.rmtree(home, ignore_errors=True)


def fingerprint(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (stat.S_IMODE(os.lstat(p).st_mode), p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def plant_dir_with_links(folder: Path, links: dict) -> None:
    """(as the attacker) folder, open to all, holding links name -> target."""
    folder.mkdir()
    os.chmod(folder, 0o777)
    for name, target in links.items():
        os.symlink(target, folder / name)


def test_a_bundle_into_a_directory_another_user_made_is_refused(shared, victim, capsys):
    before = fingerprint(victim)
    target = shared / "bundle"
    as_attacker(plant_dir_with_links, target, {"manifest.json": str(victim / ".netrc"),
                                               f"{SPEC.name}.cubin": str(victim / ".bashrc")})
    assert cli_main(["precompile", "--arch", "sm_80", "--bundle", str(target)]) != 0  # (refused before compiling)
    assert "--bundle naming a new directory" in capsys.readouterr().err
    with pytest.raises(SparsegenError, match="a new directory for the bundle"):
        bundle.write(target, {SPEC.name: b"cubin"})
    assert fingerprint(victim) == before


def test_a_bundle_in_a_new_directory_cannot_be_planted_in(shared, victim):
    target = shared / "bundle"
    bundle.write(target, {SPEC.name: b"cubin bytes"})
    assert stat.S_IMODE(os.lstat(target).st_mode) == 0o555
    assert all(stat.S_IMODE(os.lstat(p).st_mode) == 0o444 for p in target.iterdir())
    before = fingerprint(victim)

    def plant():
        os.symlink(victim / ".netrc", target / "extra.json")

    with pytest.raises(AssertionError, match="attacker's step failed"):
        as_attacker(plant)
    assert fingerprint(victim) == before


def test_a_shared_dump_directory_with_planted_links_writes_nothing_through_them(shared, victim, monkeypatch):
    dumps = shared / "dumps"
    name = "bsr_dds_broken"
    as_attacker(plant_dir_with_links, dumps, {name: str(victim)})
    monkeypatch.setenv("SPARSEGEN_DUMP_DIR", str(dumps))
    before = fingerprint(victim)
    with pytest.warns(RuntimeWarning, match="not writing generated sources into"):
        written = compiler.dump_source(name, "// source\n", {".bashrc": "pwned\n", "sg_mma.cuh": "// header\n"})
    assert not str(written).startswith(str(dumps)) and written.read_text() == "// source\n"
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(written.parent).st_mode) == 0o700
    assert fingerprint(victim) == before
    shutil.rmtree(written.parent)


def test_a_private_dump_directory_gets_a_fresh_folder_per_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_DUMP_DIR", str(tmp_path / "dumps"))
    first = compiler.dump_source("k", "// one\n", {})
    second = compiler.dump_source("k", "// two\n", {})
    assert first.parent != second.parent and first.parent.parent == tmp_path / "dumps"
    assert first.read_text() == "// one\n" and second.read_text() == "// two\n"


def test_a_cache_dir_that_is_another_users_link_to_the_victims_folder_is_refused(shared, victim, monkeypatch):
    link = shared / "cache"
    as_attacker(os.symlink, str(victim / "project"), str(link))
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(link))
    before = fingerprint(victim)
    with pytest.raises(UntrustedPathError, match="symbolic link made by uid 65534"):
        cache.build(SPEC)
    assert fingerprint(victim) == before


def test_cache_clear_removes_only_what_sparsegen_wrote(victim, monkeypatch, capsys):
    project = victim / "project"
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(project))
    for folder in ("kernels", "locks"):
        (project / folder).mkdir(mode=0o700)
    (project / "kernels" / "my_kernel.cu").write_text("__global__ void k() {}\n")
    (project / "locks" / "notes.txt").write_text("mine\n")
    os.chmod(project, 0o700)
    built = cache.build(SPEC)
    assert (project / "kernels" / built.key).exists()
    assert cli_main(["cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 entries" in out and "left 2 paths sparsegen did not write" in out and "my_kernel.cu" in out
    assert (project / "kernels" / "my_kernel.cu").read_text() == "__global__ void k() {}\n"
    assert (project / "locks" / "notes.txt").read_text() == "mine\n"
    assert not (project / "kernels" / built.key).exists()


@pytest.fixture
def in_group_100():
    """The user in group 100 as well (root may set its groups): the team's group."""
    before = os.getgroups()
    os.setgroups(sorted({*before, 100}))
    yield
    os.setgroups(before)


def test_a_team_entry_must_carry_the_team_directorys_group(tmp_path, monkeypatch, in_group_100):
    team = tmp_path / "team"
    monkeypatch.setenv("SPARSEGEN_TEAM_CACHE_DIR", str(team))
    entry = team / "kernels" / cache.build(SPEC).key
    for path in [team, *team.rglob("*")]:  # (the team's group, as a setgid team directory gives it)
        os.chown(path, -1, 100)
    os.chown(entry, ATTACKER, 100)  # a teammate's entry, in the team's group: trusted
    cache.clear_memory()
    assert not cache.build(SPEC).compiled
    os.chown(entry, ATTACKER, os.getegid())  # a group of the user's, but not the directory's
    cache.clear_memory()
    with pytest.raises(UntrustedPathError, match="not to the team directory's group \\(gid 100\\)"):
        cache.build(SPEC)


def shipped_bundle(folder: Path) -> Path:
    bundle.write(folder, {SPEC.name: b"x" * 16})
    os.chmod(folder, 0o755)
    return folder


def test_a_bundle_path_that_is_another_users_link_is_refused(shared, tmp_path, monkeypatch):
    folder = shipped_bundle(tmp_path / "bundle")
    link = shared / "bundle"
    as_attacker(os.symlink, str(folder), str(link))
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", str(link))
    bundle._load.cache_clear()
    with pytest.raises(UntrustedPathError, match="symbolic link made by uid 65534"):
        bundle.lookup(SPEC, "0" * 64)
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", str(folder))  # the same bundle, named directly: trusted
    bundle._load.cache_clear()
    assert bundle.lookup(SPEC, "0" * 64) == b"x" * 16


@pytest.mark.parametrize("swap", ["huge", "fifo", "link"])
def test_bundle_reads_are_bounded_regular_files_not_followed(tmp_path, victim, monkeypatch, swap):
    folder = shipped_bundle(tmp_path / "bundle")
    entry = folder / f"{SPEC.name}.cubin"
    entry.unlink()
    if swap == "huge":
        with open(entry, "wb") as handle:
            handle.truncate(trust.MAX_READ_BYTES + 1)  # (sparse: no disk used)
    elif swap == "fifo":
        os.mkfifo(entry)
    else:
        os.symlink(victim / ".netrc", entry)
    monkeypatch.setenv("SPARSEGEN_KERNEL_BUNDLE", str(folder))
    bundle._load.cache_clear()
    code = subprocess.run([sys.executable, "-c", "import sparsegen.jit.bundle as b, sparsegen.jit.spec as s;"
                           f"print(b.lookup(s.KernelSpec.from_name({SPEC.name!r}), '0' * 64))"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))
    assert code.returncode == 0 and code.stdout.strip() == "None", code.stderr
    assert "cannot read" in code.stderr


def test_without_a_home_directory_sparsegen_caches_privately_and_warns_once(monkeypatch):
    script = ("import os, pwd, warnings\n"
              "os.environ.pop('HOME', None); os.environ.pop('XDG_CACHE_HOME', None)\n"
              "os.environ.pop('SPARSEGEN_CACHE_DIR', None)\n"
              "def nobody(uid): raise KeyError(uid)\n"
              "pwd.getpwuid = nobody\n"
              "warnings.simplefilter('always')\n"
              "from sparsegen import env\n"
              "from sparsegen.launch import crossovers\n"
              "first, second = env.cache_dir(), env.cache_dir()\n"
              "assert first == second and oct(os.stat(first).st_mode & 0o777) == '0o700', first\n"
              "print(len(crossovers.table('NVIDIA H100 80GB HBM3')) > 0, first)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True /tmp/sparsegen-cache-")
    assert done.stderr.count("no home directory to keep kernels in") == 1
    shutil.rmtree(done.stdout.split()[1], ignore_errors=True)


def test_a_tune_table_written_under_a_group_writable_umask_is_trusted(monkeypatch):
    from sparsegen import tune
    path = crossovers.user_table_path("Some GPU")
    old = os.umask(0o002)
    try:
        tune.write_table(path, json.dumps({"points": [dict(layout="sp24", n=64, k=64, m=1, speedup=0.5)]}), True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    crossovers.reload()
    try:
        assert len(crossovers.table("Some GPU")) == 1
    finally:
        crossovers.reload()


def test_advice_never_says_to_weaken_a_shared_directory(shared, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(shared))
    with pytest.raises(UntrustedPathError) as caught:
        cache.build(SPEC)
    assert "chmod" not in str(caught.value) and "point SPARSEGEN_CACHE_DIR at a new directory" in str(caught.value)
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", "/tmp")
    with pytest.raises(UntrustedPathError) as caught:
        cache.build(SPEC)
    assert "chmod" not in str(caught.value)


# ---- issue 59's findings: every verb that reads, writes or deletes, below what the attacker made ----

def entry_lookalikes(folder: Path) -> None:
    """The victim's own files, named as cache entries, locks and unfinished writes are."""
    for sub, name in (("kernels", "ab" * 32), ("locks", "cd" * 16 + ".lock"), ("kernels", ".tmp-" + "ef" * 8)):
        (folder / sub).mkdir(exist_ok=True)
        (folder / sub / name).write_text("the victim's\n")


def test_a_bundle_below_a_folder_the_attacker_made_writes_nothing(shared, victim, capsys, nvrtc_calls):
    """Finding 1: --bundle /tmp/x/b with /tmp/x the attacker's (who could swap b for a link
    into the victim's home mid-write): refused before compiling, by both the CLI and bundle.write."""
    parent = shared / "x"
    as_attacker(plant_dir_with_links, parent, {"b": str(victim)})
    before = fingerprint(victim)
    assert cli_main(["precompile", "--arch", "sm_80", "--bundle", str(parent / "b")]) == 2
    assert nvrtc_calls == [] and "--bundle" in capsys.readouterr().err
    with pytest.raises(SparsegenError, match="a new directory for the bundle"):
        bundle.write(parent / "b", {SPEC.name: b"cubin"})
    assert fingerprint(victim) == before


@pytest.mark.parametrize("verb", [["cache", "clear"], ["cache", "info"]])
def test_cache_verbs_through_the_attackers_link_touch_nothing(shared, victim, monkeypatch, capsys, verb):
    """Finding 2: SPARSEGEN_CACHE_DIR a link the attacker made to the victim's project, which
    holds files named like entries: clear and info refuse it as a build does (exit 2)."""
    entry_lookalikes(victim / "project")
    link = shared / "sgcache"
    as_attacker(os.symlink, str(victim / "project"), str(link))
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(link))
    before = fingerprint(victim)
    assert cli_main(verb) == 2
    assert "Expected a cache path that only you can write" in capsys.readouterr().err
    assert fingerprint(victim) == before


def test_tune_out_through_the_attackers_middle_link_is_refused(shared, victim, capsys):
    """Finding 3: `tune --out /tmp/out/authorized_keys` with /tmp/out the attacker's link to the
    victim's ~/.ssh: refused before measuring (exit 2), the key file unchanged."""
    (victim / ".ssh").mkdir(mode=0o700)
    (victim / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAA the victim's key\n")
    as_attacker(os.symlink, str(victim / ".ssh"), str(shared / "out"))
    before = fingerprint(victim)
    assert cli_main(["tune", "--out", str(shared / "out" / "authorized_keys")]) == 2
    assert capsys.readouterr().err.startswith("sparsegen: error:")
    assert fingerprint(victim) == before


def test_a_cache_dir_below_the_attackers_middle_link_builds_and_clears_nothing(shared, victim, monkeypatch):
    """Finding 6: a link as a middle component of SPARSEGEN_CACHE_DIR, made by the attacker."""
    entry_lookalikes(victim / "project")
    as_attacker(os.symlink, str(victim), str(shared / "via"))
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(shared / "via" / "project"))
    before = fingerprint(victim)
    for action in (lambda: cache.build(SPEC), cache.clear, cache.info):
        with pytest.raises(UntrustedPathError, match="uid 65534"):
            action()
    assert fingerprint(victim) == before


def test_under_umask_000_the_folders_sparsegen_makes_keep_the_attacker_out(shared):
    """Finding 6: the new parents of --bundle and --out are 0700 whatever the umask, so the
    attacker cannot plant in them (with the umask's 0777 they could)."""
    from sparsegen import tune

    mine = shared / "mine"
    before = os.umask(0)
    try:
        tune.write_table(mine / "tables" / "h200.json", "{}\n", in_cache=False)
        bundle.write(mine / "kernels" / "bundle", {SPEC.name: b"cubin"})
    finally:
        os.umask(before)

    def plant(folder):
        (folder / "planted").write_text("x")

    for folder in (mine, mine / "tables", mine / "kernels"):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder
        with pytest.raises(AssertionError, match="attacker's step failed"):
            as_attacker(plant, folder)
        assert not (folder / "planted").exists()


def test_a_team_cache_below_the_attackers_link_builds_nothing(shared, victim, monkeypatch):
    """SPARSEGEN_TEAM_CACHE_DIR is judged as the private cache is: a link the attacker made in
    its middle is refused, and nothing lands in the folder it points to."""
    (victim / "team").mkdir(mode=0o770)
    as_attacker(os.symlink, str(victim), str(shared / "via"))
    monkeypatch.setenv("SPARSEGEN_TEAM_CACHE_DIR", str(shared / "via" / "team"))
    before = fingerprint(victim)
    with pytest.raises(UntrustedPathError, match="uid 65534"):
        cache.build(SPEC)
    assert fingerprint(victim) == before


def test_a_kernels_package_another_user_planted_on_the_path_is_skipped(shared, monkeypatch):
    """A sparsegen_kernels package in a folder on sys.path that someone else made (the working
    directory in a shared folder): never loaded, and no error stops the victim's build."""
    entry = {"cubin": hashlib.sha256(b"not a kernel").hexdigest(), "source": bundle.source_digest(SPEC),
             "origin": bundle.origin_digest(SPEC, codegen.generator_texts())}  # (current: only trust stops it)

    def plant(root: Path) -> None:
        arch = root / env.SHIPPED_KERNELS_PACKAGE / "sm_80"
        arch.mkdir(parents=True)
        (arch / f"{SPEC.name}.cubin").write_bytes(b"not a kernel")
        (arch / "manifest.json").write_text(json.dumps({"format": bundle.FORMAT, "nvrtc": "13.0",
                                                        "kernels": {SPEC.name: entry}}))
    as_attacker(plant, shared)
    monkeypatch.syspath_prepend(str(shared))
    assert bundle.folders() == [shared / env.SHIPPED_KERNELS_PACKAGE / "sm_80"]
    with pytest.warns(RuntimeWarning, match="ignoring the installed kernels in .* uid 65534"):
        built = cache.build(SPEC)
    assert built.compiled and built.cubin != b"not a kernel"
