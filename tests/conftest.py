"""Shared test setup: every test gets its own kernel cache, GPU tests skip without a GPU, and
a test skipped for any other reason fails (a missing test dependency must not hide a suite)."""
import json
import os
import subprocess

import pytest
import torch

import sparsegen.jit.bundle
import sparsegen.jit.cache
import sparsegen.jit.compiler
import sparsegen.jit.diskstore
import sparsegen.env
from sparsegen.launch import calls, crossovers, runtime
from sparsegen.bsr.specs import forward_spec

CACHE_SPEC = forward_spec((16, 16), "bf16", 80)  # the quickest default kernel to compile


def pytest_addoption(parser):
    parser.addoption("--all-kernels", action="store_true",
                     help="compile every default kernel in tests/test_compile.py (CI does), not one per code path")


def pytest_configure(config):
    if config.getoption("--all-kernels"):  # (read as test_compile.py is collected, in each xdist worker too)
        os.environ["SPARSEGEN_TEST_ALL_KERNELS"] = "1"


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """A fresh SPARSEGEN_CACHE_DIR and an empty in-memory cache for each test."""
    folder = tmp_path / "sparsegen-cache"
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(folder))
    monkeypatch.delenv("SPARSEGEN_DUMP_DIR", raising=False)
    monkeypatch.delenv("SPARSEGEN_NO_DISK_CACHE", raising=False)
    sparsegen.jit.cache.clear_memory()
    sparsegen.jit.diskstore._warned.clear()  # each test sees its own once-per-process warnings
    sparsegen.jit.bundle._load.cache_clear()
    sparsegen.env._shipped_kernels_folders.cache_clear()
    sparsegen.jit.bundle._arch_folders.cache_clear()
    yield folder
    sparsegen.jit.cache.clear_memory()


@pytest.fixture
def nvrtc_calls(monkeypatch):
    """Names of the kernels NVRTC compiles during the test."""
    calls, real = [], sparsegen.jit.compiler.compile_cubin

    def counting(source, name, arch, headers):
        calls.append(name)
        return real(source, name, arch, headers)

    monkeypatch.setattr(sparsegen.jit.compiler, "compile_cubin", counting)
    return calls


@pytest.fixture
def read_only_cache():
    """The cache directory, holding CACHE_SPEC, made read-only for real: chmod for a normal user;
    for root (whom modes do not stop) the immutable attribute, where the filesystem has it."""
    built = sparsegen.jit.cache.build(CACHE_SPEC)
    root = sparsegen.env.cache_dir()
    folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
    if os.geteuid() != 0:
        for folder in folders:
            os.chmod(folder, 0o500)
        yield built
        for folder in folders:
            os.chmod(folder, 0o700)
        return
    made = subprocess.run(["chattr", "+i", *map(str, folders)], capture_output=True, text=True)
    assert made.returncode == 0, f"root here cannot make a folder read-only (chattr +i: {made.stderr.strip()})"
    try:
        yield built
    finally:
        subprocess.run(["chattr", "-i", *map(str, folders)], check=True)


from skip_guard import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)
from ownership import owners  # noqa: F401,E402 (a fixture: files of another user, real or simulated)


# Tests that start processes of their own and take 10-60 s on the 2-core CI machine: run
# first, so that the two xdist workers do not end the suite on one of them while the other idles.
STARTED_FIRST = ("tests/test_distributed.py", "tests/test_bench_models.py", "tests/test_wheel.py",
                 "tests/test_bench_tp.py", "tests/test_cache_faults.py")


def pytest_collection_modifyitems(config, items):
    sample = os.environ.get("SPARSEGEN_TEST_SAMPLE")
    if sample:
        _keep_a_sample(config, items, int(sample))
    items.sort(key=lambda item: not item.nodeid.startswith(STARTED_FIRST))  # (stable: the rest keep their order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _keep_a_sample(config, items, per_function: int) -> None:
    """At most `per_function` cases of each parametrized test, spread evenly over its list (the
    first and last kept): tools/gpu_run.sh sanitize runs the slow tools on such a sample."""
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(item.nodeid.split("[")[0], []).append(item)
    kept = set()
    for group in groups.values():
        last, wanted = len(group) - 1, min(per_function, len(group))
        kept.update(id(group[round(i * last / max(wanted - 1, 1))]) for i in range(wanted))
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = [item for item in items if id(item) in kept]


@pytest.fixture(scope="session", autouse=True)
def kernel_log():
    """With SPARSEGEN_TEST_KERNEL_LOG=FILE, each kernel the session loads is named there as it
    loads (the sanitize step's record of what it covered, kept if a time limit stops it)."""
    path, real = os.environ.get("SPARSEGEN_TEST_KERNEL_LOG"), runtime.kernel
    if not path:
        yield
        return
    loaded = set()

    def logging_kernel(spec, device_index):
        if spec.name not in loaded:
            loaded.add(spec.name)
            with open(path, "a") as out:
                out.write(spec.name + "\n")
        return real(spec, device_index)

    runtime.kernel = logging_kernel
    yield
    runtime.kernel = real


@pytest.fixture
def dense_reference():
    """y = x W^T + b in float64, W rebuilt block by block from the layer's values and mask."""

    def reference(layer, x):
        bm, bk = layer.block
        weight = torch.zeros(layer.out_features, layer.in_features, dtype=torch.float64)
        for i, (r, c) in enumerate(layer.mask.nonzero().tolist()):
            weight[r * bm:(r + 1) * bm, c * bk:(c + 1) * bk] = layer.values[i].double()
        y = x.detach().double() @ weight.T
        return y if layer.bias is None else y + layer.bias.detach().double()

    return reference


@pytest.fixture
def graph_replay():
    """layer(x) captured as a CUDA graph after a warm-up call (kernels loaded, plans and
    dense copies made), then replayed on fresh values of x into a NaN-poisoned output."""
    def replay(layer, x):
        with torch.no_grad():
            layer(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = layer(x)
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        return y
    return replay


@pytest.fixture
def autocast_losses():
    """losses(model, in_features, out_features, steps=30): the MSE losses of `steps` AdamW
    steps under bf16 autocast on one fixed random batch (does a layer train at all)."""
    def losses(model, in_features, out_features, steps=30):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        x, target = torch.randn(512, in_features, device="cuda"), torch.randn(512, out_features, device="cuda")
        seen = []
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(loss.item())
        return seen
    return losses


@pytest.fixture
def weight_grad_draws():
    """draws(layer, x, dy, n): layer.weight.grad of n separate backward passes, stacked, in
    float64 (for the statistical checks of randomized gradients)."""
    def draws(layer, x, dy, n):
        grads = []
        for _ in range(n):
            layer.weight.grad = None
            layer(x).backward(dy)
            grads.append(layer.weight.grad.double())
        return torch.stack(grads)
    return draws


def _uniform_table(folder, monkeypatch, speedup: float):
    """A crossover table for this GPU in which every sparse kernel runs at `speedup` (GPU tests)."""
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(folder))
    monkeypatch.setenv("SPARSEGEN_DENSE_FALLBACK", "1")  # (the dense path is asked for)
    name = runtime.device_name(0)
    path = crossovers.user_table_path(name)
    path.parent.mkdir(parents=True)
    points = [dict(layout="sp24", n=1024, k=1024, m=64, speedup=speedup)]
    points += [dict(layout=layout, n=1024, k=1024, m=64, speedup=speedup, block=[b, b], density=0.5)
               for layout in ("bsr", "bell", "bdiag") for b in (16, 32, 64)]
    path.write_text(json.dumps(dict(gpu=name, points=points)))
    crossovers.reload()


@pytest.fixture
def losing_table(tmp_path, monkeypatch):
    """A crossover table for this GPU in which every sparse kernel loses (GPU tests)."""
    _uniform_table(tmp_path, monkeypatch, 0.5)
    yield
    crossovers.reload()


@pytest.fixture
def winning_table(tmp_path, monkeypatch):
    """A crossover table for this GPU in which every sparse kernel wins (GPU tests)."""
    _uniform_table(tmp_path, monkeypatch, 2.0)
    yield
    crossovers.reload()


@pytest.fixture
def dense_everywhere(losing_table, monkeypatch):
    """That table, and no call counted host-bound: eager calls take the dense path too."""
    monkeypatch.setattr(calls, "HOST_BOUND_FLOPS", 0)
