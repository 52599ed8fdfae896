"""Layouts as plugins (issue 61): a layout in a package of its own, found through the
`sparsegen.layouts` entry point in a fresh process, nothing in sparsegen edited. The package is
docs/adding-a-layout.md's block-band layout, built into a wheel and pip-installed into a
folder of its own (test_tutorial.install_plugin); its checks run in a subprocess that imports
the checkout and the plugin. Then the layer contract every layout's layers keep (in process)."""
import re
from pathlib import Path

import pytest

from test_tutorial import KERNEL, TEMPLATE, install_plugin, run

ENTRY_POINTS = "[sparsegen.layouts]\nband = band_layout.specs\n"


@pytest.fixture
def site(tmp_path) -> Path:
    return install_plugin(tmp_path)


def entry_points_file(site: Path) -> Path:
    path, = site.glob("band_layout-*.dist-info/entry_points.txt")
    return path


def test_pip_installed_the_tutorials_one_entry_point(site):
    assert re.sub(r"\s+", "", entry_points_file(site).read_text()) == re.sub(r"\s+", "", ENTRY_POINTS)


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
    template = site / TEMPLATE
    template.write_text(template.read_text() + "// edited by a researcher\n")
    edited = run(site, "-m", "sparsegen", "show", KERNEL)
    assert edited.returncode == 0 and "compiled now" in edited.stderr, edited.stderr
    assert "// edited by a researcher" in edited.stdout


def test_a_broken_plugin_is_named_and_breaks_nothing_else(site):
    entry_points_file(site).write_text(ENTRY_POINTS + "broken = band_layout.missing_module\n")
    shown = run(site, "-m", "sparsegen", "show", "--layouts")
    assert shown.returncode == 1
    assert "band: plugin band_layout" in shown.stdout
    assert "broken: plugin not loaded - ModuleNotFoundError" in shown.stdout
    done = run(site, "-W", "error::UserWarning", "-c", "import torch, sparsegen\n"
               "print(sparsegen.linear(64, 32, block=(16, 16), density=0.5)(torch.randn(2, 64)).shape)")
    assert done.returncode == 0 and "torch.Size([2, 32])" in done.stdout, done.stderr
    assert "the layout plugin 'broken' (band_layout.missing_module) did not load" in done.stderr


# ---- the layer contract (registry.check_layer), the same for shipped layouts and plugins ----

def test_every_shipped_face_makes_layers_that_keep_the_contract():
    import torch
    from torch import nn

    from sparsegen.jit import registry

    for face in registry.faces():  # by default, and with each argument's example (each layer type)
        layers = [face.make(128, 256, True, None, torch.float32, given)
                  for given in [{}] + [{name: value} for name, value, _ in face.examples]]
        if face.patch is not None:
            layers.append(face.make_patched(nn.Linear(128, 256), {"sparsity": face.sparsity}, True))
        for layer in layers:
            assert registry.check_layer(layer, face) is layer
            assert (layer.in_features, layer.out_features) == (128, 256)
            assert layer.to_dense_weight().shape == (256, 128) and layer.to_linear().weight.shape == (256, 128)


def test_a_layer_that_breaks_the_contract_is_refused_when_made_naming_what_it_lacks():
    import torch
    from torch import nn

    import sparsegen
    from sparsegen.jit import registry

    face = registry.Face("toy", ("density",), lambda i, o, bias, device, dtype, given: nn.Linear(i, o),
                         patch=lambda linear, settings, from_dense: linear)
    lacking = "Got Linear lacking to_dense_weight, to_linear, density \\(its face takes density=\\)"
    with pytest.raises(sparsegen.SpecError, match="sparsity='toy''s layer to be an nn.Module .* " + lacking):
        face.make(8, 4, True, None, torch.float32, {"density": 0.5})
    with pytest.raises(sparsegen.SpecError, match=lacking):
        face.make_patched(nn.Linear(8, 4), {"sparsity": "toy"}, True)
    with pytest.raises(sparsegen.SpecError, match="Got int lacking in_features, out_features, forward"):
        registry.Face("toy", (), lambda *args: 7).make(8, 4, True, None, torch.float32, {})


def test_layers_are_made_from_faces_only_through_the_contract_check():
    """sparsegen builds a layer from a face by Face.make / make_patched alone (a new path that
    called build or patch itself would skip the check)."""
    package = Path(__file__).resolve().parent.parent / "sparsegen"
    for path in package.rglob("*.py"):
        if path.name != "registry.py":
            assert not re.search(r"(FACES\[[^\]]*\]|face)\.(build|patch)\(", path.read_text()), path


def test_the_shipped_layouts_are_declared_as_plugins_are():
    """pyproject.toml names each shipped layout's specs module in the entry-point group, as a
    plugin's does; they load through those entries (made alike in a checkout with no installed
    metadata)."""
    import tomllib

    from sparsegen.jit import registry

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    declared = project["project"]["entry-points"][registry.ENTRY_POINTS]
    assert declared == {name: f"sparsegen.{name}.specs" for name in registry.LAYOUTS}


def test_shipped_layouts_load_through_entry_points_and_the_plugins_check(monkeypatch):
    """The shipped layouts load as plugins do (registry._load_entry: the entry's module must
    register a layout of the entry's name), a failure raising; another package's entry of a
    shipped name is never taken for ours."""
    from importlib import metadata

    from sparsegen.errors import SpecError
    from sparsegen.jit import registry

    assert [(e.name, e.value) for e in registry._shipped_entry_points()] == [
        (name, f"sparsegen.{name}.specs") for name in registry.LAYOUTS]
    foreign = metadata.EntryPoint("bsr", "elsewhere.specs", registry.ENTRY_POINTS)
    monkeypatch.setattr(metadata, "entry_points", lambda group: (foreign,))
    registry._shipped_entry_points.cache_clear()
    try:
        assert registry._shipped_entry_points()[0].value == "sparsegen.bsr.specs"
    finally:
        registry._shipped_entry_points.cache_clear()
    silent = metadata.EntryPoint("semi24-again", "sparsegen.semi24.specs", registry.ENTRY_POINTS)
    with pytest.raises(SpecError, match="register a layout named 'semi24-again'"):
        registry._load_entry(silent)
