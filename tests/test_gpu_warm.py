"""Kernels warmed by patch() on the GPU: once the background builds finish, a patched gated
MLP and its one-byte, 4-bit, block-sparse and block-ELL twins run decode, small-batch and prefill forwards without compiling
anything more, and compute what they computed before (pytest -m gpu)."""
import threading

import pytest
import torch
from torch import nn

import sparsegen
from sparsegen.jit import cache, compiler
from sparsegen.semi24 import dispatch, format as semi24, tensor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(256, 384), nn.Linear(256, 384), nn.Linear(384, 256)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_a_cold_patch_packs_without_waiting_for_nvrtc_and_packs_the_same_bits(dtype, monkeypatch, tmp_path):
    """Until the sp24_compress kernel's first build ends, weights are packed by PyTorch ops
    (patch() does not wait for NVRTC); after it, by the kernel - bit for bit the same, ties
    (equal magnitudes in a group) and a given mask included."""
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(tmp_path / "cache"))
    cache.clear_memory()
    monkeypatch.setattr(dispatch, "_prune_builds", {})
    release, real = threading.Event(), compiler.compile_cubin

    def held(source, name, target, headers):
        if name.startswith("sp24_compress"):
            release.wait(120)
        return real(source, name, target, headers)
    monkeypatch.setattr(compiler, "compile_cubin", held)
    w = torch.randn(96, 160, device="cuda").to(dtype)
    w[::3, 1::4] = w[::3, ::4]  # (ties)
    mask = semi24.magnitude_mask(torch.randn(96, 160, device="cuda"))
    cold = [tensor.prune_and_compress(w), tensor.prune_and_compress(w, mask=mask)]
    assert not release.is_set() and not dispatch.prune_kernel_at_hand("sp24_compress", dtype, w.device.index)
    release.set()
    dispatch._prune_builds[("sp24_compress", dtype, w.device.index)].result(timeout=300)
    assert tensor.packs_on_kernel_now(w)
    warm = [tensor.prune_and_compress(w), tensor.prune_and_compress(w, mask=mask)]
    for (values, metadata), (kernel_values, kernel_metadata) in zip(cold, warm):
        assert torch.equal(values.view(torch.uint8), kernel_values.view(torch.uint8))
        assert torch.equal(metadata, kernel_metadata)


@pytest.mark.parametrize("settings", [{"sparsity": "2:4"}, {"sparsity": "2:4", "weight_dtype": "e4m3"},
                                      {"sparsity": "2:4", "weight_dtype": "int4"}, {"block": (64, 64), "density": 0.5},
                                      {"sparsity": "block-ell", "block": (32, 32), "density": 0.5}])
def test_after_patch_the_forwards_compile_nothing(settings, monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(tmp_path / "cache"))
    cache.clear_memory()
    torch.manual_seed(0)
    model = MLP().to("cuda", torch.bfloat16)
    sparsegen.patch(model, {r"\w+_proj": settings})
    for pending in list(cache._pending.values()):
        pending.exception(timeout=300)  # (done, whatever it raised)

    def refuse(source, name, target, headers):
        raise AssertionError(f"{name} was not built ahead")
    monkeypatch.setattr(compiler, "compile_cubin", refuse)
    reference = sparsegen.dense_copy(model).double()
    with torch.no_grad():
        for tokens in (1, 7, 32, 64, 100, 2048):
            x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
            y, want = model(x).double(), reference(x.double())
            assert (y - want).norm() / want.norm() < 6e-2
