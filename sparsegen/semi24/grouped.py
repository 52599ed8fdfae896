"""Grouped 2:4 products: the weights of several layers that read one X (an attention's q, k
and v projections) multiplied in one launch, Y's columns weight after weight.

Why: a compiled decode step is host-bound on the H100 machine, and each launch costs about
a dense linear's host time whatever its GPU time. An FP8 2:4 step makes as many launches as
its dense twin (the o_proj and down_proj inputs take a quantize launch each), so it ran at
parity; three projections in one launch take two launches a layer off.

compiled.py's lowering finds such layers in a graph and calls its sp24_group_into once; the
graph takes each layer's output as a view of Y's columns. The kernel (sp24_dds_tma.cuh's Groups)
picks its weight per output tile, so every weight but the last must fill whole tiles. Where
the grouped kernel does not apply - no wgmma.sp, a weight off the tiles, a CUDA graph being
captured, the CPU - each product runs on its own into its columns.
"""
from __future__ import annotations

import torch

from ..launch import calls, dense_path, plans, runtime
from . import dispatch, ops, specs

_PLANS = plans.PlanCache()


def weights_of(operands: tuple, scaled: bool) -> list[tuple]:
    """[(values, metadata, w_scale or None)] from the launcher's flat operands after X's."""
    step = 3 if scaled else 2
    return [(*operands[at:at + 2], operands[at + 2] if scaled else None) for at in range(0, len(operands), step)]


def kept_plan(x, weights: list[tuple], epilogue: str, code: int):
    """The grouped launch's plan, kept per first weight and call signature, or None."""
    values, metadata, _ = weights[0]
    signature = (x.shape, x.dtype, epilogue, code, *(t.data_ptr() for w in weights for t in w[:2]))
    return _PLANS.get(metadata, signature, lambda: group_plan(x, weights, epilogue, code))


def group_plan(x2: torch.Tensor, weights: list[tuple], epilogue: str, code: int):
    """The plan (ops._Sp24Plan) of one launch over every weight, or None where the grouped kernel
    does not apply (see the module's note)."""
    if not _groups_on_kernel(x2, weights, epilogue):
        return None
    (m, k), device_index = x2.shape, x2.device.index or 0
    if any(_dense_by_itself(values, m, k, device_index) for values, _, _ in weights):
        return None  # (as its own call it would run on cuBLAS: so it does)
    n, dtype = sum(values.shape[0] for values, _, _ in weights), weights[0][0].dtype
    kern = dispatch.forward_kernel(dtype, device_index, dispatch.rows_bucket(m), None, None,
                                   dispatch.narrow_tiles(m, n, device_index), epilogue, code, 0, len(weights))
    if any(values.shape[0] % specs.w_rows(kern.spec) for values, _, _ in weights[:-1]):
        return None  # (a weight ending inside a tile)
    grid, k_split = dispatch.grid(kern.spec, m, k, n, device_index, dispatch.wanted_splits(None, dtype, code),
                                  kern.resident_blocks)
    return ops._Sp24Plan(kern, _grouped_launch(kern, grid, k_split, x2, weights, n), (),
                         *dispatch.split_space(kern.spec, grid, m, n), n)


def _dense_by_itself(values: torch.Tensor, m: int, k: int, device_index: int) -> bool:
    return values.dtype in calls.SIXTEEN_BIT and _dense_path_taken(values.shape[0], m, k, device_index)


def _dense_path_taken(n: int, m: int, k: int, device_index: int) -> bool:
    """Whether a 16-bit weight's own call takes the dense path outside CUDA graphs (this GPU's
    crossover table says cuBLAS wins, and the call is big enough not to be host-bound)."""
    return dense_path.wanted("sp24", device_index, n, k, m) and calls.dense_outside_graphs(m, k, n)


def worth_grouping(device: torch.device, rows, k: int, widths: list[int], dtype: torch.dtype) -> bool:
    """Whether a graph should call these products as one group (the lowering asks, once): not
    on a GPU the grouped kernel misses (no wgmma.sp), nor where a 16-bit product would run on
    cuBLAS by itself at this many `rows` (None: not known until run) - one by one into Y's
    columns those would cost a copy each. On the CPU yes: the products run one by one anyway."""
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    if runtime.device_arch(torch.device("cuda", index)) != 90:
        return False
    sixteen = dtype in calls.SIXTEEN_BIT
    return rows is None or not (sixteen and any(_dense_path_taken(n, rows, k, index) for n in widths))


def _groups_on_kernel(x2: torch.Tensor, weights: list[tuple], epilogue: str) -> bool:
    """What the grouped kernel takes: 2-D X on a Hopper GPU, at most MAX_GROUPS weights of one
    dtype and X's K, each as TMA reads it, no epilogue (a gated one pairs rows across Y), and
    no CUDA graph capture (the products' own launchers choose there, the dense path included)."""
    values = [w[0] for w in weights]
    first = values[0]
    runs = ops.runs_byte_kernels(first) if first.element_size() == 1 else calls.runs_16bit_kernels(x2)
    return (runs and x2.dim() == 2 and x2.numel() > 0 and 1 < len(weights) <= specs.MAX_GROUPS
            and epilogue == "none" and runtime.device_arch(x2.device) == 90
            and all(v.dtype == first.dtype and v.shape[1] * 2 == x2.shape[1] and v.shape[0] > 0 for v in values)
            and all(calls.tma_ready(t) for w in weights for t in w[:2])
            and not torch.cuda.is_current_stream_capturing())


def _grouped_launch(kern, grid, k_split: int, x2: torch.Tensor, weights: list[tuple], n: int):
    """The packed launch: X's map, each weight's values' maps, then their metadata's; the
    pointers X's scales, each weight's scales, bias (none), Y, split-K sums and counts; the
    ints M, K, N, k_split and where each weight but the first starts in Y."""
    spec, (m, k) = kern.spec, x2.shape
    shapes = [ops.weight_map_shapes(spec, values) for values, _, _ in weights]
    maps = (ops.x_map_shape(spec, x2, weights[0][0].dtype), *(s[0] for s in shapes), *(s[1] for s in shapes))
    starts = [sum(values.shape[0] for values, _, _ in weights[:g]) for g in range(1, len(weights))]
    launch = runtime.PackedLaunch(kern, grid, maps, (0,) * (5 + len(weights)), (m, k, n, k_split, *starts))
    for g, (values, metadata, _) in enumerate(weights):
        launch.bind_map(1 + g, values.data_ptr())
        launch.bind_map(1 + len(weights) + g, metadata.data_ptr())
    return launch


def run_group_at(plan, x_address: int, y_address: int, x_scale, w_scales: list) -> None:
    """Launch a grouped plan on X and Y at these addresses, with these scales (None: unscaled)."""
    space = plan.split_workspace()
    launch, pointers = plan.launch, plan.launch.pointers
    with launch.lock:
        launch.bind(0, x_address)
        pointers[0] = 0 if x_scale is None else x_scale.data_ptr()
        for g, w_scale in enumerate(w_scales):
            pointers[1 + g] = 0 if w_scale is None else w_scale.data_ptr()
        pointers[-4], pointers[-3] = 0, y_address
        if space is not None:
            pointers[-2], pointers[-1] = space.sums.data_ptr(), space.counts.data_ptr()
        launch.run()
