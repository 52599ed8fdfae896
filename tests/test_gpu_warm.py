"""Kernels warmed by patch() on the GPU: once the background builds finish, a patched gated
MLP and its one-byte, 4-bit, block-sparse and block-ELL twins run decode, small-batch and prefill forwards without compiling
anything more, and compute what they computed before (pytest -m gpu)."""
import threading

import pytest
import torch
from torch import nn

import sparsegen
from sparsegen.jit import cache, compiler
from sparsegen.semi24 import dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(256, 384), nn.Linear(256, 384), nn.Linear(384, 256)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("settings", [{"sparsity": "2:4"}, {"sparsity": "2:4", "weight_dtype": "e4m3"},
                                      {"sparsity": "2:4", "weight_dtype": "int4"}, {"block": (64, 64), "density": 0.5},
                                      {"sparsity": "block-ell", "block": (32, 32), "density": 0.5}])
def test_after_patch_the_forwards_compile_nothing(settings, monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(tmp_path / "cache"))
    cache.clear_memory()
    torch.manual_seed(0)
    model = MLP().to("cuda", torch.bfloat16)
    real_compile, compiled_on = compiler.compile_cubin, []
    monkeypatch.setattr(compiler, "compile_cubin", lambda *args: compiled_on.append(threading.current_thread().name)
                        or real_compile(*args))
    dispatch.prune_kernel.cache_clear()
    sparsegen.patch(model, {r"\w+_proj": settings})
    # every kernel the conversion launched (pruning, packing) was built ahead, off the caller's thread
    assert threading.main_thread().name not in compiled_on, compiled_on
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


def test_the_cublas_thread_ends_and_the_head_then_computes_on_the_callers_thread():
    """patch's cuBLAS thread (warm.warm_cublas) ends, and the head's product on the caller's
    thread afterwards (on the handle torch's pool hands back, or a new one: not observable
    here - the traces in BENCHMARKS.md show the head's time) matches float64."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), nn.Linear(256, 1000)).to("cuda", torch.bfloat16)
    thread = sparsegen.warm.warm_cublas(model, skip={"0.gate_proj", "0.up_proj", "0.down_proj"})
    assert thread is not None
    thread.join(60)
    assert not thread.is_alive()
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    head = model[1]
    expected = x.double() @ head.weight.double().T + head.bias.double()
    with torch.no_grad():
        torch.testing.assert_close(head(x).double(), expected, rtol=2e-2, atol=2e-2)
