"""docs/adding-a-layout.md, followed to the letter: its code blocks, written where their
info strings say, are a package of its own (a plugin: pyproject.toml with one entry point),
built into a wheel and installed with pip into a folder of its own - nothing in sparsegen
edited. In a fresh process that imports the checkout and the installed plugin, the layout
renders, compiles (NVRTC, no GPU), precompiles (--layout), is built by sparsegen.linear
through its face, runs a CPU forward and backward equal to float64 math written out here,
takes patch rules and trains compiled; a broken template makes `sparsegen show` print the
NVRTC log."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNEL = "band_dds_b64x64_bf16_nt_sm90a_pingpong_t256w8x1s5"
TEMPLATE = Path("band_layout/templates/band/band_dds.cu.j2")


def tutorial_files() -> dict[str, str]:
    section = (ROOT / "docs" / "adding-a-layout.md").read_text()
    return {path: body for path, body in re.findall(r"```\w+ (\S+)\n(.*?)```", section, re.S)}


def install_plugin(root: Path, files: dict[str, str] | None = None) -> Path:
    """The tutorial's project written out under root/project, built into a wheel (offline:
    this environment's setuptools) and pip-installed into root/site, which is returned."""
    project = root / "project"
    for path, body in (files or tutorial_files()).items():
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(body)
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", root / "dist", project)
    pip("install", "--no-deps", "--no-index", "--target", root / "site", *(root / "dist").glob("band_layout-*.whl"))
    return root / "site"


def pip(*argv) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *map(str, argv)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return install_plugin(tmp_path_factory.mktemp("tutorial"))


def run(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]),
               SPARSEGEN_CACHE_DIR=str(site.parent / "cache"))
    return subprocess.run([sys.executable, *args], cwd=site.parent, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_tutorial_names_its_files_and_its_package_stays_small():
    """Issue 41's bound on a new row-policy layout: at most 120 lines of Python in its package."""
    files = tutorial_files()
    assert set(files) == {"pyproject.toml", "band_layout/__init__.py", "band_layout/specs.py", str(TEMPLATE),
                          "band_layout/ops.py", "band_layout/nn.py", "band_layout/face.py"}
    assert sum(len(body.splitlines()) for path, body in files.items() if path.endswith(".py")) <= 120
    assert [line for line in files["pyproject.toml"].splitlines() if "=" in line and "band_layout." in line] == \
        ['band = "band_layout.specs"']  # its one entry point


def test_show_renders_and_compiles_the_tutorial_kernel(site):
    done = run(site, "-m", "sparsegen", "show", KERNEL)
    assert done.returncode == 0, done.stderr
    assert "(r + blk) % gridcols" in done.stdout and "compiled for sm_90a" in done.stderr
    assert "int M, int K, int N, int w_rows, int rowblocks, int gridcols)" in done.stdout


def test_the_layouts_own_check_refuses_a_spec_by_name(site):
    """The tutorial's `check` runs after the kit's: a band of oblong blocks is refused."""
    done = run(site, "-m", "sparsegen", "show", KERNEL.replace("b64x64", "b64x32"))
    assert done.returncode != 0
    assert "Expected square blocks (a band steps one block down, one across). Got (64, 32)." in done.stderr, \
        done.stderr


def test_precompile_builds_it_and_layer_matches_float64(site):
    script = r'''
import torch, sparsegen, band_layout
from sparsegen.jit import spec
from band_layout.nn import BandLinear
assert sparsegen.__file__.startswith(%r), sparsegen.__file__
assert band_layout.__file__.startswith(%r), band_layout.__file__
assert any(s.op == "band_dds" for s in spec.default_specs(80))
torch.manual_seed(0)
layer = sparsegen.linear(320, 192, sparsity="block-band", block=(64, 64), rowblocks=2).double()
assert type(layer) is BandLinear
try:
    sparsegen.linear(320, 192, sparsity="block-band", density=0.5)
    raise SystemExit("an argument the face does not take was accepted")
except sparsegen.InputError as error:
    assert "density" in str(error), error
weight = torch.zeros(192, 320, dtype=torch.float64)
for r in range(3):
    for j in range(2):
        c = (r + j) %% 5
        weight[r * 64:(r + 1) * 64, c * 64:(c + 1) * 64] = layer.values[r, j].detach()
x = torch.randn(3, 7, 320, dtype=torch.float64, requires_grad=True)
y = layer(x)
assert torch.allclose(y, x @ weight.t() + layer.bias), "forward"
y.square().sum().backward()
assert torch.allclose(x.grad, (2 * y.detach()) @ weight), "dX"
dweight = (2 * y.detach()).reshape(-1, 192).t() @ x.detach().reshape(-1, 320)
for r in range(3):
    for j in range(2):
        c = (r + j) %% 5
        assert torch.allclose(layer.values.grad[r, j], dweight[r * 64:(r + 1) * 64, c * 64:(c + 1) * 64]), "dW"
print("ok")
''' % (str(ROOT), str(site))
    done = run(site, "-c", script)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    built = run(site, "-m", "sparsegen", "precompile", "--arch", "sm_80", "--dtype", "bf16", "--layout", "band")
    assert built.returncode == 0 and "precompile sm_80: 2 kernels" in built.stdout, built.stdout + built.stderr
    tuned = run(site, "-m", "sparsegen", "tune", "--quick", "--layout", "band", "--out", str(site.parent / "band.json"))
    assert "layouts among" not in tuned.stderr and ("needs a CUDA GPU" in tuned.stderr or tuned.returncode == 0), \
        tuned.stderr


def test_the_shared_argument_tests_take_the_plugin_from_its_examples(site):
    """tests/test_arguments.py, run where the plugin is installed, reads the band's arguments
    from its face's examples: each changes the layer, and every other layout refuses them; and
    test_codegen's golden files stay sparsegen's own (the plugin installed changes none)."""
    codegen = run(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_codegen.py"))
    assert codegen.returncode == 0, codegen.stdout[-3000:]
    done = run(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_arguments.py"),
               "-k", "block-band or rowblocks")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    ran = int(re.search(r"(\d+) passed", done.stdout).group(1))
    assert ran >= 8 and "block-band-rowblocks" in run(site, "-m", "pytest", "-q", "--collect-only",
                                                       str(ROOT / "tests" / "test_arguments.py")).stdout


def test_patch_rules_and_compiled_training_reach_the_tutorial_layout(site):
    """The band's face takes patch rules (the kit's face_patch keeps the dense weights at its
    blocks), and a compiled fullgraph training step gives eager's gradients."""
    script = r'''
import torch, sparsegen
from band_layout.nn import BandLinear
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
dense = [m.weight.detach().clone() for m in (model[0], model[2])]
names = sparsegen.patch(model, {r"0|2": {"sparsity": "block-band", "block": (32, 32), "rowblocks": 2}}, fuse=False)
assert names == ["0", "2"] and all(type(model[i]) is BandLinear for i in (0, 2)), model
for layer, weight in zip((model[0], model[2]), dense):
    kept = layer.to_dense_weight().detach()
    assert torch.equal(kept[kept != 0], weight[kept != 0]), "from_dense keeps the weights at the band"
x = torch.randn(5, 256, requires_grad=True)
grads = []
for run in (model, torch.compile(model, fullgraph=True)):
    run(x).square().sum().backward()
    grads.append([t.grad.clone() for t in (x, model[0].values, model[2].values)])
    x.grad = None
    model.zero_grad(set_to_none=True)
for eager, compiled in zip(*grads):
    torch.testing.assert_close(compiled, eager)
print("ok")
'''
    done = run(site, "-c", script)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.gpu
def test_the_tutorial_layout_trains_on_its_kernels_on_the_gpu(site):
    """On the GPU the band's forward is its generated kernel and dW the kit's sampled kernel,
    a row's blocks wrapping past the last column (not in column order): outputs and gradients,
    eager and compiled, against float64."""
    script = r'''
import torch, sparsegen
from band_layout import ops
torch.manual_seed(0)
layer = sparsegen.linear(512, 384, sparsity="block-band", block=(64, 64), rowblocks=3, device="cuda",
                         dtype=torch.bfloat16)
x = torch.randn(333, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(333, 384, device="cuda", dtype=torch.bfloat16)
x64, v64 = x.detach().double().requires_grad_(), layer.values.detach().double().requires_grad_()
want = ops.reference(x64, v64, layer.bias.detach().double(), 3, 8, 384)
want.backward(dy.double())
error = lambda got, ref: ((got.double() - ref).norm() / ref.norm()).item()
for run in (layer, torch.compile(layer, fullgraph=True)):
    y = run(x)
    y.backward(dy)
    errors = error(y.detach(), want.detach()), error(x.grad, x64.grad), error(layer.values.grad, v64.grad)
    assert max(errors) < 2e-2, errors
    x.grad = layer.values.grad = layer.bias.grad = None
print("ok")
'''
    done = run(site, "-c", script)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.gpu
def test_the_benchmark_times_the_tutorial_layout_with_no_edit(site, tmp_path):
    """tools/bench.py --layout finds the band by its face's tuning points."""
    done = run(site, str(ROOT / "tools" / "bench.py"), "--layout", "band", "--json", str(tmp_path / "band.json"))
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 8192, 4096, 11008 | 64x64")]
    assert rows and "x |" in rows[0], done.stdout


def test_a_broken_template_shows_the_nvrtc_log(site, tmp_path):
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    template = broken / TEMPLATE
    template.write_text(template.read_text().replace("(r + blk) %", "(r + blk) %% undeclared_name +"))
    done = run(broken, "-m", "sparsegen", "show", KERNEL)
    assert done.returncode == 1
    assert "NVRTC log" in done.stderr and "undeclared_name" in done.stderr
    assert "Generated source written to" in done.stderr
