"""Prune-and-regrow: values, optimizer state and indices follow the blocks that move."""
import pytest
import torch

import sparsegen
from sparsegen.bsr import topology
from sparsegen.bsr import format as bsr


def grid_values(layer):
    """{block position in the grid: its values}."""
    flat = bsr.flat_index(layer.layout)
    return {int(p): layer.values.detach()[i].clone() for i, p in enumerate(flat)}


def test_prune_and_regrow_moves_the_weakest_blocks_to_the_best_scores():
    torch.manual_seed(0)
    layer = sparsegen.linear(8 * 16, 6 * 16, block=(16, 16), density=0.5)
    before, mask = grid_values(layer), layer.layout.clone()
    scores = torch.rand(mask.shape)
    moved = topology.prune_and_regrow(layer, 0.25, scores)
    assert moved == round(0.25 * len(before)) and int(layer.layout.sum()) == len(before)
    after = grid_values(layer)
    dropped, grown = set(before) - set(after), set(after) - set(before)
    assert len(dropped) == len(grown) == moved
    norms = {p: v.norm().item() for p, v in before.items()}
    assert max(norms[p] for p in dropped) <= min(norms[p] for p in set(before) - dropped)
    free = scores.flatten().masked_fill(mask.flatten(), -1)
    assert grown == set(free.topk(moved).indices.tolist())
    assert all(torch.equal(after[p], before[p]) for p in set(after) & set(before))
    assert all(after[p].abs().sum() == 0 for p in grown)
    x = torch.randn(3, 8 * 16)
    want = torch.nn.functional.linear(x, bsr.values_to_dense(layer.values, layer.layout, layer.block), layer.bias)
    torch.testing.assert_close(layer(x), want)


def test_adam_moments_follow_their_blocks():
    torch.manual_seed(1)
    layer = sparsegen.linear(64, 64, block=(16, 16), density=0.5)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    layer(torch.randn(4, 64)).square().sum().backward()
    opt.step()
    flat_before = bsr.flat_index(layer.layout)
    moment = {int(p): opt.state[layer.values]["exp_avg"][i].clone() for i, p in enumerate(flat_before)}
    topology.prune_and_regrow(layer, 0.5, torch.rand(layer.layout.shape), opt)
    for i, p in enumerate(bsr.flat_index(layer.layout).tolist()):
        got = opt.state[layer.values]["exp_avg"][i]
        assert torch.equal(got, moment[p]) if p in moment else got.abs().sum() == 0
    opt.step()  # still a valid optimizer


@pytest.mark.parametrize("mode", ["rigl", "set"])
def test_updater_moves_blocks_every_interval_and_training_goes_on(mode):
    torch.manual_seed(2)
    model = torch.nn.Sequential(sparsegen.linear(64, 128, block=(16, 16), density=0.25), torch.nn.ReLU(),
                                sparsegen.linear(128, 32, block=(16, 16), density=0.25))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    updater = topology.TopologyUpdater(model, opt, mode=mode, interval=3, fraction=0.2,
                                       generator=torch.Generator().manual_seed(0))
    layouts, moved = [model[0].layout.clone()], []
    for _ in range(6):
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        moved.append(updater.step())
        layouts.append(model[0].layout.clone())
    assert moved[0] == moved[1] == 0 and moved[2] > 0 and moved[5] > 0
    assert torch.equal(layouts[0], layouts[2]) and not torch.equal(layouts[2], layouts[3])
    assert int(layouts[-1].sum()) == int(layouts[0].sum())
    if mode == "rigl":
        assert not updater._scores  # used and cleared


def test_rigl_grows_where_the_gradient_is():
    torch.manual_seed(3)
    layer = sparsegen.linear(4 * 16, 4 * 16, block=(16, 16), layout=torch.eye(4, dtype=torch.bool))
    updater = topology.TopologyUpdater(layer, mode="rigl", interval=1, fraction=0.25)
    x = torch.zeros(8, 64)
    x[:, 16:32] = torch.randn(8, 16)  # only input block 1 carries signal
    grad = torch.zeros(8, 64)
    grad[:, 48:64] = 1.0              # only output block 3 receives gradient
    layer(x).backward(grad)
    updater.step()
    assert layer.layout[3, 1]  # the one absent block with a nonzero dense gradient


def test_set_layout_rejects_a_different_block_count():
    layer = sparsegen.linear(64, 64, block=(16, 16), density=0.5)
    with pytest.raises(sparsegen.InputError, match="blocks"):
        layer.set_layout(torch.ones(4, 4, dtype=torch.bool))
