"""Deterministic mode on the GPU (torch.use_deterministic_algorithms(True)): every sparsegen
forward and backward gives the same bits run after run, on another stream and in another
process. 2:4 decode splits K in either mode: its splits' sums are added in split order, not
in the order the splits finish (pytest -m gpu)."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparsegen
from sparsegen.bell.nn import BlockEllLinear
from sparsegen.semi24 import dispatch, ops as sp24_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

IN, OUT = 1024, 512
BF16 = dict(device="cuda", dtype=torch.bfloat16)
LAYERS = {"2:4": lambda: sparsegen.Sparse24Linear(IN, OUT, **BF16),
          "2:4-recipe": lambda: sparsegen.linear(IN, OUT, sparsity="2:4", dw_sparse=True, **BF16),
          "b32": lambda: sparsegen.linear(IN, OUT, block=(32, 32), density=0.5, **BF16),
          "b64": lambda: sparsegen.linear(IN, OUT, block=(64, 64), density=0.25, **BF16),
          "bell": lambda: BlockEllLinear(IN, OUT, block=(32, 32), density=0.5, **BF16),
          "bdiag": lambda: sparsegen.linear(IN, OUT, sparsity="block-diagonal", nblocks=4, **BF16)}
TOKENS = (1, 16, 133, 4133)  # decode (where 2:4 splits K unless deterministic), odd counts, many tiles


def enable_deterministic_mode() -> None:
    """What a user sets: PyTorch's switch, and the cuBLAS workspace it asks for. The dense path
    is turned off so that sparsegen's own kernels are the ones under test."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    os.environ["SPARSEGEN_DENSE_FALLBACK"] = "0"
    torch.use_deterministic_algorithms(True)


@pytest.fixture
def deterministic(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("SPARSEGEN_DENSE_FALLBACK", "0")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def forward_and_backward(kind: str, tokens: int, stream=None) -> list[torch.Tensor]:
    """Y, dX and every parameter's grad of a fresh layer (seeded) on these seeded inputs."""
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        torch.manual_seed(0)
        layer = LAYERS[kind]()
        x = torch.randn(tokens, IN, **BF16, requires_grad=True)
        dy = torch.randn(tokens, OUT, **BF16)
        y = layer(x)
        y.backward(dy)
    stream.synchronize()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]


def digest(kind: str, tokens: int) -> str:
    hashed = hashlib.sha256()
    for tensor in forward_and_backward(kind, tokens):
        hashed.update(tensor.float().cpu().numpy().tobytes())
    return hashed.hexdigest()


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("kind", LAYERS)
def test_repeated_runs_and_another_stream_give_the_same_bits(deterministic, kind, tokens):
    first = forward_and_backward(kind, tokens)
    assert all(torch.isfinite(t).all() for t in first)
    for stream in (None, None, torch.cuda.Stream()):
        again = forward_and_backward(kind, tokens, stream)
        assert len(again) == len(first)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_another_process_gives_the_same_bits(deterministic):
    cases = [(kind, tokens) for kind in LAYERS for tokens in (1, 133)]
    script = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
              "import test_gpu_determinism as t; t.enable_deterministic_mode(); "
              f"print(json.dumps([t.digest(k, m) for k, m in {cases!r}]))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [digest(kind, tokens) for kind, tokens in cases]


@pytest.mark.parametrize("instr", ["mma", "tma"])
@torch.no_grad()
def test_split_k_gives_the_same_bits_whichever_split_finishes_first(instr):
    """Many splits of few tiles, launched again and again: the last split adds the splits'
    slices in split order, so Y's bits never follow the order the splits ran in (with float32
    atomics they did: a CUDA graph replayed twice gave two answers)."""
    if instr == "tma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma.sp kernels are sm_90 only")
    layer = sparsegen.Sparse24Linear(4096, 256, **BF16)
    x = torch.randn(7, 4096, **BF16)

    def product():
        return sp24_ops.sp24_dds(x, layer.values, layer.metadata, layer.bias, 256, splits=16, instr=instr)
    first = product()
    assert all(torch.equal(first, product()) for _ in range(50))
    want = x.double() @ layer.to_dense_weight().double().t() + layer.bias.double()
    assert ((first.double() - want).norm() / want.norm()) < 1e-2


@torch.no_grad()
def test_deterministic_mode_keeps_split_k(monkeypatch):
    monkeypatch.setenv("SPARSEGEN_DENSE_FALLBACK", "0")
    layer = sparsegen.Sparse24Linear(4096, 4096, **BF16)
    x = torch.randn(16, 4096, **BF16)
    plans = []
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic)
        plans.append(sp24_ops._sp24_plan(x, layer.values, layer.metadata, 4096, dispatch.wanted_splits(None, x.dtype)))
    torch.use_deterministic_algorithms(False)
    assert plans[0].workspace > 0 and plans[1].workspace == plans[0].workspace
