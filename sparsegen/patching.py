"""sparsegen.patch: swap a model's linear layers for block-sparse ones, by name pattern."""
from __future__ import annotations

import copy
import re

import torch
from torch import nn

from .errors import InputError, expect
from .nn import BlockSparseLinear
from .nn24 import Sparse24Linear
from .train24 import Sparse24TrainingLinear

_SETTINGS = ("block", "density", "layout", "sparsity", "method", "training")


def patch(model: nn.Module, rules: dict, from_dense: bool = True) -> list[str]:
    """Replace, in place, every linear layer whose qualified name (as in named_modules())
    fully matches a pattern of `rules` by a BlockSparseLinear built with that pattern's
    settings ({"block": (32, 32), "density": 0.5} or {"layout": mask}), or by a
    Sparse24Linear for {"sparsity": "2:4"} (optional "method": "magnitude" or
    "transposable"; always pruned from the dense weights), or a Sparse24TrainingLinear for
    {"sparsity": "2:4", "training": {options}}; the first matching pattern wins.
    With from_dense, the blocks of largest norm keep their pretrained values.
    Returns the replaced names. Every rule is checked before anything changes.
    """
    expect(isinstance(rules, dict) and rules, "rules as a non-empty {pattern: settings} dict", rules)
    plan = _plan(model, rules)
    built = {name: _build(module, settings, from_dense, name) for name, module, settings in plan}
    for name, layer in built.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return list(built)


def _plan(model: nn.Module, rules: dict) -> list[tuple[str, nn.Module, dict]]:
    compiled = [(pattern, re.compile(pattern), _checked(pattern, settings)) for pattern, settings in rules.items()]
    linears = [(name, module) for name, module in model.named_modules() if _dense_weight(module) is not None]
    plan, used = [], set()
    for name, module in linears:
        for pattern, regex, settings in compiled:
            if regex.fullmatch(name):
                plan.append((name, module, settings))
                used.add(pattern)
                break
    unused = [pattern for pattern, _, _ in compiled if pattern not in used]
    names = ", ".join(name for name, _ in linears[:8]) + (", ..." if len(linears) > 8 else "")
    expect(not unused, "every pattern to match a linear layer's full name "
           f"({'they are: ' + names if linears else 'the model has none'})", f"no match for {unused}")
    return plan


def _checked(pattern: str, settings) -> dict:
    expect(isinstance(settings, dict) and set(settings) <= set(_SETTINGS),
           f"settings for {pattern!r} as a dict with keys from {_SETTINGS}", settings)
    return dict(settings)


def _dense_weight(module: nn.Module) -> torch.Tensor | None:
    """[out, in] weight of an nn.Linear, or of a transformers Conv1D (stored [in, out])."""
    if type(module) is nn.Linear:  # not subclasses: MultiheadAttention reads out_proj.weight itself
        return module.weight
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return module.weight.t()
    return None


def _build(module: nn.Module, settings: dict, from_dense: bool, name: str) -> nn.Module:
    weight = _dense_weight(module)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None,
                       device="meta")
    linear.weight, linear.bias = nn.Parameter(weight.detach()), module.bias
    block = tuple(settings.get("block", (32, 32)))
    try:
        if settings.get("sparsity", "block") == "2:4":  # 2:4 always prunes the given weights
            if "training" in settings:  # 2by4-pretrain style: dense weights, 2:4 products
                return Sparse24TrainingLinear.from_dense(linear, **dict(settings["training"]))
            return Sparse24Linear.from_dense(linear, settings.get("method", "magnitude"))
        expect(settings.get("sparsity", "block") == "block", "sparsity 'block' or '2:4'",
               repr(settings.get("sparsity")))
        if from_dense:
            return BlockSparseLinear.from_dense(linear, block, settings.get("density", 0.5),
                                                settings.get("layout"))
        return BlockSparseLinear(linear.in_features, linear.out_features, block,
                                 settings.get("density", 0.5), module.bias is not None,
                                 weight.device, weight.dtype, settings.get("layout"))
    except InputError as error:
        raise InputError(f"{name}: {error}") from None


def dense_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with every sparsegen layer replaced by the nn.Linear of its
    (masked) weight: the dense model that computes what the sparse one does (to check a
    patched model against, or to export where sparsegen is not installed)."""
    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        if isinstance(module, (BlockSparseLinear, Sparse24Linear, Sparse24TrainingLinear)):
            parent, _, child = name.rpartition(".")
            setattr(twin.get_submodule(parent) if parent else twin, child, module.to_linear())
    return twin
