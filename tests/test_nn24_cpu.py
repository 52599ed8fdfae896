"""Sparse24Linear on the CPU: the reference path, gradients, conversion, save/load, compile."""
import io

import pytest
import torch
from torch import nn

import sparsegen
from sparsegen.semi24 import autograd as autograd24
from sparsegen.errors import InputError


def test_linear_factory_makes_a_24_layer_that_matches_its_dense_weight():
    torch.manual_seed(0)
    layer = sparsegen.linear(96, 48, sparsity="2:4", dtype=torch.float64)
    assert isinstance(layer, sparsegen.Sparse24Linear)
    x = torch.randn(3, 5, 96, dtype=torch.float64)
    weight = layer.to_dense_weight()
    assert ((weight != 0).reshape(48, -1, 4).sum(-1) <= 2).all()
    torch.testing.assert_close(layer(x), x @ weight.t() + layer.bias)
    assert "sparsity=2:4" in repr(layer)


def test_from_dense_keeps_the_largest_two_of_four():
    dense = nn.Linear(64, 32)
    layer = sparsegen.Sparse24Linear.from_dense(dense)
    expected = sparsegen.to_sparse24(dense.weight.detach()).to_dense()
    assert torch.equal(layer.to_dense_weight(), expected)
    assert torch.equal(layer.to_linear().weight, expected)
    assert torch.equal(layer.bias, dense.bias)


def test_gradcheck_float64():
    layer = sparsegen.linear(64, 32, sparsity="2:4", dtype=torch.float64)
    x = torch.randn(4, 64, dtype=torch.float64, requires_grad=True)
    values = layer.values.detach().clone().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()
    op = lambda x, v, b: autograd24.sp24_linear(x, v, layer.metadata, b, 32)
    assert torch.autograd.gradcheck(op, (x, values, bias))


def test_gradients_are_the_masked_dense_gradients():
    layer = sparsegen.linear(64, 32, sparsity="2:4", dtype=torch.float64)
    x = torch.randn(6, 64, dtype=torch.float64, requires_grad=True)
    layer(x).square().sum().backward()
    weight = layer.to_dense_weight().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    (x2 @ weight.t() + layer.bias.detach()).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    kept = layer.mask
    torch.testing.assert_close(layer.values.grad.flatten(), weight.grad[kept])


def test_state_dict_round_trip_and_torch_save():
    layer = sparsegen.linear(64, 32, sparsity="2:4")
    other = sparsegen.linear(64, 32, sparsity="2:4")
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.to_dense_weight(), layer.to_dense_weight())
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(2, 64)
    assert torch.equal(loaded(x), layer(x))


def test_patch_with_24_rule():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(5, 64)
    replaced = sparsegen.patch(model, {r"0|2": {"sparsity": "2:4", "method": "transposable"}})
    assert replaced == ["0", "2"]
    assert all(isinstance(model[i], sparsegen.Sparse24Linear) for i in (0, 2))
    mask = model[0].mask
    assert (mask.t().reshape(64, -1, 4).sum(-1) == 2).all()  # transposable: 2:4 down columns too
    assert model(x).shape == (5, 32)


@pytest.mark.parametrize("method", ["magnitude", "transposable"])
def test_compile_fullgraph_matches_eager(method):
    """The compiled backward (through the sp24_input_grad and sp24_weight_grad ops) gives
    eager mode's gradients."""
    layer = sparsegen.Sparse24Linear(64, 32, method=method)
    x = torch.randn(3, 5, 64, requires_grad=True)
    dy = torch.randn(3, 5, 32)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    grads = []
    for module in (layer, compiled):
        x.grad = layer.values.grad = layer.bias.grad = None
        module(x).backward(dy)
        grads.append((x.grad, layer.values.grad, layer.bias.grad))
    torch.testing.assert_close(compiled(x), layer(x))
    for eager, traced in zip(*grads):
        torch.testing.assert_close(traced, eager)


@pytest.mark.parametrize("shape", [(64, 40), (60, 32)])
def test_shapes_outside_the_granule_are_clear_errors(shape):
    with pytest.raises(InputError, match="multiple of 16"):
        sparsegen.linear(shape[1], shape[0], sparsity="2:4")


def test_unknown_sparsity_and_bad_inputs():
    with pytest.raises(InputError, match="sparsity"):
        sparsegen.linear(64, 32, sparsity="1:4")
    layer = sparsegen.linear(64, 32, sparsity="2:4")
    with pytest.raises(InputError, match=r"shape \(\.\.\., 64\)"):
        layer(torch.randn(3, 63))
    with pytest.raises(InputError, match="dtype"):
        layer(torch.randn(3, 64, dtype=torch.float64))
