"""The lean path's bookkeeping (sparsegen/launch/lean.py) on the CPU: when a layer plans, when it
plans again, and which calls never take it. A stand-in plan computes Y with the layer's
dense weight, so the results are checked too (the GPU's own plans: test_gpu_lean.py)."""
import pytest
import torch

import sparsegen
from sparsegen.launch import lean
from sparsegen.launch import calls


class DensePlan:
    """A plan as ops makes them (width, dense, run) that writes Y = X W^T + b by PyTorch."""

    dense = False

    def __init__(self, layer):
        self.layer, self.width, self.runs = layer, layer.out_features, 0

    def run(self, x2, values, bias, y):
        self.runs += 1
        y.copy_(torch.nn.functional.linear(x2, self.layer.to_dense_weight(), bias).view(y.shape))


@pytest.fixture
def planned_layer(monkeypatch):
    """A BlockSparseLinear whose lean calls run DensePlan; the plans it made, in order."""
    layer = sparsegen.linear(64, 48, block=(16, 16), density=0.5, dtype=torch.float64)
    made = []

    def lean_call(x, values, bias):
        calls.check_inputs(x, values, bias, layer.in_features)  # as the layers' own _lean_call
        made.append(DensePlan(layer))
        return lean.LeanCall(made[-1], x, values, bias)

    monkeypatch.setattr(layer, "_lean_call", lean_call)
    return layer, made


def reference(layer, x):
    return x @ layer.to_dense_weight().t() + layer.bias


@torch.no_grad()
def test_a_signature_plans_once_and_each_call_runs_it(planned_layer):
    layer, made = planned_layer
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    for _ in range(3):
        y = layer(x)
        assert y.shape == (2, 5, 48) and torch.allclose(y, reference(layer, x))
    assert len(made) == 1 and made[0].runs == 3
    layer(torch.randn(7, 64, dtype=torch.float64))  # another shape: its own plan
    assert len(made) == 2


@torch.no_grad()
def test_new_weights_or_tensors_plan_again(planned_layer):
    layer, made = planned_layer
    x = torch.randn(4, 64, dtype=torch.float64)
    layer(x)
    layer.values.mul_(2.0)  # in place: the same address, the plan stays
    assert torch.allclose(layer(x), reference(layer, x)) and len(made) == 1
    layer.values.data = layer.values.data.clone()  # new storage
    layer(x)
    assert len(made) == 2
    layer.to(torch.float64)  # _apply: every plan forgotten
    layer(x)
    assert len(made) == 3
    layer.set_layout(layer.layout.flip(0))
    assert torch.allclose(layer(x), reference(layer, x)) and len(made) == 4
    name = next(iter(layer._buffers))  # a tensor assigned to the layer: a plan may point into the old one
    setattr(layer, name, getattr(layer, name).clone())
    assert torch.allclose(layer(x), reference(layer, x)) and len(made) == 5


def test_autograd_autocast_and_odd_inputs_take_the_full_path(planned_layer):
    layer, made = planned_layer
    x = torch.randn(4, 64, dtype=torch.float64)
    y = layer(x)  # the parameters need grad: autograd records the call
    assert y.requires_grad and not made
    with torch.no_grad():
        layer(x[:, ::2].repeat(1, 2))  # contiguous after all: planned
        planned = len(made)
        assert torch.allclose(layer(x.t().contiguous().t()), reference(layer, x))  # strided: full path
        assert made[-1].runs == 1 and len(made) == planned
    with pytest.raises(sparsegen.InputError, match="Expected input of shape"):
        with torch.no_grad():
            layer(torch.randn(4, 63, dtype=torch.float64))


@torch.no_grad()
def test_a_stream_of_new_shapes_keeps_a_bounded_history(planned_layer):
    layer, made = planned_layer
    for rows in range(1, lean.MAX_SIGNATURES + 10):
        layer(torch.randn(rows, 64, dtype=torch.float64))
    assert len(layer.__dict__["_lean_calls"]) <= lean.MAX_SIGNATURES
