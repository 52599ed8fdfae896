"""The lean inference path (sparsegen/launch/lean.py) on the GPU: repeated no-grad calls go straight to
their planned launch, stay right against float64, and follow every change of the layer's
weights, layout, dtype and inputs (pytest -m gpu)."""
import threading

import pytest
import torch

import sparsegen
from sparsegen.launch import calls as calls_module
from sparsegen.bsr import ops as bsr_ops
from sparsegen.semi24 import ops as sp24_ops


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LAYERS = {"2:4": lambda: sparsegen.Sparse24Linear(320, 192, device="cuda", dtype=torch.bfloat16),
          "b32": lambda: sparsegen.linear(320, 192, block=(32, 32), density=0.5, device="cuda", dtype=torch.bfloat16),
          "b64": lambda: sparsegen.linear(320, 192, block=(64, 64), density=0.5, device="cuda",
                                          dtype=torch.bfloat16)}
FULL_PATHS = ((bsr_ops, "bsr_dds"), (sp24_ops, "sp24_dds"), (calls_module, "dense_result"))


def reference(layer, x):
    return x.double() @ layer.to_dense_weight().double().t() + layer.bias.double()


def relative_error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def poisoned_call(layer, x):
    """layer(x) with the allocator's next block of Y's size filled with NaN first."""
    torch.full((*x.shape[:-1], layer.out_features), float("nan"), device="cuda", dtype=x.dtype)
    return layer(x)


@pytest.fixture
def full_path_calls(monkeypatch):
    """The calls that went the full way (through ops), counted."""
    calls = []
    for module, name in FULL_PATHS:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    return calls


def lean_and_right(layer, x, full_path_calls) -> None:
    """After one call that plans, the next takes the lean path and matches float64."""
    poisoned_call(layer, x)
    full_path_calls.clear()
    y = poisoned_call(layer, x)
    assert not full_path_calls
    assert relative_error(y, reference(layer, x)) < 1e-2


@pytest.mark.parametrize("kind", LAYERS)
@torch.no_grad()
def test_lean_calls_match_float64_and_follow_the_weights(kind, full_path_calls):
    layer = LAYERS[kind]()
    x = torch.randn(3, 37, 320, device="cuda", dtype=torch.bfloat16)
    lean_and_right(layer, x, full_path_calls)
    layer.values.mul_(-0.5)  # trained in place: same address, new values
    layer.bias.add_(1.0)
    lean_and_right(layer, x, full_path_calls)
    layer.values.data = layer.values.data.clone().neg_()  # new storage
    lean_and_right(layer, x, full_path_calls)
    layer.half()
    lean_and_right(layer, x.half(), full_path_calls)
    x = torch.randn(5, 320, device="cuda", dtype=torch.float16)  # another signature
    lean_and_right(layer, x, full_path_calls)


@torch.no_grad()
def test_lean_calls_follow_a_new_layout(full_path_calls):
    layer = LAYERS["b32"]()
    x = torch.randn(40, 320, device="cuda", dtype=torch.bfloat16)
    lean_and_right(layer, x, full_path_calls)
    layer.set_layout(layer.layout.flip(0))
    lean_and_right(layer, x, full_path_calls)


@pytest.mark.parametrize("kind", LAYERS)
@torch.no_grad()
def test_inputs_the_lean_path_cannot_take_go_the_full_way(kind):
    layer = LAYERS[kind]()
    wide = torch.randn(24, 640, device="cuda", dtype=torch.bfloat16)
    flat = torch.randn(24 * 320 + 1, device="cuda", dtype=torch.bfloat16)
    for x in (wide[:, ::2], flat[1:].view(24, 320)):  # strided; contiguous but 2 bytes off 16
        layer(x.contiguous())
        y = poisoned_call(layer, x)
        assert relative_error(y, reference(layer, x)) < 1e-2
    with pytest.raises(sparsegen.InputError, match="Expected input of shape"):
        layer(torch.randn(4, 321, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", LAYERS)
def test_grad_mode_and_autocast_take_the_full_path(kind, full_path_calls):
    layer = LAYERS[kind]()
    x = torch.randn(16, 320, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)
    full_path_calls.clear()
    y = layer(x)  # parameters need grad: autograd records the call
    assert full_path_calls and y.requires_grad
    y.float().sum().backward()
    assert layer.values.grad is not None
    full_path_calls.clear()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        y = layer(x)
    assert full_path_calls and y.dtype == torch.float16


@pytest.mark.parametrize("kind", LAYERS)
@torch.no_grad()
def test_threads_sharing_a_layer_each_get_their_own_result(kind):
    layer = LAYERS[kind]()
    inputs = [torch.randn(8 + i, 320, device="cuda", dtype=torch.bfloat16) for i in range(4)]
    torch.cuda.synchronize()  # (the threads read them on their own streams)
    errors = []

    def work(x):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(25):
                y = layer(x)
            stream.synchronize()
            errors.append(relative_error(y, reference(layer, x)))

    threads = [threading.Thread(target=work, args=(x,)) for x in inputs * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 8 and max(errors) < 1e-2
