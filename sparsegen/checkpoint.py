"""Checks on what load_state_dict hands a layer, before torch copies anything: a file from
anywhere must not reach a kernel through a wrong shape or dtype (torch would raise a bare
RuntimeError for one, and cast the other silently)."""
from __future__ import annotations

import torch
from torch import nn

from .errors import expect


def check_entries(module: nn.Module, state_dict: dict, prefix: str, skip: tuple[str, ...] = ()) -> None:
    """Every entry of the module's own parameters and persistent buffers that state_dict
    holds: a tensor of the module's shape, floating where the module's is, else of its dtype."""
    own = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
    for name, current in own.items():
        key = prefix + name
        if name in skip or key not in state_dict or current is None:
            continue
        given = state_dict[key]
        expect(isinstance(given, torch.Tensor), f"state_dict['{key}'] as a tensor", type(given).__name__)
        expect(tuple(given.shape) == tuple(current.shape), f"state_dict['{key}'] of shape {tuple(current.shape)} "
               "(this layer's)", tuple(given.shape))
        same_kind = given.is_floating_point() if current.is_floating_point() else given.dtype == current.dtype
        expect(same_kind, f"state_dict['{key}'] of dtype {current.dtype}"
               + (" or another floating type" if current.is_floating_point() else ""), given.dtype)
