"""What a state_dict (a file from anywhere) can put in front of a kernel: nothing unchecked.
2:4 metadata must be a selection mma.sp can read; block-sparse indices are rebuilt from the
layout, whatever the file says they are."""
import random

import pytest
import torch

import sparsegen
from sparsegen.bsr.autograd import INDEX_NAMES, IndexTensors
from sparsegen.errors import InputError
from sparsegen.semi24 import format as semi24

INVALID_PAIRS = [(0, 0), (1, 1), (3, 3), (2, 1), (3, 0), (3, 2)]  # repeated or decreasing positions


def random_layer(seed: int) -> sparsegen.Sparse24Linear:
    torch.manual_seed(seed)
    return sparsegen.Sparse24Linear(64 * random.Random(seed).randint(1, 3), 16 * random.Random(seed).randint(1, 4))


@pytest.mark.parametrize("seed", range(6))
def test_metadata_with_a_bad_group_is_refused_naming_that_group(seed):
    layer, rng = random_layer(seed), random.Random(seed)
    n, k = layer.out_features, layer.in_features
    state = {name: t.clone() for name, t in layer.state_dict().items()}
    positions = semi24.stored_positions(state["metadata"], n, k).clone()
    row, group = rng.randrange(n), rng.randrange(k // 4)
    positions[row, group] = torch.tensor(rng.choice(INVALID_PAIRS))
    state["metadata"] = semi24.pack_metadata(positions)
    target = sparsegen.Sparse24Linear(k, n)
    before = {name: t.clone() for name, t in target.state_dict().items()}
    with pytest.raises(InputError, match=f"at row {row}, columns {4 * group}..{4 * group + 3}"):
        target.load_state_dict(state)
    assert all(torch.equal(before[name], t) for name, t in target.state_dict().items())  # nothing half-loaded


def test_all_bits_set_is_refused_at_the_first_group():
    layer = sparsegen.Sparse24Linear(64, 32)
    state = layer.state_dict()
    state["metadata"] = torch.full_like(state["metadata"], -1)
    with pytest.raises(InputError, match=r"positions \(3, 3\) \(nibble 0xf\) in the group at row 0, columns 0..3"):
        layer.load_state_dict(state)


@pytest.mark.parametrize("bad", ["float", "shape"])
def test_metadata_of_another_dtype_or_shape_is_refused(bad):
    layer = sparsegen.Sparse24Linear(64, 32)
    state = layer.state_dict()
    meta = state["metadata"]
    state["metadata"] = meta.float() if bad == "float" else meta[:, :1].contiguous()
    with pytest.raises(InputError, match="Expected (int32 2:4 metadata|metadata of shape)"):
        layer.load_state_dict(state)


def test_valid_metadata_loads_and_computes_the_saved_layer():
    source = random_layer(1)
    target = sparsegen.Sparse24Linear(source.in_features, source.out_features)
    target.load_state_dict(source.state_dict())
    x = torch.randn(5, source.in_features)
    expected = x.double() @ source.to_dense_weight().double().T + source.bias.double()
    torch.testing.assert_close(target(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_a_training_layer_refuses_a_mask_that_is_not_2_4():
    layer = sparsegen.Sparse24TrainingLinear(64, 32)
    state = layer.state_dict()
    state["mask"] = state["mask"].clone()
    state["mask"][3, 4:8] = torch.tensor([True, True, True, False])
    with pytest.raises(InputError, match="3 kept in the group at row 3, columns 4..7"):
        layer.load_state_dict(state)


@pytest.mark.parametrize("seed", range(4))
def test_crafted_block_indices_never_reach_a_kernel(seed, dense_reference):
    """col_indices / row_offsets in the file are pointers into X and W; the layer rebuilds
    them (and every derived index) from the layout, so crafted ones are simply replaced."""
    torch.manual_seed(seed)
    source = sparsegen.linear(96, 64, block=(16, 16), density=0.5)
    state = {name: t.clone() for name, t in source.state_dict().items()}
    state["col_indices"] = torch.randint(-10 ** 6, 10 ** 6, state["col_indices"].shape, dtype=state["col_indices"].dtype)
    state["row_offsets"] = torch.randint(-10 ** 6, 10 ** 6, state["row_offsets"].shape, dtype=state["row_offsets"].dtype)
    target = sparsegen.linear(96, 64, block=(16, 16), layout=source.layout)
    target.load_state_dict(state)
    rebuilt = IndexTensors.of(source.layout)
    for name in INDEX_NAMES:
        assert torch.equal(getattr(target, name), getattr(rebuilt, name)), name
    x = torch.randn(7, 96)
    torch.testing.assert_close(target(x).double(), dense_reference(source, x), rtol=1e-5, atol=1e-5)
