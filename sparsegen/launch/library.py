"""sparsegen's ops in torch.library, registered through its low-level API.

torch.library.custom_op wraps every call in Python (an autograd wrapper, then a redispatch):
about 8 us a call on a fast host, 3-4x that on the slow ones, and inside a compiled graph
that is most of a small layer's host time. Here the dispatcher calls our implementation
directly (about 2 us). The ops carry no gradient of their own: the layers' autograd
Functions (each layout's autograd.py) compose them, and torch.compile traces those
Functions, so a compiled graph calls these ops and nothing heavier.
"""
from __future__ import annotations

import importlib

import torch

_LIBRARY = torch.library.Library("sparsegen", "DEF")


def define(schema: str, implementation, fake):
    """sparsegen::<schema> with `implementation` on every device and `fake` (shapes only)
    for torch.compile. Returns the op's overload, which callers invoke like a function."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, implementation, "CompositeExplicitAutograd")
    torch.library.register_fake(f"sparsegen::{name}", _first_trace_runs_hooks(fake), lib=_LIBRARY)
    return getattr(torch.ops.sparsegen, name).default


def eager_or_op(op, implementation):
    """A function that calls `op` while torch.compile traces (the compiled graph then calls
    the op) and `implementation` straight in eager mode (no dispatcher on that path)."""
    def call(*args):
        return (op if torch.compiler.is_compiling() else implementation)(*args)
    return call


_ON_FIRST_TRACE: list = []
_LOADED: list = []  # (sparsegen.load ran: `import sparsegen` loads its names on first use)


def on_first_trace(hook) -> None:
    """hook() before the first trace of any sparsegen op (torch.compile runs the fake
    implementations, in plain Python, before Inductor lowers the graph)."""
    _ON_FIRST_TRACE.append(hook)


def _first_trace_runs_hooks(fake):
    def traced(*args):
        if not _LOADED:  # a model unpickled from its layers' modules alone has no lowerings yet
            _LOADED.append(True)
            importlib.import_module("sparsegen").load()  # (sparsegen.inductor adds its hook here)
        while _ON_FIRST_TRACE:
            _ON_FIRST_TRACE.pop()()
        return fake(*args)
    return traced


def rows_by(x: torch.Tensor, out_features: int) -> torch.Tensor:
    """A fake result: x's leading dims by out_features (what a linear returns)."""
    return x.new_empty((*x.shape[:-1], out_features))
