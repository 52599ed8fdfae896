"""The 2:4 forward as a compiled graph calls it (registry.Lowering, inductor.py): into
Inductor's own output buffer, by the lean plan where there is one."""
from __future__ import annotations

import math

import torch

from ..launch import calls, kept_index, lean, plans, runtime
from ..jit import registry
from . import autograd  # noqa: F401 (defines torch.ops.sparsegen.sp24_dds, the fallback below)
from . import grouped, int4_nn, ops, scaled_lean, specs
from . import scaled  # (defines torch.ops.sparsegen.sp24_scaled_dds and sp24_scaled_linear)

# The launcher's plans, per weight and call signature (the graph's checks ran when it was traced).
_PLANS = plans.PlanCache()


# Plans are keyed by the weight (whose device X shares in any graph that ran its checks)
# and what of the call may differ between graphs: each launch of a compiled decode step pays
# for every query made here.
def sp24_dds_into(x, values, metadata, bias, out_features, epilogue, *, out):
    # As the eager forward does: a training layer's compiled backward asks whether rewritten
    # metadata (DDP's broadcast) is unchanged; compared from here on, the backward waits for
    # nothing (asked on the spot, the check held DDP's compiled 2:4 step in a host sync).
    kept_index.start_check(metadata)
    plan = _PLANS.get(metadata, (x.shape, x.dtype, values.data_ptr(), epilogue),
                      lambda: ops.sp24_lean_plan(x, values, metadata, out_features, epilogue))
    x_address, y_address = x.data_ptr(), out.data_ptr()
    if plan is not None and lean.runs_into(plan, x, out, x_address | y_address):
        plan.run_at(x_address, bias.data_ptr() if bias is not None else 0, y_address)
    elif calls.runs_16bit_kernels(x) and calls.fits_in_place(out):
        ops.sp24_dds(x, values, metadata, bias, out_features, out=out, epilogue=epilogue)
    else:
        out.copy_(torch.ops.sparsegen.sp24_dds.default(x, values, metadata, bias, out_features, epilogue))


def _grouped_by_inductor(args: tuple, lower: dict, graph):
    """16-bit sp24_dds calls that read one x (an attention's q, k and v projections) as one
    grouped launch; None for a call with no such neighbour (its own launcher)."""
    decided = graph.decided()
    if decided is not None:
        return decided
    group = _group(graph, args, _groups_with)
    if len(group) < 2:
        return None
    x = args[0]
    operands = [t for _, other in group for t in (other[1], other[2])]
    return _grouped(lower, graph, group, [x, *operands], ops.sp24_output_dtype(x.get_dtype()),
                    [_values_rows(other) for _, other in group], constants=(False, "none"))


def _groups_with(args: tuple, other: tuple) -> bool:
    """Whether another sp24_dds call can share this one's grouped launch: 16-bit weights (the
    one-byte ones take sp24_scaled_linear's groups), no bias, no epilogue, Y as wide as W is tall
    in both, the same weight dtype and K."""
    return (args[1].get_dtype() in (torch.bfloat16, torch.float16)
            and args[3] is None and other[3] is None and args[5] == other[5] == "none"
            and _same_weight_kind(args[1], other[1])
            and args[4] == args[1].get_size()[0] and other[4] == other[1].get_size()[0])


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


def sp24_group_into(*args, out):
    """grouped.py's products as a compiled graph calls them: args are X (2-D: one-byte for a scaled group), its
    scales [M] where scaled, then each weight's values, metadata (and scales [N_g]), then the
    constants `scaled` and `epilogue`. Y: [M, sum of N_g] in `out`."""
    *tensors, scaled, epilogue = args
    x, x_scale = tensors[0], tensors[1] if scaled else None
    weights = grouped.weights_of(tuple(tensors[2 if scaled else 1:]), scaled)
    code = ops.SCALED_OUTPUT_CODES.get(out.dtype, 0) if scaled else 0
    plan = grouped.kept_plan(x, weights, epilogue, code)
    x_address, y_address = x.data_ptr(), out.data_ptr()
    if (plan is not None and lean.runs_into(plan, x, out, x_address | y_address)
            and (x_scale is None or x_scale.is_contiguous())):
        grouped.run_group_at(plan, x_address, y_address, x_scale, [w_scale for _, _, w_scale in weights])
    else:
        _one_by_one(x, x_scale, weights, epilogue, out)


def _one_by_one(x, x_scale, weights: list[tuple], epilogue: str, out: torch.Tensor) -> None:
    """Each product on its own, into its columns of out (compiled.py's launchers: their checks
    and fallbacks, a strided Y included)."""
    at = 0
    for values, metadata, w_scale in weights:
        n = values.shape[0]
        columns = out[..., at:at + n]
        if x_scale is None:
            sp24_dds_into(x, values, metadata, None, n, epilogue, out=columns)
        else:
            sp24_scaled_dds_into(x, values, metadata, x_scale, w_scale, None, epilogue, out.dtype, out=columns)
        at += n


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
    if ops.runs_byte_kernels(values) and ops.quantizes_on_kernel(x):
        xq, x_scale = scaled_lean.quantize_packed(x, *x.shape, values.dtype, input_scale)
    else:
        xq, x_scale = scaled.quantized_activations(x, values, input_scale)
    sp24_scaled_dds_into(xq, values, metadata, x_scale, w_scale, bias, epilogue, out_dtype, out=out)


def _quantized_by_inductor(args: tuple, lower: dict, graph):
    """sp24_scaled_linear as PyTorch's ops and sp24_scaled_dds, where Inductor computes x in a
    kernel of its own (a norm, a copy) that the quantization then joins - with the layers that
    read the same x in one grouped launch (_grouped) where they can share it; None elsewhere
    (the launcher's sp24_quantize kernel: one launch where Inductor's may take three)."""
    decided = graph.decided()
    if decided is not None:
        return decided
    x, values, metadata, w_scale, bias, input_scale, epilogue, out_dtype = args
    if not graph.computed_in_graph(x):
        return None
    q, x_scale = _quantized_in_graph(lower, x, values.get_dtype(), input_scale)
    group = _group(graph, args, _scaled_groups_with)
    if len(group) > 1:
        operands = [t for _, other in group for t in (other[1], other[2], other[3])]
        return _grouped(lower, graph, group, [q, x_scale, *operands], out_dtype,
                        [_values_rows(other) for _, other in group], constants=(True, "none"))
    product = lower[torch.ops.sparsegen.sp24_scaled_dds.default]
    return product(q, values, metadata, x_scale, w_scale, bias, epilogue, out_dtype)


def _quantized_in_graph(lower: dict, x, dtype, input_scale) -> tuple:
    """(x quantized to `dtype`, its scale per row), as Inductor's lowerings (scaled.quantize)."""
    aten = torch.ops.aten
    x_scale = _row_scales_by_inductor(lower, x, dtype, input_scale)
    q = lower[aten.div.Tensor](_as(lower, x, torch.float32), lower[aten.unsqueeze.default](x_scale, -1))
    largest = scaled._LARGEST[dtype]
    q = lower[aten.clamp_max.default](lower[aten.clamp_min.default](q, -largest), largest)
    if dtype == torch.int8:
        q = lower[aten.round.default](q)
    return _as(lower, q, dtype), x_scale


def _scaled_groups_with(args: tuple, other: tuple) -> bool:
    """Whether another sp24_scaled_linear call can share this one's grouped launch: no bias or
    static scale in either, no epilogue, the same weight dtype, K and Y dtype."""
    return (args[4] is None and args[5] is None and other[4] is None and other[5] is None
            and args[6] == other[6] == "none" and args[7] == other[7] and _same_weight_kind(args[1], other[1]))


def _same_weight_kind(values, other) -> bool:
    """Weights of one dtype and K, each a whole number of rows the grouped kernel can count."""
    try:
        int(other.get_size()[0]), int(values.get_size()[0])
    except TypeError:  # (a symbolic size)
        return False
    return values.get_dtype() == other.get_dtype() and values.get_size()[1] == other.get_size()[1]


def _values_rows(args: tuple) -> int:
    """A 2:4 product's Y width: its values' rows (each grouped call checks the width is that)."""
    return int(args[1].get_size()[0])


def _group(graph, args: tuple, groups_with, width=_values_rows, worth=grouped.worth_grouping) -> list:
    """[(node, args)] of the calls that share this call's launch (this call first), at most
    specs.MAX_GROUPS of them; this call alone where `worth` (device, rows, K, widths, dtype)
    says no. `width`: a call's Y width from its arguments."""
    found = [(node, args if other is None else other) for node, other in graph.siblings()]
    found = [found[0]] + [(node, other) for node, other in found[1:] if groups_with(args, other)]
    found = found[:specs.MAX_GROUPS]
    x, values = args[0], args[1]
    *leading, k = x.get_size()
    try:
        rows = int(math.prod(leading))
    except TypeError:  # (symbolic: decided per call by the launcher)
        rows = None
    widths = [width(other) for _, other in found]
    if len(found) > 1 and worth(x.get_device(), rows, int(k), widths, values.get_dtype()):
        return found
    graph.decide(graph.node, None)  # (lowered now, on its own: a later call's group leaves it out)
    return found[:1]


def _grouped(lower: dict, graph, group: list, inputs: list, out_dtype, widths: list[int],
             launcher: str = "sp24_group", constants: tuple = ()):
    """One grouped launch (the Lowering's `launcher`, given its `constants` after the tensors)
    for every call of `group`, on X as rows (the kernel's 2-D operand: a layer's [batch, tokens,
    K] input is a view), each call then a view of its columns in X's shape; this call's view
    returned, the others' kept for their lowering."""
    aten = torch.ops.aten
    x = inputs[0]
    *leading, k = x.get_size()
    rows = lower[aten.view.default](x, [-1, k]) if len(leading) != 1 else x
    y = graph.extern(launcher, [rows, *inputs[1:]], constants, out_dtype, [rows.get_size()[0], sum(widths)])
    at = 0
    for (node, _), width in zip(group, widths):
        columns = lower[aten.slice.Tensor](y, -1, at, at + width)
        graph.decide(node, columns if len(leading) == 1 else lower[aten.view.default](columns, [*leading, width]))
        at += width
    return graph.decided()


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


def _w4_grouped_by_inductor(args: tuple, lower: dict, graph):
    """4-bit sp24_w4_linear calls that read one x (q, k and v) as one grouped launch
    (int4_nn.sp24_w4_group_into); None for a call with no such neighbour (its own launcher)."""
    decided = graph.decided()
    if decided is not None:
        return decided
    group = _group(graph, args, _w4_groups_with, width=lambda call: call[6], worth=_w4_worth_grouping)
    if len(group) < 2:
        return None
    operands = [t for _, other in group for t in other[1:4]]
    return _grouped(lower, graph, group, [args[0], *operands], args[3].get_dtype(),
                    [other[6] for _, other in group], "sp24_w4_group", (args[5],))


def _w4_groups_with(args: tuple, other: tuple) -> bool:
    """Whether another sp24_w4_linear call can share this one's launch: no bias or epilogue in
    either, the same scale group, scales' dtype and K."""
    return (args[4] is None and other[4] is None and args[7] == other[7] == "none" and args[5] == other[5]
            and args[3].get_dtype() == other[3].get_dtype() and args[1].get_size()[1] == other[1].get_size()[1])


def _w4_worth_grouping(device: torch.device, rows, k: int, widths: list[int], dtype) -> bool:
    """Group 4-bit products on any GPU (sp24_w4 is mma.sp) and the CPU, but not at more rows than
    the grouped kernel takes (int4_nn.groups_on_kernel): one by one, each would cost a copy."""
    return rows is None or rows <= int4_nn.PREFILL_ROWS


LOWERINGS = (registry.Lowering("sp24_dds", sp24_dds_into,
                              output_dtype=lambda dtype, args: ops.sp24_output_dtype(dtype), inline=_grouped_by_inductor,
                              more_launchers=(("sp24_group", sp24_group_into),)),
             registry.Lowering("sp24_scaled_dds", sp24_scaled_dds_into, output_dtype=lambda dtype, args: args[7],
                               own_args=_ScaledArgs),
             registry.Lowering("sp24_scaled_linear", sp24_scaled_linear_into, output_dtype=lambda dtype, args: args[7],
                               own_args=_ScaledLinearArgs, inline=_quantized_by_inductor),
             registry.Lowering("sp24_w4_linear", int4_nn.sp24_w4_linear_into, own_args=int4_nn.W4Args,
                               inline=_w4_grouped_by_inductor,
                               more_launchers=(("sp24_w4_group", int4_nn.sp24_w4_group_into),)))
