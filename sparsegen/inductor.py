"""Inductor lowerings of the forward ops: a compiled graph calls our Python launcher directly.

Called through the dispatcher (`torch.ops.sparsegen.bsr_dds.default(...)`), a forward op
costs its launch plus a boxed call into Python, a fresh output and a size check of it: on
the H100 machine's host about 2.4x a dense linear's call inside the same graph. Lowered
here, the graph allocates the output with its own buffers (reused across the graph) and
calls `extern_kernels.sparsegen_*(..., out=buf)`: the launcher and nothing else.

This reaches into Inductor's IR (`ExternKernelOut`), which is not a public API. Anything
missing there leaves the ops as they were (the dispatcher path), with one warning.
"""
from __future__ import annotations

import warnings

import torch

from . import calls, epilogues, lean, library, plans
from .bsr import ops as bsr_ops
from .semi24 import ops as sp24_ops


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

    for name, launcher in _LAUNCHERS.items():
        if not hasattr(extern_kernels, name):
            setattr(extern_kernels, name, launcher)

    def lowering(op, name: str, tensors: int, bias_at: int):
        """op(*tensor inputs (bias, at `bias_at`, may be None), *ints, out_features, epilogue)
        -> one [..., width] tensor (calls.fake_product's shape)."""
        @register_lowering(op, type_promotion_kind=None)
        def lower(*args):
            inputs, constants = args[:tensors], args[tensors:]
            present = [ir.ExternKernel.realize_input(t) for t in inputs if t is not None]
            x = present[0]
            size = [*x.get_size()[:-1], epilogues.output_features(constants[-1], constants[-2])]
            layout = ir.FixedLayout(x.get_device(), _output_dtype(op, x.get_dtype()), size)
            kernel = f"extern_kernels.{name}{'' if inputs[bias_at] is not None else '_no_bias'}"
            return ir.TensorBox.create(ir.ExternKernelOut(layout, present, constant_args=constants,
                                                          python_kernel_name=kernel))
        return lower

    lowering(torch.ops.sparsegen.bsr_dds.default, "sparsegen_bsr_dds", 6, bias_at=2)
    lowering(torch.ops.sparsegen.sp24_dds.default, "sparsegen_sp24_dds", 4, bias_at=3)


def _output_dtype(op, dtype: torch.dtype) -> torch.dtype:
    return sp24_ops.sp24_output_dtype(dtype) if op.name() == "sparsegen::sp24_dds" else dtype


def _fits(out: torch.Tensor) -> bool:
    """A buffer the kernels write in place: contiguous, 16-byte aligned."""
    return out.is_contiguous() and out.data_ptr() % 16 == 0


# The launchers' plans, per layout and call signature (the graph's checks ran when it was traced).
_PLANS = plans.PlanCache()


def _bsr_dds(x, values, bias, row_offsets, col_indices, flat_index, block_rows, block_cols, out_features, epilogue,
             *, out):
    plan = _PLANS.get(row_offsets, (x.shape, x.dtype, x.get_device(), epilogue), lambda: bsr_ops.bsr_lean_plan(
        x, values, row_offsets, col_indices, (block_rows, block_cols), out_features, epilogue))
    if plan is not None and lean.runs(plan, x) and _fits(out):
        plan.run(x, values, bias, out)
    elif x.is_cuda and calls.has_kernels(x.device.index or 0) and _fits(out):
        bsr_ops.bsr_dds(x, values, row_offsets, col_indices, bias, (block_rows, block_cols), out_features, out=out,
                    epilogue=epilogue)
    else:
        out.copy_(torch.ops.sparsegen.bsr_dds.default(x, values, bias, row_offsets, col_indices, flat_index,
                                                      block_rows, block_cols, out_features, epilogue))


def _bsr_dds_no_bias(x, values, row_offsets, col_indices, flat_index, *ints, out):
    _bsr_dds(x, values, None, row_offsets, col_indices, flat_index, *ints, out=out)


def _sp24_dds(x, values, metadata, bias, out_features, epilogue, *, out):
    plan = _PLANS.get(metadata, (x.shape, x.dtype, x.get_device(), values.data_ptr(), epilogue),
                      lambda: sp24_ops.sp24_lean_plan(x, values, metadata, out_features, epilogue))
    if plan is not None and lean.runs(plan, x) and _fits(out):
        plan.run(x, values, bias, out)
    elif calls.runs_16bit_kernels(x) and _fits(out):
        sp24_ops.sp24_dds(x, values, metadata, bias, out_features, out=out, epilogue=epilogue)
    else:
        out.copy_(torch.ops.sparsegen.sp24_dds.default(x, values, metadata, bias, out_features, epilogue))


def _sp24_dds_no_bias(x, values, metadata, out_features, epilogue, *, out):
    _sp24_dds(x, values, metadata, None, out_features, epilogue, out=out)


_LAUNCHERS = {"sparsegen_bsr_dds": _bsr_dds, "sparsegen_bsr_dds_no_bias": _bsr_dds_no_bias,
              "sparsegen_sp24_dds": _sp24_dds, "sparsegen_sp24_dds_no_bias": _sp24_dds_no_bias}

library.on_first_trace(register)
