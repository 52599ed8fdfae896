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
    from torch._inductor.lowering import register_lowering
    from torch._inductor.select_algorithm import extern_kernels

    def lowering(spec: registry.Lowering):
        """op(*its declared arguments: registry.ProductArgs) -> one [..., width] tensor
        (calls.fake_product's shape), written by the layout's launcher."""
        name = f"sparsegen_{spec.op}"
        for kernel_name, launcher in ((name, spec.launcher), (f"{name}_no_bias", _without_bias(spec))):
            if not hasattr(extern_kernels, kernel_name):
                setattr(extern_kernels, kernel_name, launcher)

        @register_lowering(getattr(torch.ops.sparsegen, spec.op).default, type_promotion_kind=None)
        def lower(*args):
            tensors = len(spec.args.tensors)
            inputs, constants = args[:tensors], args[tensors:]
            present = [ir.ExternKernel.realize_input(t) for t in inputs if t is not None]
            x = present[0]
            out_features, epilogue = spec.args.out_features_and_epilogue(args)
            size = [*x.get_size()[:-1], epilogues.output_features(epilogue, out_features)]
            layout = ir.FixedLayout(x.get_device(), spec.output_dtype(x.get_dtype(), args), size)
            kernel = f"extern_kernels.{name}{'' if inputs[spec.args.bias_at] is not None else '_no_bias'}"
            return ir.TensorBox.create(ir.ExternKernelOut(layout, present, constant_args=constants,
                                                          python_kernel_name=kernel))
        return lower

    for spec in registry.lowerings():
        lowering(spec)


def _without_bias(spec: registry.Lowering):
    """The launcher as a graph without a bias calls it: the tensors but bias, then the rest."""
    bias_at, launch = spec.args.bias_at, spec.launcher  # (read once: this runs per compiled call)

    def launcher(*args, out):
        launch(*args[:bias_at], None, *args[bias_at:], out=out)
    return launcher


library.on_first_trace(register)
