"""The block-sparse forward as a compiled graph calls it (registry.Lowering, inductor.py):
into Inductor's own output buffer, by the lean plan where there is one."""
from __future__ import annotations

import torch

from ..launch import calls, lean, plans
from ..jit import registry
from . import ops

# The launcher's plans, per layout and call signature (the graph's checks ran when it was traced).
_PLANS = plans.PlanCache()


def bsr_dds_into(x, values, bias, row_offsets, col_indices, flat_index, block_rows, block_cols, out_features,
                 epilogue, *, out):
    # (keyed by the layout, whose device X shares in any graph that ran its checks)
    plan = _PLANS.get(row_offsets, (x.shape, x.dtype, epilogue), lambda: ops.bsr_lean_plan(
        x, values, row_offsets, col_indices, (block_rows, block_cols), out_features, epilogue))
    x_address, y_address = x.data_ptr(), out.data_ptr()
    if plan is not None and lean.runs_into(plan, x, out, x_address | y_address):
        plan.run_at(x_address, values.data_ptr(), bias, y_address)
    elif x.is_cuda and calls.has_kernels(x.device.index or 0) and calls.fits_in_place(out):
        ops.bsr_dds(x, values, row_offsets, col_indices, bias, (block_rows, block_cols), out_features, out=out,
                    epilogue=epilogue)
    else:
        out.copy_(torch.ops.sparsegen.bsr_dds.default(x, values, bias, row_offsets, col_indices, flat_index,
                                                      block_rows, block_cols, out_features, epilogue))


LOWERINGS = (registry.Lowering("bsr_dds", bsr_dds_into),)
