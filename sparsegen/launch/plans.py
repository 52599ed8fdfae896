"""Launch plans: what a call launches, decided once per layout and input signature.

A layer's calls repeat the same decisions (kernel family, variant, grid, index pointers)
call after call; on a slow host each decision costs microseconds. A plan keeps the
decisions' result, keyed by the layout's index tensor (by identity, checked through a weak
reference, so a plan never outlives the tensors it points into) and the signature of the
call (token count, dtype, device...). Each call is then the checks and the launch.
A plan must not hold its key tensor: the cache's entry would then keep it alive, and a
layout made per step (a training layer's fresh 2:4 compression) would never be freed.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from .memory import allocating


class PlanCache:
    """plan = cache.get(owner, signature, make): make() on the first call for (owner, signature)."""

    def __init__(self):
        self._plans: dict = {}
        _CACHES.add(self)

    def clear(self) -> None:
        self._plans.clear()

    def get(self, owner: torch.Tensor, signature: tuple, make: Callable):
        key = (id(owner), signature)
        entry = self._plans.get(key)
        if entry is not None and entry[0]() is owner:
            return entry[1]
        with allocating("a launch plan (the aligned copies of the operands it reads)"):
            plan = make()
        # A plan made during CUDA graph capture may point into tensors that live only as
        # long as the capture: use it once, keep none.
        if not (owner.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._plans[key] = (weakref.ref(owner, lambda _, key=key: self._plans.pop(key, None)), plan)
        return plan


class SignatureCache:
    """plan = cache.get(signature, make): one plan per call signature, whatever the operands,
    for plans that bind every operand per call (a weight made in the step that uses it: a
    plan per weight would be made, whole, on every call)."""

    MAX_SIGNATURES = 256  # a stream of new shapes keeps no history past this

    def __init__(self):
        self._plans: dict = {}
        _CACHES.add(self)

    def clear(self) -> None:
        self._plans.clear()

    def get(self, signature: tuple, make: Callable):
        plan = self._plans.get(signature)
        if plan is None:
            with allocating("a launch plan"):
                plan = make()
            if len(self._plans) >= self.MAX_SIGNATURES:
                self._plans.clear()
            self._plans[signature] = plan
        return plan


_CACHES: "weakref.WeakSet[PlanCache | SignatureCache]" = weakref.WeakSet()


def forget_all() -> None:
    """Drop every plan: their decisions (the dense path) follow a crossover table just reloaded."""
    for cache in list(_CACHES):
        cache.clear()


def run_product(launch, x2: torch.Tensor, values: torch.Tensor, bias, y: torch.Tensor) -> None:
    """Launch a planned product (runtime.PackedLaunch) on these operands: X and W bound as its
    first two parameters (pointers or TMA maps), bias and Y as its last two pointers."""
    run_product_at(launch, x2.data_ptr(), values.data_ptr(), bias, y.data_ptr())


def run_product_at(launch, x_address: int, values_address: int, bias, y_address: int) -> None:
    """run_product given X's, W's and Y's addresses (a compiled graph's launcher reads them once)."""
    pointers = launch.pointers
    with launch.lock:
        launch.bind(0, x_address)
        launch.bind(1, values_address)
        pointers[-2], pointers[-1] = bias.data_ptr() if bias is not None else 0, y_address
        launch.run()
