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


FACES = (registry.Face("2:4", ("weight_dtype", *TRAINING_OPTIONS), build),)
