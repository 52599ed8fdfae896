"""Inductor lowerings of the forward ops: a compiled graph calls our Python launcher directly.

Called through the dispatcher (`torch.ops.sparsegen.bsr_dds.default(...)`), a forward op
costs its launch plus a boxed call into Python, a fresh output and a size check of it: on
the H100 machine's host about 2.4x a dense linear's call inside the same graph. Lowered
here, the graph allocates the output with its own buffers (reused across the graph) and
calls `extern_kernels.sparsegen_*(..., out=buf)`: the launcher and nothing else.

Each layout registers its forward ops' launchers (registry.Lowering, in its compiled.py);
this module lowers whatever is registered and names no op itself.

This reaches into Inductor's IR (`ExternKernelOut`), which is not a public API. Anything
missing there leaves the ops as they were (the dispatcher path), with one warning.
"""
from __future__ import annotations

import itertools
import warnings

import torch

from .jit import epilogues, registry
from .launch import library


def register() -> None:
    """Register the lowerings (library.on_first_trace calls this once per process)."""
    try:
        _register()
    except Exception as error:  # an Inductor without these internals: the ops still work, slower
        warnings.warn(f"sparsegen: compiled graphs call the ops through the dispatcher ({error!r})",
                      RuntimeWarning, stacklevel=2)


def _register() -> None:
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings, register_lowering

    def lowering(spec: registry.Lowering):
        """op(*its declared arguments: registry.ProductArgs) -> one [..., width] tensor
        (calls.fake_product's shape), written by the layout's launcher."""
        names = _launchers(spec)

        @register_lowering(getattr(torch.ops.sparsegen, spec.op).default, type_promotion_kind=None)
        def lower(*args):
            inlined = None if spec.inline is None else spec.inline(args, lowerings, _computed_in_graph)
            if inlined is not None:
                return inlined
            tensors = len(spec.args.tensors)
            inputs, constants = args[:tensors], args[tensors:]
            present = [ir.ExternKernel.realize_input(t) for t in inputs if t is not None]
            x = present[0]
            out_features, epilogue = spec.args.out_features_and_epilogue(args)
            size = [*x.get_size()[:-1], epilogues.output_features(epilogue, out_features)]
            layout = ir.FixedLayout(x.get_device(), spec.output_dtype(x.get_dtype(), args), size)
            kernel = names[tuple(at for at, t in enumerate(inputs) if t is None)]
            return ir.TensorBox.create(ir.ExternKernelOut(layout, present, constant_args=constants,
                                                          python_kernel_name=kernel))
        return lower

    for spec in registry.lowerings():
        lowering(spec)


def _launchers(spec: registry.Lowering) -> dict[tuple[int, ...], str]:
    """{positions of the optional tensors a graph passes as None: the launcher's name in
    extern_kernels}, every combination set now: a graph from Inductor's cache calls them
    without lowering anything."""
    from torch._inductor.select_algorithm import extern_kernels
    optional = [spec.args.tensors.index(name) for name in spec.args.optional]
    names = {}
    for count in range(len(optional) + 1):
        for missing in itertools.combinations(optional, count):
            name = f"sparsegen_{spec.op}" + "".join(f"_no_{spec.args.tensors[at]}" for at in missing)
            if not hasattr(extern_kernels, name):
                setattr(extern_kernels, name, _with_none_at(spec.launcher, missing))
            names[missing] = f"extern_kernels.{name}"
    return names


def _with_none_at(launch, missing: tuple[int, ...]):
    """The launcher as a graph without those tensors calls it: None put back in their places."""
    if not missing:
        return launch
    if len(missing) == 1:
        at, = missing  # (read once: this runs per compiled call)

        def launcher(*args, out):
            launch(*args[:at], None, *args[at:], out=out)
        return launcher

    def launcher(*args, out):
        args = list(args)
        for at in missing:
            args.insert(at, None)
        launch(*args, out=out)
    return launcher


def _computed_in_graph(x) -> bool:
    """Whether Inductor generates x's loops itself (a pointwise or reduction, realized or not),
    so that what reads x may join that kernel; False for an extern kernel's output or an input."""
    from torch._inductor import ir
    node = x
    while isinstance(node, (ir.MutableBox, ir.BaseView)):
        node = node.data
    return isinstance(node, (ir.ComputedBuffer, ir.Loops))


library.on_first_trace(register)
