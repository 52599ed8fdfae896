"""2by4-pretrain style 2:4 training on the CPU: straight-through gradients, mask refresh,
masked decay, dense fine-tuning, S-STE, MVUE dW, save/load, compile."""
import io

import pytest
import torch
from torch import nn

import sparsegen
from sparsegen.errors import InputError
from sparsegen.semi24 import format as semi24
from sparsegen.semi24.train import soft_threshold


def is_24(t: torch.Tensor) -> bool:
    return bool(((t != 0).reshape(t.shape[0], -1, 4).sum(-1) <= 2).all())


def make(**options):
    torch.manual_seed(0)
    return sparsegen.Sparse24TrainingLinear(64, 32, dtype=torch.float64, **options)


def test_forward_uses_the_masked_weight_and_backward_is_straight_through():
    layer = make()
    assert is_24(layer.weight * layer.mask) and is_24((layer.weight * layer.mask).t().contiguous())
    x = torch.randn(3, 7, 64, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 7, 32, dtype=torch.float64)
    out = layer(x)
    sparse = layer.weight.detach() * layer.mask
    torch.testing.assert_close(out, x @ sparse.t() + layer.bias)
    out.backward(dy)
    torch.testing.assert_close(x.grad, dy @ sparse)
    dy2, x2 = dy.reshape(-1, 32), x.detach().reshape(-1, 64)
    torch.testing.assert_close(layer.weight.grad, dy2.t() @ x2)  # every weight, pruned or not
    torch.testing.assert_close(layer.bias.grad, dy2.sum(0))


def test_mask_refreshes_every_interval_in_training_only():
    layer = make(mask_interval=3)
    x = torch.randn(4, 64, dtype=torch.float64)
    first = layer.mask.clone()
    with torch.no_grad():
        layer.weight.copy_(torch.randn_like(layer.weight))  # a new magnitude order
    layer.eval()
    for _ in range(5):
        layer(x)
    assert torch.equal(layer.mask, first)
    layer.train()
    for _ in range(3):
        layer(x)
    assert torch.equal(layer.mask, first)  # steps 0, 1, 2 use the old mask
    layer(x)                               # step 3 refreshes
    assert not torch.equal(layer.mask, first)
    assert torch.equal(layer.mask, semi24.transposable_mask(layer.weight.detach()))


def test_reentrant_checkpointing_counts_each_step_once_in_the_recomputation():
    """Reentrant checkpointing runs the forward without grad (no step: as any such forward)
    and counts the step when it recomputes it in the backward: the schedule holds."""
    plain, checkpointed = make(mask_interval=2), make(mask_interval=2)
    for step in range(5):
        x = torch.randn(6, 64, dtype=torch.float64, requires_grad=True)
        plain(x).sum().backward()
        torch.utils.checkpoint.checkpoint(checkpointed, x, use_reentrant=True).sum().backward()
        assert int(checkpointed.step) == int(plain.step) == step + 1
        assert torch.equal(checkpointed.mask, plain.mask)


def test_activation_checkpointing_counts_each_step_once_and_recomputes_with_the_forwards_mask():
    """The recomputation in the backward is no step of its own: the schedule, the masks and
    the weights follow the run without checkpointing, step for step."""
    reentrant = False
    plain, checkpointed = make(mask_interval=2), make(mask_interval=2)
    optimizers = [torch.optim.SGD(layer.parameters(), lr=0.5) for layer in (plain, checkpointed)]
    for step in range(5):
        x = torch.randn(6, 64, dtype=torch.float64, requires_grad=True)
        plain(x).square().sum().backward()
        torch.utils.checkpoint.checkpoint(checkpointed, x, use_reentrant=reentrant).square().sum().backward()
        assert int(checkpointed.step) == int(plain.step) == step + 1
        assert torch.equal(checkpointed.mask, plain.mask)
        torch.testing.assert_close(checkpointed.weight.grad, plain.weight.grad)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(checkpointed.weight, plain.weight)


def test_the_schedule_counts_on_a_device_tensor_and_only_training_forwards_with_grad():
    layer = make(mask_interval=2)
    x = torch.randn(4, 64, dtype=torch.float64)
    assert layer.step.dtype == torch.int64 and layer.step.dim() == 0  # a buffer, not a Python int
    with torch.no_grad():  # an evaluation pass in training mode: no step
        layer(x)
    layer.eval()
    layer(x)
    assert int(layer.step) == 0
    layer.train()
    first = layer.mask.clone()
    with torch.no_grad():
        layer.weight.copy_(torch.randn_like(layer.weight))
    layer(x)
    layer(x)
    assert int(layer.step) == 2 and torch.equal(layer.mask, first)
    layer(x)  # step 2: refreshed from the new weights before the product
    assert torch.equal(layer.mask, semi24.transposable_mask(layer.weight.detach()))


def test_the_step_is_saved_and_an_older_checkpoint_without_it_loads():
    layer = make(mask_interval=5)
    for _ in range(3):
        layer(torch.randn(2, 64, dtype=torch.float64))
    state = layer.state_dict()
    assert int(state["step"]) == 3
    other = make(mask_interval=5)
    other.load_state_dict(state)
    assert int(other.step) == 3
    older = {k: v for k, v in state.items() if k != "step"}
    fresh = make(mask_interval=5)
    fresh.load_state_dict(older)  # strict: the missing step keeps the layer's own
    assert int(fresh.step) == 0 and torch.equal(fresh.mask, layer.mask)


def test_soft_threshold_scale_follows_the_schedule():
    layer = make(mask_interval=2, soft_threshold=True, method="magnitude")
    x = torch.randn(2, 64, dtype=torch.float64)
    before = layer.scale.clone()
    with torch.no_grad():
        layer.weight.mul_(torch.rand_like(layer.weight) + 0.5)
    layer(x)
    layer(x)
    assert torch.equal(layer.scale, before)
    layer(x)
    soft = soft_threshold(layer.weight.detach())
    expected = (layer.weight.detach() * soft).sum() / soft.square().sum()
    torch.testing.assert_close(layer.scale, expected.float())


def test_masked_decay_touches_only_pruned_weights():
    model = nn.Sequential(make(), nn.ReLU())
    layer = model[0]
    layer(torch.randn(2, 64, dtype=torch.float64)).sum().backward()
    before = layer.weight.grad.clone()
    sparsegen.masked_decay_(model, 0.1)
    expected = before + 0.1 * layer.weight.detach() * ~layer.mask
    torch.testing.assert_close(layer.weight.grad, expected)
    assert torch.equal(layer.weight.grad[layer.mask], before[layer.mask])


def test_dense_finetune_switch():
    model = nn.Sequential(make(), nn.ReLU(), make())
    assert sparsegen.dense_finetune_(model) == 2
    x = torch.randn(5, 64, dtype=torch.float64)
    torch.testing.assert_close(model[0](x), x @ model[0].weight.t() + model[0].bias)
    assert "dense fine-tuning" in repr(model[0])


def test_soft_threshold_is_24_and_matches_the_formula():
    w = torch.tensor([[4.0, -1.0, 3.0, 2.0] * 8] * 16, dtype=torch.float64)
    soft = soft_threshold(w)
    assert soft[0, :4].tolist() == [2.0, 0.0, 1.0, 0.0]  # each of the top two, less the third (2)
    layer = make(soft_threshold=True, method="magnitude")
    sparse = layer.sparse_weight(layer.weight.detach())
    assert is_24(sparse) and float(layer.scale) > 1.0  # the threshold shrinks; the scale restores
    x = torch.randn(4, 64, dtype=torch.float64)
    out = layer(x)
    torch.testing.assert_close(out, x @ sparse.t() + layer.bias)
    out.sum().backward()  # straight through the scaled threshold: scale * dY^T X
    torch.testing.assert_close(layer.weight.grad, layer.scale * torch.ones(4, 32, dtype=torch.float64).t() @ x)


def test_dw_sparse_is_an_unbiased_estimate(weight_grad_draws):
    layer = make(dw_sparse=True)
    x = torch.randn(64, 64, dtype=torch.float64)
    dy = torch.randn(64, 32, dtype=torch.float64)
    grads = weight_grad_draws(layer, x, dy, 400)
    exact = dy.t() @ x
    stderr = grads.std(0) / 400 ** 0.5
    assert ((grads.mean(0) - exact).abs() <= 5 * stderr + 1e-9).all()
    assert not torch.allclose(grads[0], exact)  # each draw is sparse, not the exact product


def test_state_dict_round_trip_and_patch_rule():
    layer = make(mask_interval=7)
    other = make(mask_interval=7)
    with torch.no_grad():
        other.weight.zero_()
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.mask, layer.mask) and torch.equal(other.weight, layer.weight)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False).mask, layer.mask)
    model = nn.Sequential(nn.Linear(64, 32))
    sparsegen.patch(model, {"0": {"sparsity": "2:4", "training": {"mask_interval": 5, "dw_sparse": True}}})
    assert isinstance(model[0], sparsegen.Sparse24TrainingLinear) and model[0].dw_sparse


def test_compile_fullgraph():
    layer = make()
    x = torch.randn(4, 64, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x))


def _sgd_steps(layer: nn.Module, module: nn.Module, steps: int) -> list[torch.Tensor]:
    """`steps` SGD steps of layer (called through module) on fresh inputs; the mask after each."""
    optimizer, masks = torch.optim.SGD(layer.parameters(), lr=0.5), []
    for step in range(steps):
        x = torch.randn(6, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        module(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        masks.append(layer.mask.clone())
    return masks


@pytest.mark.parametrize("options", [{}, {"method": "magnitude"}, {"soft_threshold": True}], ids=str)
def test_compiled_training_counts_steps_and_refreshes_as_eager(options):
    """Under torch.compile (Inductor) the scheduled refresh is an op: the compiled layer
    counts its steps, refreshes its mask (and S-STE's scale) at the same steps as eager
    mode and trains the same weights."""
    eager, traced = make(mask_interval=2, **options), make(mask_interval=2, **options)
    eager_masks = _sgd_steps(eager, eager, 5)
    traced_masks = _sgd_steps(traced, torch.compile(traced, fullgraph=True), 5)
    assert int(traced.step) == int(eager.step) == 5
    assert [torch.equal(a, b) for a, b in zip(eager_masks, traced_masks)] == [True] * 5
    assert not torch.equal(eager_masks[0], eager_masks[-1])  # (the refreshes did change it)
    torch.testing.assert_close(traced.weight, eager.weight)
    torch.testing.assert_close(traced.scale, eager.scale)


def test_bad_options():
    with pytest.raises(InputError, match="method"):
        sparsegen.Sparse24TrainingLinear(64, 32, method="mvue")
    with pytest.raises(InputError, match="mask_interval"):
        sparsegen.Sparse24TrainingLinear(64, 32, mask_interval=0)
    with pytest.raises(InputError, match="multiple of 16"):
        sparsegen.Sparse24TrainingLinear(64, 24)


def test_factory_and_from_dense_with_recipe_options_give_the_training_layer():
    layer = sparsegen.linear(64, 32, sparsity="2:4", dw_sparse=True, mask_interval=10)
    assert isinstance(layer, sparsegen.Sparse24TrainingLinear) and layer.dw_sparse and layer.method == "transposable"
    dense = nn.Linear(64, 32)
    trained = sparsegen.Sparse24Linear.from_dense(dense, soft_threshold=True)
    assert isinstance(trained, sparsegen.Sparse24TrainingLinear) and trained.soft_threshold
    assert torch.equal(trained.weight, dense.weight)
    assert isinstance(sparsegen.Sparse24Linear.from_dense(dense), sparsegen.Sparse24Linear)
    with pytest.raises(InputError, match="only arguments that sparsity='block' takes.*Got also dw_sparse"):
        sparsegen.linear(64, 32, density=0.5, dw_sparse=True)
    with pytest.raises(InputError, match="Got also not_an_option"):
        sparsegen.linear(64, 32, sparsity="2:4", not_an_option=1)
