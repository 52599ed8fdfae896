"""Layouts as plugins (issue 61): a layout in a package of its own, found through the
`sparsegen.layouts` entry point in a fresh process, nothing in sparsegen edited. The package is
docs/adding-a-layout.md's block-band layout with its imports of sparsegen made absolute and its
template in its own folder; its distribution is a dist-info folder on the path, as pip leaves
one. Every check runs in a subprocess that imports the checkout and the plugin."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_tutorial import KERNEL, tutorial_files

ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = "[sparsegen.layouts]\nband = band_layout.specs\n"


def as_plugin(path: str, body: str) -> tuple[str, str]:
    """A tutorial file's place and text in the package band_layout."""
    body = re.sub(r"^from \.\.(\w[\w.]*) import", r"from sparsegen.\1 import", body, flags=re.M)
    body = re.sub(r"^from \.\. import", "from sparsegen import", body, flags=re.M)
    body = body.replace('faces_module="face"))',
                        'faces_module="face",\n    package=__package__, templates=Path(__file__).parent / "templates"))')
    return path.replace("sparsegen/band/", "band_layout/").replace("templates/", "band_layout/templates/"), body


def install(site: Path, entry_points: str = ENTRY_POINTS) -> None:
    for path, body in tutorial_files().items():
        place, text = as_plugin(path, body)
        (site / place).parent.mkdir(parents=True, exist_ok=True)
        (site / place).write_text(text)
    (site / "band_layout" / "__init__.py").write_text("")
    info = site / "band_layout-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: band-layout\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def site(tmp_path) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    install(folder)
    return folder


def run(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]),
               SPARSEGEN_CACHE_DIR=str(site.parent / "cache"))
    return subprocess.run([sys.executable, *args], cwd=site.parent, env=env, capture_output=True, text=True,
                          timeout=600)


def test_an_installed_plugin_is_found_listed_built_and_run(site):
    shown = run(site, "-m", "sparsegen", "show", "--layouts")
    assert shown.returncode == 0, shown.stderr
    assert "band: plugin band_layout (band_dds)" in shown.stdout and "bsr: shipped" in shown.stdout
    listed = run(site, "-m", "sparsegen", "show", "--list", "--arch", "sm_90", "--layout", "band")
    assert KERNEL in listed.stdout.split(), listed.stderr
    done = run(site, "-c", "import torch, sparsegen\n"
               "layer = sparsegen.linear(320, 192, sparsity='block-band', block=(64, 64), rowblocks=2).double()\n"
               "x = torch.randn(5, 320, dtype=torch.float64)\n"
               "want = x @ layer.to_dense_weight().t() + layer.bias\n"
               "assert torch.allclose(layer(x), want), (layer(x) - want).abs().max()\n"
               "print(type(layer).__module__)")
    assert done.returncode == 0 and done.stdout.strip() == "band_layout.nn", done.stderr


def test_editing_a_plugins_template_makes_a_new_kernel(site):
    """The cache key covers a plugin's templates as it does the core's: an edit is compiled
    again, never served stale from the cache."""
    first = run(site, "-m", "sparsegen", "show", KERNEL)
    assert first.returncode == 0 and "compiled now" in first.stderr, first.stderr
    again = run(site, "-m", "sparsegen", "show", KERNEL)
    assert "from the cache" in again.stderr, again.stderr
    template = site / "band_layout" / "templates" / "band" / "band_dds.cu.j2"
    template.write_text(template.read_text() + "// edited by a researcher\n")
    edited = run(site, "-m", "sparsegen", "show", KERNEL)
    assert edited.returncode == 0 and "compiled now" in edited.stderr, edited.stderr
    assert "// edited by a researcher" in edited.stdout


def test_a_broken_plugin_is_named_and_breaks_nothing_else(site):
    (site / "band_layout-0.1.dist-info" / "entry_points.txt").write_text(
        ENTRY_POINTS + "broken = band_layout.missing_module\n")
    shown = run(site, "-m", "sparsegen", "show", "--layouts")
    assert shown.returncode == 1
    assert "band: plugin band_layout" in shown.stdout
    assert "broken: plugin not loaded - ModuleNotFoundError" in shown.stdout
    done = run(site, "-W", "error::UserWarning", "-c", "import torch, sparsegen\n"
               "print(sparsegen.linear(64, 32, block=(16, 16), density=0.5)(torch.randn(2, 64)).shape)")
    assert done.returncode == 0 and "torch.Size([2, 32])" in done.stdout, done.stderr
    assert "the layout plugin 'broken' (band_layout.missing_module) did not load" in done.stderr
