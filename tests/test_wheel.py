"""The wheel works on its own: built offline, installed into a fresh venv, run outside the repo
(the README's quickstart included).

It catches what tests of the checkout cannot: templates missing from the wheel, or
templates_dir() finding the checkout's instead of the installed ones.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# Never copied into the build: caches, build outputs and environments.
JUNK = (".git", ".venv", ".whl", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")

CHECK = """
import json, sysconfig
from pathlib import Path
import sparsegen
from sparsegen.jit import cache, codegen
from sparsegen.bsr import specs as spec

site = Path(sysconfig.get_paths()["purelib"]).resolve()
templates = codegen.templates_dir().resolve()
assert templates.is_relative_to(site), (templates, site)
assert Path(sparsegen.__file__).resolve().is_relative_to(site), sparsegen.__file__
import importlib, pkgutil
from sparsegen.jit import registry
from importlib.metadata import entry_points  # the shipped layouts declared as plugins are, and none failing
assert {e.name: e.value for e in entry_points(group=registry.ENTRY_POINTS)} == {
    name: f"sparsegen.{name}.specs" for name in registry.LAYOUTS}
assert registry.failed_plugins() == {} and [layout.name for layout in registry.layouts()] == list(registry.LAYOUTS)
for layout in registry.LAYOUTS:  # every registered layout's modules come from the wheel
    package = importlib.import_module(f"sparsegen.{layout}")
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"sparsegen.{layout}.{info.name}")
        assert Path(module.__file__).resolve().is_relative_to(site), module.__file__
built = cache.build(spec.forward_spec((32, 32), "bf16", 80))
assert built.compiled and built.cubin[:4] == b"\\x7fELF", built.cubin[:4]
# A kernel of every registered op compiles from the wheel's templates ...
for layout in registry.layouts():
    firsts = {}
    # (int8: the one-byte ops, sp24_quantize, have no bf16 kernel)
    for kernel in layout.default_specs(80, ("bf16", "int8"), None):
        firsts.setdefault(kernel.op, kernel)
    assert {rules.op for rules in layout.ops} <= set(firsts), (layout.name, sorted(firsts))
    for kernel in firsts.values():
        assert cache.build(kernel).cubin[:4] == b"\\x7fELF", kernel.name
# ... and every layer type runs forward on the CPU, against its dense weight.
import torch
from sparsegen.bell.nn import BlockEllLinear
x = torch.randn(3, 64)
for layer in (sparsegen.linear(64, 32, block=(16, 16), density=0.5), sparsegen.linear(64, 32, sparsity="2:4"),
              BlockEllLinear(64, 32, block=(16, 16), density=0.5),
              sparsegen.linear(64, 32, sparsity="block-diagonal", nblocks=2)):
    dense = sparsegen.dense_copy(layer)
    torch.testing.assert_close(layer(x), dense(x))
print(json.dumps({"templates": str(templates), "version": sparsegen.__version__}))
"""


def run(*argv, **kwargs):
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                            timeout=300, **kwargs)
    assert result.returncode == 0, f"{argv}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def build_wheel(tmp: Path) -> Path:
    """pip wheel on a copy of the checkout, so no build/ or egg-info lands in the repo.
    --no-build-isolation and --no-index: this environment's setuptools, no downloads."""
    source = tmp / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*JUNK))
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
        "-w", tmp / "dist", source)
    (wheel,) = (tmp / "dist").glob("sparsegen-*.whl")
    return wheel


def make_venv(folder: Path) -> Path:
    """A fresh venv that also sees this environment's packages (torch, NVRTC, ...).

    --system-site-packages only reaches the base interpreter's site-packages; when the
    tests run inside a venv (as in CI), a .pth file adds that venv's too: plain path lines
    for sys.path (they do not run the .pth files in that folder, so an editable install of
    the checkout stays inactive), and site.PREFIXES, where cuda-pathfinder looks for NVRTC.
    """
    run(sys.executable, "-m", "venv", "--system-site-packages", folder)
    python = folder / "bin" / "python"
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    paths = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    lines = [*paths, f"import site; site.PREFIXES.append({sys.prefix!r})"]
    (Path(site) / "outer_environment.pth").write_text("\n".join(lines) + "\n")
    return python


def clean_env(cache_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return env | {"SPARSEGEN_CACHE_DIR": str(cache_dir)}


def test_wheel_ships_templates_and_compiles_outside_the_repo(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    shipped = [*(REPO / "sparsegen").rglob("*.py"), *(REPO / "sparsegen").rglob("crossover_tables/*.json")]
    for module in sorted(shipped):  # every package of the checkout, and the GPUs' measured crossovers
        assert module.relative_to(REPO).as_posix() in names, module
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in metadata and "Description-Content-Type: text/markdown" in metadata
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    for template in sorted((REPO / "templates").rglob("*.*")):
        assert f"sparsegen/templates/{template.relative_to(REPO / 'templates').as_posix()}" in names
    python = make_venv(tmp_path / "venv")
    run(python, "-m", "pip", "install", "--no-deps", "--no-index", wheel)
    elsewhere, env = tmp_path / "elsewhere", clean_env(tmp_path / "cache")
    elsewhere.mkdir()
    # -I: neither the cwd nor PYTHONPATH nor user site-packages go on sys.path.
    report = json.loads(run(python, "-I", "-c", CHECK, cwd=elsewhere, env=env))
    assert not Path(report["templates"]).is_relative_to(REPO)
    # A new user's first step: the README's quickstart, verbatim, on the installed wheel.
    quickstart = re.search(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M).group(1)
    assert "relative difference" in run(python, "-I", "-c", quickstart, cwd=elsewhere, env=env)
    out = run(tmp_path / "venv" / "bin" / "sparsegen", "precompile", "--arch", "sm_80",
              "--dtype", "bf16", "--block", "32", cwd=elsewhere, env=env)
    # The console script works and finds, among others, the kernel the snippet compiled.
    assert int(re.search(r"(\d+) cached", out).group(1)) >= 1, out
