"""The 2:4 forward as a compiled graph calls it (registry.Lowering, inductor.py): into
Inductor's own output buffer, by the lean plan where there is one."""
from __future__ import annotations

import torch

from ..launch import calls, lean, plans, runtime
from ..jit import registry
from . import autograd  # noqa: F401 (defines torch.ops.sparsegen.sp24_dds, the fallback below)
from . import dispatch, ops
from . import scaled  # (defines torch.ops.sparsegen.sp24_scaled_dds and sp24_scaled_linear)

# The launcher's plans, per weight and call signature (the graph's checks ran when it was traced).
_PLANS = plans.PlanCache()


# Plans are keyed by the weight (whose device X shares in any graph that ran its checks)
# and what of the call may differ between graphs: each launch of a compiled decode step pays
# for every query made here.
def sp24_dds_into(x, values, metadata, bias, out_features, epilogue, *, out):
    plan = _PLANS.get(metadata, (x.shape, x.dtype, values.data_ptr(), epilogue),
                      lambda: ops.sp24_lean_plan(x, values, metadata, out_features, epilogue))
    x_address, y_address = x.data_ptr(), out.data_ptr()
    if plan is not None and lean.runs_into(plan, x, out, x_address | y_address):
        plan.run_at(x_address, bias.data_ptr() if bias is not None else 0, y_address)
    elif calls.runs_16bit_kernels(x) and calls.fits_in_place(out):
        ops.sp24_dds(x, values, metadata, bias, out_features, out=out, epilogue=epilogue)
    else:
        out.copy_(torch.ops.sparsegen.sp24_dds.default(x, values, metadata, bias, out_features, epilogue))


class _ScaledArgs:
    """sp24_scaled_dds's arguments as the lowering reads them (scaled.py's schema: x, values,
    metadata, x_scale, w_scale, bias, then epilogue and Y's dtype)."""
    tensors = ("x", "values", "metadata", "x_scale", "w_scale", "bias")
    optional = ("bias",)

    @staticmethod
    def out_features_and_epilogue(args: tuple) -> tuple:
        return args[1].get_size()[0], args[6]


_SCALED_PLANS = plans.PlanCache()


def sp24_scaled_dds_into(x, values, metadata, x_scale, w_scale, bias, epilogue, out_dtype, *, out):
    """The scaled product into Inductor's buffer, by the lean plan where there is one: without
    this a compiled decode step paid a boxed dispatcher call into Python, a fresh output and the
    full path's checks for every one-byte layer."""
    code = ops.SCALED_OUTPUT_CODES.get(out_dtype)
    plan = None if code is None else _SCALED_PLANS.get(
        metadata, (x.shape, x.dtype, values.data_ptr(), epilogue, code),
        lambda: ops.sp24_scaled_lean_plan(x, values, metadata, values.shape[0], epilogue, code))
    x_address, y_address = x.data_ptr(), out.data_ptr()
    if plan is not None and lean.runs_into(plan, x, out, x_address | y_address) and x_scale.is_contiguous():
        plan.run_at(x_address, bias.data_ptr() if bias is not None else 0, y_address, (x_scale, w_scale, code))
    elif ops.runs_byte_kernels(values) and calls.fits_in_place(out):
        ops.sp24_scaled_dds(x, values, metadata, x_scale, w_scale, bias, values.shape[0], out_dtype, out=out,
                            epilogue=epilogue)
    else:
        out.copy_(torch.ops.sparsegen.sp24_scaled_dds.default(x, values, metadata, x_scale, w_scale, bias, epilogue,
                                                              out_dtype))


class _ScaledLinearArgs:
    """sp24_scaled_linear's (scaled.py): x, values, metadata, w_scale, bias, input_scale, then
    epilogue and Y's dtype."""
    tensors = ("x", "values", "metadata", "w_scale", "bias", "input_scale")
    optional = ("bias", "input_scale")

    @staticmethod
    def out_features_and_epilogue(args: tuple) -> tuple:
        return args[1].get_size()[0], args[6]


_QUANTIZING_PLANS = plans.PlanCache()


def sp24_scaled_linear_into(x, values, metadata, w_scale, bias, input_scale, epilogue, out_dtype, *, out):
    """The scaled product into Inductor's buffer: by a kernel that quantizes x itself (a decode
    step: one launch), else after the sp24_quantize kernel."""
    plan = None if x.dtype != out_dtype else _QUANTIZING_PLANS.get(
        metadata, (x.shape, x.dtype, values.data_ptr(), epilogue),
        lambda: ops.sp24_quantizing_lean_plan(x, values, metadata, values.shape[0], epilogue))
    x_address, y_address = x.data_ptr(), out.data_ptr()
    if (plan is not None and lean.runs_into(plan, x, out, x_address | y_address)
            and not runtime.capturing()):  # (graphs: the two kernels, ops.quantizes_in_product)
        plan.run_at(x_address, bias.data_ptr() if bias is not None else 0, y_address, (input_scale, w_scale, None))
        return
    if _empty_strided_cuda is not None and ops.runs_byte_kernels(values) and ops.quantizes_on_kernel(x):
        xq, x_scale = _quantized_by_plan(x, values.dtype, input_scale)
    else:
        xq, x_scale = scaled.quantized_activations(x, values, input_scale)
    sp24_scaled_dds_into(xq, values, metadata, x_scale, w_scale, bias, epilogue, out_dtype, out=out)


# Inductor's own allocator for its buffers (a C++ call; torch.empty costs a few us more per
# tensor on a slow host): on the current device, which a compiled graph has set.
try:
    from torch._C._dynamo.guards import _empty_strided_cuda
except ImportError:  # a torch without it: quantized_activations' allocations
    _empty_strided_cuda = None
_QUANTIZE_LAUNCHES: dict = {}


def _quantized_by_plan(x, dtype, input_scale):
    """ops.sp24_quantize as a compiled decode step calls it: packed once per shape."""
    m, k = x.shape
    xq, scales = _empty_strided_cuda((m, k), (k, 1), dtype), _empty_strided_cuda((m,), (1,), torch.float32)
    if m:
        key = (dtype, x.dtype, x.get_device(), m, k)
        launch = _QUANTIZE_LAUNCHES.get(key) or _QUANTIZE_LAUNCHES.setdefault(key, _quantize_launch(*key))
        pointers = launch.pointers
        with launch.lock:
            pointers[0], pointers[1] = x.data_ptr(), 0 if input_scale is None else input_scale.data_ptr()
            pointers[2], pointers[3] = xq.data_ptr(), scales.data_ptr()
            launch.run()
    return xq, scales


def _quantize_launch(dtype, source, device_index: int, m: int, k: int) -> runtime.PackedLaunch:
    kern = dispatch.quantize_kernel(dtype, source, device_index)
    return runtime.PackedLaunch(kern, (m, 1, 1), (), (0, 0, 0, 0), (k,))


def _quantized_by_inductor(args: tuple, lower: dict, computed_in_graph):
    """sp24_scaled_linear as PyTorch's ops and sp24_scaled_dds, where Inductor computes x in a
    kernel of its own (a norm, a copy) that the quantization then joins; None elsewhere (the
    launcher's sp24_quantize kernel: one launch where Inductor's may take three)."""
    x, values, metadata, w_scale, bias, input_scale, epilogue, out_dtype = args
    if not computed_in_graph(x):
        return None
    aten, dtype = torch.ops.aten, values.get_dtype()
    x_scale = _row_scales_by_inductor(lower, x, dtype, input_scale)
    q = lower[aten.div.Tensor](_as(lower, x, torch.float32), lower[aten.unsqueeze.default](x_scale, -1))
    largest = scaled._LARGEST[dtype]  # scaled.quantize from here
    q = lower[aten.clamp_max.default](lower[aten.clamp_min.default](q, -largest), largest)
    if dtype == torch.int8:
        q = lower[aten.round.default](q)
    product = lower[torch.ops.sparsegen.sp24_scaled_dds.default]
    return product(_as(lower, q, dtype), values, metadata, x_scale, w_scale, bias, epilogue, out_dtype)


def _row_scales_by_inductor(lower: dict, x, dtype, input_scale):
    """scaled.row_scales (or the static scale for every row), as Inductor's lowerings."""
    aten = torch.ops.aten
    if input_scale is not None:
        every_row = lower[aten.expand.default](_as(lower, input_scale, torch.float32), [x.get_size()[0]])
        return lower[aten.clone.default](every_row)
    magnitudes = _as(lower, lower[aten.amax.default](lower[aten.abs.default](x), [-1]), torch.float32)
    return lower[aten.clamp_min.default](lower[aten.mul.Tensor](magnitudes, scaled._INVERSE[dtype]), scaled._TINY)


def _as(lower: dict, t, dtype):
    return lower[torch.ops.prims.convert_element_type.default](t, dtype)


LOWERINGS = (registry.Lowering("sp24_dds", sp24_dds_into,
                              output_dtype=lambda dtype, args: ops.sp24_output_dtype(dtype)),
             registry.Lowering("sp24_scaled_dds", sp24_scaled_dds_into, output_dtype=lambda dtype, args: args[7],
                               own_args=_ScaledArgs),
             registry.Lowering("sp24_scaled_linear", sp24_scaled_linear_into, output_dtype=lambda dtype, args: args[7],
                               own_args=_ScaledLinearArgs, inline=_quantized_by_inductor))
