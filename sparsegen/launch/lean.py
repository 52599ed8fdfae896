"""Lean inference calls: a layer's repeated call with one input signature goes straight to
its planned launch.

A forward call of a small layer is bound by the host: on the H100 machine's slow host the
checks, decisions and lookups of a block-sparse call cost more than its launch (about 45 us
a call against nn.Linear's 29, tools/probe_host.py). Inference calls repeat the same
signature, so the layer decides once per (input shape, dtype, device, epilogue): the input
checks, the plan (ops.*_lean_plan: kernel, grid, packed parameters) and the output's shape.
Each later call checks only what can change between calls - the input's address and
alignment, the weight's address and version - allocates Y and launches.

Calls that record autograd, run under autocast or are traced by torch.compile take the
full path; so does anything the lean path was not planned for (None from here).
"""
from __future__ import annotations

import torch

# A private but long-standing torch call (torch.utils.checkpoint uses it); where it is
# missing, every call takes the full path.
any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def applies(x) -> bool:
    """Whether a forward call may take the lean path: a plain tensor, no autocast, not traced.
    (Autograd is checked with the weights, in LeanLayer.)"""
    return type(x) is torch.Tensor and not torch.compiler.is_compiling() and not any_autocast()


def runs(plan, x: torch.Tensor) -> bool:
    """Whether `plan` (a lean plan) runs this call: x contiguous and 16-byte aligned, and no
    CUDA graph capture where the plan's graphs take the dense path."""
    if not (x.is_contiguous() and x.data_ptr() % 16 == 0):
        return False
    return not (plan.dense and torch.cuda.is_current_stream_capturing())


def runs_into(plan, x: torch.Tensor, out: torch.Tensor, addresses: int) -> bool:
    """Whether a lean plan runs a compiled graph's call into `out`: x and out contiguous and
    16-byte aligned (`addresses`: their data_ptr() or-ed, read once by the launcher), and no
    CUDA graph capture where the plan's graphs take the dense path."""
    return (not addresses & 15 and x.is_contiguous() and out.is_contiguous()
            and not (plan.dense and torch.cuda.is_current_stream_capturing()))


class LeanCall:
    """One layer's inference call for one input signature: a plan (its `run(x2, values, bias,
    y)` launches), Y's shape, dtype and device, and the weights it was planned with."""

    __slots__ = ("plan", "shape", "dtype", "device", "values_at", "bias_at", "version")

    def __init__(self, plan, x: torch.Tensor, values: torch.Tensor, bias):
        self.plan, self.dtype, self.device = plan, x.dtype, x.device  # (16-bit products: Y in x's dtype)
        self.shape = (*x.shape[:-1], plan.width)
        self.values_at, self.bias_at = values.data_ptr(), 0 if bias is None else bias.data_ptr()
        # A plan with the dense path (inside CUDA graphs) has its weight's dense copy built
        # now, for this version of the weight: a newer one rebuilds it through the full path.
        self.version = values._version if plan.dense else None


MAX_SIGNATURES = 64  # a layer's signatures kept at once


class LeanLayer:
    """The lean path of a sparse linear layer whose parameters are `values` and `bias`. The
    layer defines `_lean_call(x, values, bias)`: a LeanCall after checking the inputs (errors
    raise there), or None where its calls of this signature always take the full path.

    One function, written flat, reading the parameters from `_parameters`: on a 2-core dev
    machine a module attribute (nn.Module.__getattr__) costs 0.44 us, and this path (Y's
    allocation, 0.9 us, included) 2.1 us, against 3.4 us with the weights read as attributes
    and the checks in helpers."""

    _values_in = "_parameters"  # the module dict that holds the weight the calls are planned on
    _values_name = "values"     # its name there (a 4-bit layer's: its buffer "qweight")

    def _lean_forward(self, x) -> torch.Tensor | None:
        """Y for x on the lean path, or None: the caller takes its full path."""
        if not applies(x):
            return None
        values, bias = self.__dict__[self._values_in][self._values_name], self._parameters.get("bias")
        if torch.is_grad_enabled() and (x.requires_grad or values.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return None  # autograd records this call
        calls = self.__dict__.get("_lean_calls")
        if calls is None:
            calls = self.__dict__["_lean_calls"] = {}
        key = (x.shape, x.dtype, x.get_device(), self.epilogue)
        call = calls.get(key, False)
        if call is False or (call is not None and not (
                values.data_ptr() == call.values_at and (0 if bias is None else bias.data_ptr()) == call.bias_at
                and (call.version is None or values._version == call.version))):
            call = self._new_lean_call(calls, key, x, values, bias)
        if call is None or not runs(call.plan, x):
            return None
        y = torch.empty(*call.shape, dtype=call.dtype, device=call.device)
        call.plan.run(x, values, bias, y)
        return y

    def _new_lean_call(self, calls: dict, key: tuple, x, values, bias) -> LeanCall | None:
        if len(calls) >= MAX_SIGNATURES:
            calls.clear()  # (a stream of new shapes, such as growing sequences, keeps no history)
        call = self._lean_call(x, values, bias)
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):  # (one made in a capture may point into it)
            calls[key] = call
        return call

    def _forget_lean_calls(self) -> None:
        """After the layer's tensors were replaced (to(), a new layout): plan again."""
        self.__dict__.pop("_lean_calls", None)

    def __setattr__(self, name: str, value) -> None:
        """A tensor assigned to the layer (a new metadata or scales buffer, say) may be one a
        plan points into: plan again. (Calls check only the weight's and bias's addresses.)"""
        if isinstance(value, torch.Tensor):
            self.__dict__.pop("_lean_calls", None)
        super().__setattr__(name, value)

    def _apply(self, fn, *args, **kwargs):
        self._forget_lean_calls()
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self) -> dict:
        """What copy.deepcopy, pickle and torch.save keep: the module without its lean calls.
        They are a cache of launches (driver handles, packed pointers into this layer's
        tensors) that a copy could not use anyway; the copy plans again on its first call."""
        state = super().__getstate__()
        if "_lean_calls" in state:
            state = {key: value for key, value in state.items() if key != "_lean_calls"}
        return state
