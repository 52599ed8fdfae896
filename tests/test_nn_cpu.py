"""BlockSparseLinear on the CPU against a float64 masked-dense reference."""
import pytest
import torch
from torch import nn

import sparsegen
from sparsegen import BlockSparseLinear

# max |y - ref| <= atol + rtol * |ref|, per dtype of the layer.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
             torch.float64: dict(rtol=1e-12, atol=1e-12)}
DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(y, ref, dtype):
    assert y.dtype == dtype and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(3, 7), (1,), (5,), ()], ids=str)
def test_forward_matches_float64_reference(dtype, bias, lead, dense_reference):
    block = (16, 32)
    layer = sparsegen.linear(7 * 32, 5 * 16, block=block, density=0.4, bias=bias, dtype=dtype)
    x = torch.randn(*lead, 7 * 32, dtype=dtype)
    y = layer(x)
    assert y.shape == (*lead, 5 * 16)
    assert_matches(y, dense_reference(layer, x), dtype)


def test_forward_with_rectangular_blocks_and_float64(dense_reference):
    layer = sparsegen.linear(3 * 64, 9 * 16, block=(16, 64), density=0.7, dtype=torch.float64)
    x = torch.randn(2, 3, 11, 3 * 64, dtype=torch.float64)
    assert_matches(layer(x), dense_reference(layer, x), torch.float64)


def test_gradients_reach_only_kept_blocks():
    layer = sparsegen.linear(4 * 16, 3 * 32, block=(32, 16), density=0.5, dtype=torch.float64)
    x = torch.randn(6, 4 * 16, dtype=torch.float64)
    dense = layer.to_dense_weight().detach().requires_grad_()
    (torch.nn.functional.linear(x, dense, layer.bias) ** 2).sum().backward()
    (layer(x) ** 2).sum().backward()
    kept_grads = torch.stack([dense.grad[r * 32:(r + 1) * 32, c * 16:(c + 1) * 16]
                              for r, c in layer.mask.nonzero().tolist()])
    torch.testing.assert_close(layer.values.grad, kept_grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_user_layout_with_an_empty_row_gives_bias(dtype, dense_reference):
    layout = torch.rand(4, 6) < 0.5
    layout[0, 0] = True
    layout[2] = False
    layer = sparsegen.linear(6 * 16, 4 * 32, block=(32, 16), layout=layout, dtype=dtype)
    assert torch.equal(layer.mask, layout)
    x = torch.randn(3, 7, 6 * 16, dtype=dtype)
    y = layer(x)
    assert torch.equal(y[..., 64:96], layer.bias[64:96].detach().expand(3, 7, 32))
    assert_matches(y, dense_reference(layer, x), dtype)


def test_all_empty_layout_without_bias_gives_zeros():
    layer = sparsegen.linear(64, 32, block=(16, 16), layout=torch.zeros(2, 4, dtype=torch.bool),
                             bias=False)
    assert layer.values.shape == (0, 16, 16) and layer.density == 0.0
    assert torch.equal(layer(torch.randn(5, 64)), torch.zeros(5, 32))


@pytest.mark.parametrize("bias", [True, False])
def test_from_dense_keeps_kept_blocks_exactly(bias):
    dense = nn.Linear(5 * 16, 3 * 32, bias=bias)
    layer = BlockSparseLinear.from_dense(dense, block=(32, 16), density=0.4)
    keep = layer.mask.repeat_interleave(32, 0).repeat_interleave(16, 1)
    weight = dense.weight.detach()
    assert torch.equal(layer.to_dense_weight(), torch.where(keep, weight, torch.zeros_like(weight)))
    norms = weight.reshape(3, 32, 5, 16).pow(2).sum(dim=(1, 3))
    assert norms[layer.mask].min() >= norms[~layer.mask].max()
    assert layer.mask.sum() == round(0.4 * 15)
    assert (layer.bias is None) == (not bias)
    if bias:
        assert torch.equal(layer.bias, dense.bias)
    x = torch.randn(4, 5 * 16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight * keep, dense.bias))


def test_from_dense_with_a_given_layout_and_dtype():
    dense = nn.Linear(64, 64, dtype=torch.bfloat16)
    layout = torch.eye(2, dtype=torch.bool)
    layer = BlockSparseLinear.from_dense(dense, block=(32, 32), layout=layout)
    assert layer.values.dtype == torch.bfloat16 and torch.equal(layer.mask, layout)
    assert torch.equal(layer.values[1], dense.weight.detach()[32:, 32:])


def test_mask_density_and_repr():
    layer = sparsegen.linear(5 * 32, 3 * 16, block=(16, 32), density=0.6)
    assert layer.mask.dtype == torch.bool and layer.mask.shape == (3, 5)
    nnz = int(layer.mask.sum())
    assert nnz == round(0.6 * 15) and layer.values.shape == (nnz, 16, 32)
    assert layer.density == pytest.approx(nnz / 15)
    text = repr(layer)
    assert "block=(16, 32)" in text and f"density={nnz / 15:.3f}" in text
    assert "in_features=160" in text and "out_features=48" in text


def test_linear_factory_example(dense_reference):
    layer = sparsegen.linear(1024, 256, block=(32, 32), density=0.5)
    assert isinstance(layer, BlockSparseLinear) and isinstance(layer, nn.Module)
    assert layer.mask.shape == (8, 32) and layer.density == 0.5
    assert (layer.mask.sum(dim=1) == 16).all()
    x = torch.randn(3, 1024)
    assert_matches(layer(x), dense_reference(layer, x), torch.float32)


def test_init_bound_follows_kept_fan_in():
    layer = sparsegen.linear(4096, 64, block=(32, 32), density=0.25)
    bound = (0.25 * 4096) ** -0.5
    assert layer.values.abs().max() <= bound
    assert layer.values.abs().max() > 0.9 * bound  # drawn over the whole range


def test_state_dict_round_trip():
    layer = sparsegen.linear(96, 64, block=(32, 32), density=0.5)
    clone = sparsegen.linear(96, 64, block=(32, 32), layout=layer.mask.clone())
    clone.load_state_dict(layer.state_dict())
    x = torch.randn(5, 96)
    assert torch.equal(clone(x), layer(x))


def test_autocast_computes_in_bfloat16_with_float32_gradients():
    torch.manual_seed(0)
    layer = sparsegen.linear(64, 32, block=(16, 16), density=0.5)
    x = torch.randn(5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    want = torch.nn.functional.linear(x.double(), layer.to_dense_weight().double(), layer.bias.double())
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-2
    out.float().sum().backward()
    assert layer.values.grad.dtype == torch.float32 and layer.values.grad.abs().sum() > 0


def test_torch_save_and_load_whole_model(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(sparsegen.linear(64, 48, block=(16, 16), density=0.5), torch.nn.ReLU())
    path = tmp_path / "model.pt"
    torch.save(net, path)
    loaded = torch.load(path, weights_only=False)
    x = torch.randn(4, 64)
    torch.testing.assert_close(loaded(x), net(x))
    assert torch.equal(loaded[0].layout, net[0].layout)


def test_loading_a_state_dict_with_other_block_count_is_a_clear_error():
    a = sparsegen.linear(64, 64, block=(16, 16), density=0.25)
    b = sparsegen.linear(64, 64, block=(16, 16), density=0.5)
    before = {k: v.clone() for k, v in b.state_dict().items()}
    with pytest.raises(sparsegen.InputError, match=r"Expected state_dict\['layout'\] with this layer's 8 blocks .*Got 4"):
        b.load_state_dict(a.state_dict())
    assert all(torch.equal(before[k], v) for k, v in b.state_dict().items())  # nothing half-loaded


def test_gpus_without_kernels_fall_back_to_the_reference(monkeypatch):
    """An sm_75 (or unknown) GPU gets the PyTorch reference and one warning, not an error."""
    from sparsegen.launch import runtime
    from sparsegen.launch import calls

    calls.has_kernels.cache_clear()
    monkeypatch.setattr(runtime, "device_arch", lambda device: 75)
    with pytest.warns(RuntimeWarning, match="no kernels for sm_75"):
        assert not calls.has_kernels(0)
    calls.has_kernels.cache_clear()
