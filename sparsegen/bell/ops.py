"""Ops over block-ELL weights: the CPU reference, the GPU launch (planned once per index and
call signature) and the custom op torch.compile traces."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import calls, epilogues, library, plans, runtime
from . import dispatch
from . import format as ell


def reference(x, values, cols, bias, out_features: int, epilogue: str = "none"):
    """Pure PyTorch: the dense weight, F.linear, the epilogue (differentiable, traceable)."""
    weight = ell.to_dense(values, cols, (out_features, x.shape[-1]))
    return epilogues.reference(F.linear(x, weight, bias), epilogue)


def bell_dds_any_device(x, values, bias, cols, out_features: int, epilogue: str = "none"):
    if x.is_cuda and calls.has_kernels(x.device.index or 0):
        return bell_dds(x, values, cols, bias, out_features, epilogue)
    return reference(x, values, cols, bias, out_features, epilogue)


bell_dds_op = library.define(
    "bell_dds(Tensor x, Tensor values, Tensor? bias, Tensor cols, int out_features, str epilogue) -> Tensor",
    bell_dds_any_device, calls.fake_product)


def bell_dds(x, values, cols, bias, out_features: int, epilogue: str = "none", out=None, tile=None, instr=None,
             acc="f32"):
    """epilogue(X W^T + b) on the GPU; x may have leading batch dims. `out` (contiguous,
    16-byte aligned) receives Y when given; `tile`, `instr` and `acc` (spec.ACCS: "f16" for
    fp16 inputs, on the mma.sync kernel) override the default kernel."""
    x2 = calls.rows_2d(x)
    if x2.shape[0] == 0:
        return calls.product_without_weight(x, x2, bias, out, out_features, epilogue)
    if calls.kernel_left_to_dispatch(tile, instr, acc):
        plan = _PLANS.get(cols, (x2.shape[0], x2.dtype, out_features, epilogue),
                          lambda: _plan(x2, values, cols, out_features, epilogue))
    else:
        plan = _plan(x2, values, cols, out_features, epilogue, tile, instr, acc)
    y, shaped = calls.output_for(x, x2, out, plan.width)
    plan.run(x2, calls.aligned(values), bias, y)
    return shaped


def bell_lean_plan(x, values, cols, out_features: int, epilogue: str = "none"):
    """The plan repeated inference calls of x's signature run straight (lean.py), or None
    where they take bell_dds: off the GPU, no rows, a CUDA graph capture."""
    if not (x.is_cuda and calls.has_kernels(x.device.index or 0) and x.numel() and calls.tma_ready(values)):
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    x2 = calls.rows_2d(x)
    return _PLANS.get(cols, (x2.shape[0], x2.dtype, out_features, epilogue),
                      lambda: _plan(x2, values, cols, out_features, epilogue))


@dataclasses.dataclass(frozen=True)
class _EllPlan:
    launch: runtime.PackedLaunch    # X and W (pointers or TMA maps), cols, bias, Y
    width: int                      # Y's columns
    dense: bool = False             # (lean.py asks: this layout has no dense path)

    def run(self, x2: torch.Tensor, values: torch.Tensor, bias, y: torch.Tensor) -> None:
        plans.run_product(self.launch, x2, values, bias, y)


_PLANS = plans.PlanCache()


def _plan(x2, values, cols, out_features: int, epilogue: str, tile=None, instr=None, acc="f32") -> _EllPlan:
    (m, k), (rows, per_row, bm, bk) = x2.shape, values.shape
    kern = dispatch.forward_kernel((bm, bk), x2.dtype, x2.device.index or 0, per_row, m <= dispatch.SMALL_ROWS,
                                   epilogue, tile, instr, acc)
    spec, stored_rows = kern.spec, rows * per_row * bm  # W's stored blocks as rows of a [*, bk] matrix
    maps = () if spec.instr == "mma" else (
        (x2.dtype, m, k, spec.tile.tile_m, min(bk, 64)), (values.dtype, stored_rows, bk, bm, min(bk, 64)))
    pointers = (0,) * (2 - len(maps)) + (cols.data_ptr(), 0, 0)
    ints = (m, k, rows * bm) + (() if spec.instr == "mma" else (stored_rows,))
    launch = runtime.PackedLaunch(kern, _grid(kern, m, rows), maps, pointers, ints)
    return _EllPlan(launch, epilogues.output_features(epilogue, rows * bm))


def _grid(kern, m: int, block_rows: int) -> tuple[int, int, int]:
    tiles = (block_rows, -(-m // kern.spec.tile.tile_m))
    if kern.spec.instr == "mma":
        return (*tiles, 1)
    return (min(tiles[0] * tiles[1], runtime.sm_count(kern.device_index)), 1, 1)  # persistent
