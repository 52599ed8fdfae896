"""Every argument of sparsegen.linear and of a patch rule is used or refused: an argument the
chosen sparsity does not take is an InputError naming it, each one it takes changes the layer
it builds, and a density the grid cannot give warns with the density built."""
import warnings

import pytest
import torch
from torch import nn

import sparsegen
from sparsegen.errors import InputError
from sparsegen.factory import TAKES
from sparsegen.jit import registry
from sparsegen.patching import RULE_SETTINGS

# Each layout's examples (registry.Face.examples): a value of each argument its sparsity takes
# for a 128 -> 256 layer, and what it makes of the layer - a plugin's are tested alike.
FACES = {face.sparsity: face for face in registry.faces()}
EFFECTS = {(face.sparsity, name): effect for face in FACES.values() for name, _, effect in face.examples}
VALUES = {name: value for face in FACES.values() for name, value, _ in face.examples} | {"not_an_argument": 1}
EVERY = sorted({name for names in TAKES.values() for name in names} | {"not_an_argument"})


@pytest.mark.parametrize("sparsity, name", [(s, n) for s in TAKES for n in EVERY if n not in TAKES[s]])
def test_an_argument_the_sparsity_does_not_take_is_refused_by_name(sparsity, name):
    with pytest.raises(InputError, match=f"sparsity='{sparsity}' takes: .*Got also {name}"):
        sparsegen.linear(128, 256, sparsity=sparsity, **{name: VALUES[name]})


def test_every_argument_a_sparsity_takes_has_an_example():
    assert set(EFFECTS) == {(s, n) for s, names in TAKES.items() for n in names}
    assert all(len({name for name, _, _ in face.examples}) == len(face.examples) for face in FACES.values())


@pytest.mark.parametrize("sparsity, name", sorted(EFFECTS))
def test_every_argument_a_sparsity_takes_changes_the_layer(sparsity, name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (these values are representable: no density warning)
        layer = sparsegen.linear(128, 256, sparsity=sparsity, **{name: VALUES[name]})
    assert EFFECTS[sparsity, name](layer)


@pytest.mark.parametrize("sparsity, density, built", [("block", 1e-9, 0.5), ("block", 0.3, 0.5),
                                                      ("block-ell", 0.3, 0.5), ("block-diagonal", 0.4, 0.5)])
def test_a_density_the_grid_cannot_give_warns_with_the_density_built(sparsity, density, built):
    with pytest.warns(UserWarning, match=f"density={density!r} .* the layer has density {built:g}"):
        layer = sparsegen.linear(128, 256, sparsity=sparsity, density=density, block=(64, 64)) \
            if sparsity != "block-diagonal" else sparsegen.linear(128, 256, sparsity=sparsity, density=density)
    assert layer.density == built


def test_both_of_two_arguments_that_set_each_other_are_refused():
    with pytest.raises(InputError, match="nblocks or density, not both"):
        sparsegen.linear(128, 256, sparsity="block-diagonal", nblocks=2, density=0.5)
    with pytest.raises(InputError, match="per_row or density, not both"):
        sparsegen.linear(128, 256, sparsity="block-ell", per_row=1, density=0.5)


def test_a_block_diagonal_density_that_does_not_divide_names_the_density():
    with pytest.raises(InputError, match=r"density=0.3 means 3 diagonal blocks .*Pass nblocks="):
        sparsegen.linear(128, 256, sparsity="block-diagonal", density=0.3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU (the test is of a torch without CUDA)")
def test_a_cuda_device_without_cuda_is_an_input_error():
    with pytest.raises(InputError, match="Got 'cuda', but torch.cuda.is_available\\(\\) is False"):
        sparsegen.linear(128, 256, device="cuda")


RULE_VALUES = {"block": (32, 32), "density": 0.5, "layout": torch.ones(8, 4, dtype=torch.bool), "method": "magnitude",
               "training": {}, "weight_dtype": "int8", "nblocks": 2}


@pytest.mark.parametrize("sparsity, name", [(s, n) for s in RULE_SETTINGS for n in sorted(RULE_VALUES)
                                            if n not in RULE_SETTINGS[s]])
def test_a_rule_setting_the_sparsity_does_not_take_is_refused_by_name(sparsity, name):
    model = nn.Sequential(nn.Linear(128, 256))
    with pytest.raises(InputError, match=f"sparsity '{sparsity}' takes for '0'.*Got also {name}"):
        sparsegen.patch(model, {"0": {"sparsity": sparsity, name: RULE_VALUES[name]}})
    assert type(model[0]) is nn.Linear
