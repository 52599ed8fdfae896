"""The block-diagonal layout on the CPU: tiling, shape checks, specs, the layer's numerics and
gradients against float64, sparsegen.linear / patch / dense_copy. (GPU: test_gpu_bdiag.py.)"""
import pytest
import torch

from kit_training import eager_and_compiled_grads

import sparsegen
from sparsegen.jit import codegen, spec as specmod
from sparsegen.bdiag import format as diag
from sparsegen.bdiag import specs as diag_specs
from sparsegen.bdiag.nn import BlockDiagonalLinear
from sparsegen.errors import InputError


def dense_reference(layer, x):
    weight = torch.block_diag(*layer.blocks().detach().double().unbind(0))
    return torch.nn.functional.linear(x.double(), weight, None if layer.bias is None else layer.bias.double())


@pytest.mark.parametrize("nblocks,n,k,block", [(1, 32, 16, (16, 16)), (3, 64, 96, (32, 16)), (2, 128, 64, (64, 32))])
def test_tiles_round_trip_and_place_each_block_on_the_diagonal(nblocks, n, k, block):
    blocks = torch.randn(nblocks, n, k, dtype=torch.float64)
    values = diag.tile(blocks, block)
    assert values.shape == (nblocks * n // block[0], k // block[1], *block)
    assert torch.equal(diag.untile(values, nblocks), blocks)
    assert torch.equal(diag.to_dense(values, nblocks), torch.block_diag(*blocks.unbind(0)))
    dense_t = diag.to_dense(diag.transposed(values, nblocks), nblocks)
    assert torch.equal(dense_t, torch.block_diag(*blocks.unbind(0)).t())


@pytest.mark.parametrize("args,message", [
    ((100, 64, 3), r"out_features \(100\) to be a multiple of nblocks \(3\)"),
    ((96, 65, 3), r"in_features \(65\) to be a multiple of nblocks"),
    ((64, 40, 2), r"a multiple of 16"),
    ((64, 64, 0), "nblocks"),
    ((128, 128, 2, (48, 16)), "block sides"),
    ((128, 128, 2, (128, 16)), r"diagonal block's rows .* multiple of the block's rows \(128\)"),
])
def test_bad_shapes_are_refused_with_the_quantity_named(args, message):
    with pytest.raises(InputError, match=message):
        BlockDiagonalLinear(args[1], args[0], *args[2:3], block=args[3] if len(args) > 3 else None)


def test_layer_matches_float64_and_its_gradients_do_too():
    torch.manual_seed(0)
    layer = BlockDiagonalLinear(96, 64, 2, block=(16, 16)).double()
    x = torch.randn(2, 7, 96, dtype=torch.float64, requires_grad=True)
    assert torch.allclose(layer(x), dense_reference(layer, x))
    inputs = (x.detach()[:, :3].requires_grad_(), layer.values.detach().clone().requires_grad_(),
              layer.bias.detach().clone().requires_grad_())
    # the kit's training path: dX over W^T's tiles (the layout's `transposed`), dW by its batched weight_grad
    assert torch.autograd.gradcheck(lambda x, v, b: layer._differentiable_product(x, v, b), inputs)


def test_compiled_training_step_matches_eager_and_a_dense_twin():
    """The kit's training path under torch.compile (fullgraph: its transposed product and
    batched weight gradient trace): eager's loss and gradients, which equal the dense weight's
    gradients on the diagonal blocks."""
    torch.manual_seed(0)
    layer = BlockDiagonalLinear(128, 64, 4, block=(16, 16))
    x = torch.randn(5, 128, requires_grad=True)
    grads = eager_and_compiled_grads(layer, x)
    torch.testing.assert_close(grads[0], grads[1])
    weight = layer.to_dense_weight().detach().requires_grad_()
    x_twin = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(x_twin, weight, layer.bias.detach()).square().sum().backward()
    on_diagonal = diag.tile(diag.diagonal_of(weight.grad, 4), (16, 16))
    torch.testing.assert_close(grads[0][1], on_diagonal)
    torch.testing.assert_close(grads[0][0], x_twin.grad)


def test_from_dense_keeps_the_diagonal_and_to_linear_agrees():
    linear = torch.nn.Linear(128, 64).double()
    layer = BlockDiagonalLinear.from_dense(linear, 4)
    weight = linear.weight.detach()
    for d in range(4):
        assert torch.equal(layer.blocks()[d], weight[16 * d:16 * (d + 1), 32 * d:32 * (d + 1)])
    x = torch.randn(5, 128, dtype=torch.float64)
    assert torch.allclose(layer(x), layer.to_linear()(x))
    assert layer.density == 0.25


def test_both_parameters_are_compiled_in():
    spec = diag_specs.forward_spec((64, 32), "bf16", 80, diagrows=4, rowblocks=8)
    assert spec.name.endswith("_xrowblocks8_xdiagrows4") and specmod.KernelSpec.from_name(spec.name) == spec
    source = codegen.render(spec)
    assert "return (r / 4) * 8 + blk;" in source and "return r * 8;" in source and "sg::GatheredDds<" in source
    assert "int M, int K, int N)" in source and "Rows{}" in source
    assert any(s.op == "bdiag_dds" for s in specmod.default_specs(90))


def test_linear_patch_and_dense_copy():
    layer = sparsegen.linear(256, 128, sparsity="block-diagonal", nblocks=4, dtype=torch.float64)
    assert isinstance(layer, BlockDiagonalLinear) and layer.nblocks == 4
    with pytest.raises(InputError, match="only arguments that sparsity=.block. takes.*Got also nblocks"):
        sparsegen.linear(256, 128, nblocks=4)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)).double()
    assert sparsegen.patch(model, {"0": {"sparsity": "block-diagonal", "nblocks": 2}}) == ["0"]
    assert isinstance(model[0], BlockDiagonalLinear)
    x = torch.randn(3, 64, dtype=torch.float64)
    twin = sparsegen.dense_copy(model)
    assert type(twin[0]) is torch.nn.Linear and torch.allclose(twin(x), model(x))


def test_state_dict_round_trips_and_compile_matches_eager():
    layer = BlockDiagonalLinear(64, 64, 2, block=(16, 16))
    other = BlockDiagonalLinear(64, 64, 2, block=(16, 16))
    other.load_state_dict(layer.state_dict())
    x = torch.randn(4, 64)
    assert torch.equal(other(x), layer(x))
    assert torch.allclose(torch.compile(layer, fullgraph=True)(x), layer(x))
