"""Checks on what load_state_dict hands a layer, before torch copies anything: a file from
anywhere must not reach a kernel through a wrong shape or dtype (torch would raise a bare
RuntimeError for one, and cast the other silently)."""
from __future__ import annotations

import torch
from torch import nn

from .errors import expect


class CheckedLoad:
    """A layer whose load_state_dict checks every entry before torch copies any: its own
    check (_check_state: 2:4 metadata, a mask, a layout), then check_entries. Entries named
    in _rebuilt are never taken from the file: the layer's current tensors stand in for
    them, and _after_load derives them again from what was loaded. Entries named in
    _optional may be missing from a file (an older version's): the current ones stay."""

    _rebuilt: tuple[str, ...] = ()
    _optional: tuple[str, ...] = ()

    def _check_state(self, state_dict: dict, prefix: str) -> None:
        """The layer's own check of what it is about to load."""

    def _after_load(self) -> None:
        """What the layer rebuilds from what it loaded."""

    def _load_from_state_dict(self, state_dict, prefix, *args):
        for adapt in getattr(self, "_load_adapters", ()):  # (sparsegen.parallel: a whole layer's
            adapt(state_dict, prefix)                       # entries become this rank's part first)
        self._check_state(state_dict, prefix)
        state = dict(state_dict)
        state.update({prefix + name: getattr(self, name) for name in self._rebuilt if prefix + name in state})
        state.update({prefix + name: getattr(self, name) for name in self._optional if prefix + name not in state})
        check_entries(self, state, prefix)
        super()._load_from_state_dict(state, prefix, *args)
        self._after_load()
        derived = {*self._non_persistent_buffers_set, *self._rebuilt, *self._optional}
        if all(prefix + name in state_dict for name, b in self._buffers.items() if b is not None and name not in derived):
            self.__dict__.pop("_awaits_load", None)  # (its layout, metadata or mask came from the file)

    def _apply(self, fn, *args, **kwargs):
        """As nn.Module's; a layer whose buffers leave the meta device (to_empty) holds index
        bytes nobody wrote, so it refuses to run (refuse_unloaded) until a state_dict loads."""
        was_meta = any(b is not None and b.is_meta for b in self._buffers.values())
        result = super()._apply(fn, *args, **kwargs)
        if was_meta and not any(b is not None and b.is_meta for b in self._buffers.values()):
            self.__dict__["_awaits_load"] = True
        return result


def refuse_unloaded(layer: nn.Module) -> None:
    """A forward's answer where `"_awaits_load" in layer.__dict__` (its first check, written
    inline: a dict lookup per call): a layer built on the meta device and given memory by
    to_empty without a load - its layout or metadata would be uninitialized bytes into a kernel."""
    expect(False, f"a {type(layer).__name__} built on the meta device to get its layout from load_state_dict "
           "after to_empty (or one built off the meta device, for a random layout)",
           "a call before any load: its index buffers hold uninitialized memory")


def check_entries(module: nn.Module, state_dict: dict, prefix: str) -> None:
    """Every entry of the module's own parameters and buffers that state_dict holds: a
    tensor of the module's shape, floating where the module's is, else of its dtype."""
    own = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
    for name, current in own.items():
        key = prefix + name
        if key not in state_dict or current is None:
            continue
        given = state_dict[key]
        expect(isinstance(given, torch.Tensor), f"state_dict['{key}'] as a tensor", type(given).__name__)
        expect(tuple(given.shape) == tuple(current.shape), f"state_dict['{key}'] of shape {tuple(current.shape)} "
               "(this layer's)", tuple(given.shape))
        same_kind = given.is_floating_point() if current.is_floating_point() else given.dtype == current.dtype
        expect(same_kind, f"state_dict['{key}'] of dtype {current.dtype}"
               + (" or another floating type" if current.is_floating_point() else ""), given.dtype)
