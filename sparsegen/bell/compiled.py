"""The block-ELL forward as a compiled graph calls it (registry.Lowering, inductor.py): into
Inductor's own output buffer, by the lean plan where there is one."""
from __future__ import annotations

from .. import calls, lean, registry
from . import ops


def bell_dds_into(x, values, bias, cols, out_features, epilogue, *, out):
    plan = ops.bell_lean_plan(x, values, cols, out_features, epilogue) if calls.fits_in_place(out) else None
    if plan is not None and lean.runs(plan, x):
        plan.run(x, values, bias, out)
    else:
        out.copy_(ops.bell_dds_op(x, values, bias, cols, out_features, epilogue))


LOWERINGS = (registry.Lowering("bell_dds", bell_dds_into, tensors=4, bias_at=2),)
