"""How users ask for 2:4 layers: sparsegen.linear(sparsity="2:4") gives a Sparse24Linear; with
2by4-pretrain options a Sparse24TrainingLinear; with weight_dtype a ScaledSparse24Linear
(registry.Face)."""
from __future__ import annotations

import torch

from ..errors import expect
from ..jit import registry
from .nn import Sparse24Linear
from .scaled import ScaledSparse24Linear
from .train import Sparse24TrainingLinear

TRAINING_OPTIONS = ("method", "mask_interval", "dw_sparse", "soft_threshold")


def build(in_features, out_features, bias, device, dtype, given):
    recipe = {name: given[name] for name in TRAINING_OPTIONS if name in given}
    if "weight_dtype" in given:
        expect(not recipe, "no training options for one-byte weights (an inference layer)", sorted(recipe))
        dense = torch.nn.Linear(in_features, out_features, bias, device, dtype)
        return ScaledSparse24Linear.from_dense(dense, given["weight_dtype"])
    if recipe:
        return Sparse24TrainingLinear(in_features, out_features, bias, device, dtype, **recipe)
    return Sparse24Linear(in_features, out_features, bias, device, dtype)


def patched(linear, settings: dict, from_dense: bool):
    """A patch rule's layer, always pruned from the linear's weight: the 2by4 recipe's with
    "training", a one-byte one with "weight_dtype", else a Sparse24Linear by "method"."""
    if "training" in settings:  # 2by4-pretrain style: dense weights, 2:4 products
        return Sparse24TrainingLinear.from_dense(linear, **dict(settings["training"]))
    if "weight_dtype" in settings:  # one-byte weights and activations, scaled
        return ScaledSparse24Linear.from_dense(linear, settings["weight_dtype"], settings.get("method", "magnitude"))
    return Sparse24Linear.from_dense(linear, settings.get("method", "magnitude"))


def check_rule(pattern: str, settings: dict) -> None:
    expect("weight_dtype" not in settings or "training" not in settings,
           f"weight_dtype or training for {pattern!r}, not both (one-byte layers are for inference)", settings)
    training = settings.get("training", {})
    options = ("mask_interval", "method", "dw_sparse", "soft_threshold")
    expect(isinstance(training, dict) and set(training) <= set(options),
           f"'training' settings for {pattern!r} as a dict with keys from {options}", training)


FACES = (registry.Face("2:4", ("weight_dtype", *TRAINING_OPTIONS), build, rule=("method", "training", "weight_dtype"),
                       patch=patched, check_rule=check_rule, pairs=lambda settings: "training" not in settings,
                       examples=(("weight_dtype", "int8", lambda layer: layer.values.dtype == torch.int8),
                                 ("method", "magnitude", lambda layer: layer.method == "magnitude"),
                                 ("mask_interval", 7, lambda layer: layer.mask_interval == 7),
                                 ("dw_sparse", True, lambda layer: layer.dw_sparse),
                                 ("soft_threshold", True, lambda layer: layer.soft_threshold)),
                       tuning=registry.Tuning("sp24", (((0, 0), 1.0),),
                                              lambda n, k, block, density, **factory: Sparse24Linear(k, n, **factory),
                                              fits=lambda n, k, block, density: True)),)
