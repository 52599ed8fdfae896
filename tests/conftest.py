"""Shared test setup: every test gets its own kernel cache, and GPU tests skip without a GPU."""
import pytest
import torch

import sparsegen.cache


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """A fresh SPARSEGEN_CACHE_DIR and an empty in-memory cache for each test."""
    folder = tmp_path / "sparsegen-cache"
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(folder))
    monkeypatch.delenv("SPARSEGEN_DUMP_DIR", raising=False)
    monkeypatch.delenv("SPARSEGEN_NO_DISK_CACHE", raising=False)
    sparsegen.cache.clear_memory()
    yield folder
    sparsegen.cache.clear_memory()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


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
