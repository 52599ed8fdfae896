"""Ops over 2:4 weights: input checks, the GPU launches (the product, pruning and
compression, expanding and gathering, the transposable mask) and their plans."""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..launch import calls, dense_path, outside_graphs, plans, runtime, workspace
from ..jit import epilogues
from ..errors import expect
from ..jit.spec import ARCHS, MIN_ARCH
from . import dispatch, specs
from . import format as semi24
from .dispatch import BYTE_DTYPE_NAMES

_PLANS = plans.PlanCache()

# The dtype each one-byte product writes Y in.
_SP24_OUTPUT_DTYPES = {torch.int8: torch.int32, torch.float8_e4m3fn: torch.bfloat16}
# A scaled one-byte product's Y dtype -> its kernels' `scales` parameter (specs.SCALED_OUTPUTS).
SCALED_OUTPUT_CODES = specs.SCALED_CODES


def sp24_output_dtype(dtype: torch.dtype) -> torch.dtype:
    return _SP24_OUTPUT_DTYPES.get(dtype, dtype)


def check_byte_inputs(x, values: torch.Tensor, bias, shape: tuple[int, int]) -> None:
    """A one-byte 2:4 product's inputs: x of the weight's dtype and device, bias (if any)
    of the output's dtype (int32 for int8, bfloat16 for float8_e4m3fn)."""
    expect(isinstance(x, torch.Tensor), "input to be a torch.Tensor", type(x).__name__)
    expect(x.dim() >= 1 and x.shape[-1] == shape[1], f"input of shape (..., {shape[1]})", tuple(x.shape))
    expect(x.dtype == values.dtype, f"input dtype {values.dtype} (the weight's dtype)", x.dtype)
    expect(x.device == values.device, f"input on {values.device} (the weight's device)", x.device)
    if bias is not None:
        out = sp24_output_dtype(values.dtype)
        expect(isinstance(bias, torch.Tensor) and bias.dtype == out and bias.device == values.device
               and tuple(bias.shape) == (shape[0],), f"bias of shape ({shape[0]},), {out} on {values.device}",
               f"{tuple(bias.shape)}, {bias.dtype} on {bias.device}" if isinstance(bias, torch.Tensor) else bias)


def runs_byte_kernels(t: torch.Tensor) -> bool:
    """A one-byte CUDA tensor: True on GPUs with the instruction (int8 sm_80, e4m3 sm_89),
    a clear error on others; False off the GPU (the caller's reference then runs)."""
    if not (t.is_cuda and t.dtype in BYTE_DTYPE_NAMES):
        return False
    _check_byte_arch(t.dtype, t.device.index or 0)
    return True


def has_byte_kernels(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `device` is a GPU with the one-byte kernels of `dtype` (runs_byte_kernels' test, no error)."""
    if device.type != "cuda":
        return False
    arch = runtime.device_arch(device)
    return arch >= MIN_ARCH.get(BYTE_DTYPE_NAMES[dtype], 80) and arch in ARCHS


@functools.lru_cache(maxsize=None)  # once per device: the forward calls it every time
def _check_byte_arch(dtype: torch.dtype, device_index: int) -> None:
    device = torch.device("cuda", device_index)
    expect(has_byte_kernels(dtype, device), f"a GPU of sm_{MIN_ARCH.get(BYTE_DTYPE_NAMES[dtype], 80)} or later with "
           f"sparsegen kernels for {dtype} 2:4 products (or the tensors on the CPU)", f"sm_{runtime.device_arch(device)}")


def runs_prune_kernels(t: torch.Tensor) -> bool:
    """A 16-bit or one-byte CUDA tensor on a GPU the templates cover (the 2:4 pruning kernels,
    which need no tensor cores: e4m3 prunes on the GPU whatever its arch)."""
    return calls._on_covered_gpu(t, calls.SIXTEEN_BIT + tuple(BYTE_DTYPE_NAMES))


def _sp24_launch(kern, grid, k_split: int, x2: torch.Tensor, values, metadata, out_features: int):
    """(The packed launch of a 2:4 product, the tensors it points into). X is bound per call
    (a TMA map or the first pointer); W's values and metadata are bound here, the same call
    after call (weight_map_shapes). Then the scales (null but in scaled kernels), bias, Y and
    the split-K sums and counts."""
    spec, (m, k), ints = kern.spec, x2.shape, (x2.shape[0], x2.shape[1], out_features, k_split)
    if spec.instr != "tma":
        pointers = (0, values.data_ptr(), metadata.data_ptr(), 0, 0, 0, 0, 0, 0)
        return runtime.PackedLaunch(kern, grid, (), pointers, ints), ()
    given = (values, metadata)
    values, metadata = calls.aligned(values), calls.aligned(metadata)  # TMA reads from 16-byte aligned rows
    maps = (x_map_shape(spec, x2, values.dtype), *weight_map_shapes(spec, values))
    launch = runtime.PackedLaunch(kern, grid, maps, (0,) * (6 + specs.quantizes_x(spec)), ints)
    launch.bind_map(1, values.data_ptr())
    launch.bind_map(2, metadata.data_ptr())
    # Only copies are kept: the caller's tensors live as long as the call, or (a kept plan) as
    # its key, the metadata, which a plan must not hold (plans.PlanCache) - a training step's
    # fresh compression would never be freed.
    return launch, tuple(t for t, g in zip((values, metadata), given) if t is not g)


def x_map_shape(spec, x2: torch.Tensor, values_dtype: torch.dtype) -> tuple:
    """X's TMA boxes (runtime.TensorMap's arguments after the address): a stage's 64 (16-bit)
    or 128 (one-byte) values per row, swizzled as wgmma reads them; a quantizing kernel's are
    its 16-bit X as they are (it writes the bytes itself)."""
    (m, k), per_byte = x2.shape, 2 // values_dtype.itemsize
    x_box = (128, False) if specs.quantizes_x(spec) else (64 * per_byte,)
    return (x2.dtype, m, k, spec.tile.tile_m // spec.tile.cluster, *x_box)


def weight_map_shapes(spec, values: torch.Tensor) -> tuple[tuple, tuple]:
    """W's values' and metadata's TMA boxes: per stage, 32 kept values and 2 k32 tiles of
    metadata words per row (twice as many of each for one-byte dtypes)."""
    (n, half_k), w_rows, per_byte = values.shape, specs.w_rows(spec), 2 // values.element_size()
    return ((values.dtype, n, half_k, w_rows, 32 * per_byte),
            (torch.int32, n // 16, half_k, w_rows // 16, 32 * per_byte, False))


def sp24_dds(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, bias, out_features: int,
             out=None, tile=None, splits: int | None = None, instr: str | None = None,
             epilogue: str = "none") -> torch.Tensor:
    """Y = X W^T (+ bias) with W 2:4 ([N, K/2] values and mma.sp metadata) on the GPU;
    x may have leading batch dims. The kernel writes Y in its own layout; small batches
    split K across blocks (`splits` overrides how many; `tile` the TileConfig), which add
    their sums in a workspace and the last split of each tile writes Y: one launch.
    `epilogue` as in bsr.ops.bsr_dds."""
    return _product(x, values, metadata, bias, out_features, out, tile, splits, instr, epilogue, None)


def sp24_dds_fresh(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, bias,
                   out_features: int) -> torch.Tensor:
    """sp24_dds for a W compressed in the step that uses it (a training step's dX over W^T,
    the 2by4 recipe's masked weight, the MVUE sample of dW): one plan per call signature,
    W's addresses bound per call. A plan per weight, as sp24_dds keeps, was made whole for
    every such call: on the H100 machine's host a 2:4 layer's backward took 495 us of host
    time of its own with it, 257 us without (torch.profiler)."""
    x2 = calls.rows_2d(x)
    if not _fresh_plan_applies(x2, values, metadata, out_features):
        return sp24_dds(x, values, metadata, bias, out_features)
    if fresh_takes_dense(*x2.shape, out_features, values.dtype, x2.device.index or 0):
        return calls.dense_result(x, x2, sp24_expand(values, metadata, out_features), bias, None)
    splits = dispatch.wanted_splits(None, x2.dtype, 0)
    signature = (*x2.shape, x2.dtype, values.dtype, x2.device.index, out_features, splits)
    plan = _FRESH_PLANS.get(signature, lambda: _sp24_plan(x2, values, metadata, out_features, splits))
    y, shaped = calls.output_for(x, x2, None, plan.width, sp24_output_dtype(x.dtype))
    plan.run_at(x2.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                weight=(values.data_ptr(), metadata.data_ptr()))
    return shaped


def _fresh_plan_applies(x2, values, metadata, out_features: int) -> bool:
    """Operands a plan binds as they are, outside CUDA graph capture (a plan made there is
    used once: sp24_dds's path)."""
    return (bool(x2.numel()) and out_features > 0 and calls.tma_ready(values) and calls.tma_ready(metadata)
            and not runtime.capturing())


_FRESH_PLANS = plans.SignatureCache()
_FRESH_DENSE = plans.SignatureCache()


def fresh_takes_dense(m: int, k: int, out_features: int, dtype: torch.dtype, device_index: int) -> bool:
    """Whether a product with a W made in the step runs cuBLAS on W expanded, as a kept plan
    would outside CUDA graphs (16-bit, the GPU's crossover table for cuBLAS, more work than
    the host's share), decided once per signature. (Handing such calls to sp24_dds made a
    whole plan for each fresh W, and then ran the kernel: 534 us of host time a 2:4 backward
    at 16 tokens on the H100 host, cProfile.)"""
    return _FRESH_DENSE.get((m, k, out_features, dtype, device_index), lambda: (
        _cublas_wins(dtype, device_index, out_features, k, m) and calls.dense_outside_graphs(m, k, out_features)))


def _cublas_wins(dtype: torch.dtype, device_index: int, out_features: int, k: int, m: int) -> bool:
    """Whether the GPU's crossover table gives a 16-bit product of this shape to cuBLAS."""
    return dtype in calls.SIXTEEN_BIT and dense_path.wanted("sp24", device_index, out_features, k, m)


def sp24_scaled_dds(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, x_scale: torch.Tensor,
                    w_scale: torch.Tensor, bias, out_features: int, out_dtype: torch.dtype, out=None,
                    tile=None, splits: int | None = None, instr: str | None = None,
                    epilogue: str = "none") -> torch.Tensor:
    """Y[t, f] = x_scale[t] w_scale[f] (X W^T)[t, f] (+ bias[f]), epilogue applied, in
    `out_dtype` (bfloat16 or float16), with X and W one-byte (int8 or float8_e4m3fn) and the
    scales float32 [M] (X's rows) and [out_features], all applied in the kernel's epilogue.
    The caller checks the operands (scaled.py)."""
    scales = (x_scale, w_scale, SCALED_OUTPUT_CODES[out_dtype])
    return _product(x, values, metadata, bias, out_features, out, tile, splits, instr, epilogue, scales)


def _product(x, values, metadata, bias, out_features: int, out, tile, splits, instr, epilogue: str, scales):
    """sp24_dds, scaled or not (scales: (x_scale, w_scale, the kernels' `scales` code))."""
    x2 = calls.rows_2d(x)
    m, k = x2.shape
    code = scales[2] if scales else 0
    y_dtype = specs.SCALED_DTYPES[code] if code else sp24_output_dtype(x.dtype)
    if m == 0 or out_features == 0 or k == 0:  # (no tensor map describes an empty tensor)
        return calls.product_without_weight(x, x2, bias, out, out_features, epilogue, y_dtype)
    splits = dispatch.wanted_splits(splits, x.dtype, code)
    if calls.kernel_left_to_dispatch(tile, instr) and calls.tma_ready(values) and calls.tma_ready(metadata):
        plan = _kept_sp24_plan(x2, values, metadata, out_features, splits, epilogue, code)
    else:  # (a plan would keep aligned copies of W, which go stale when W is trained)
        plan = _sp24_plan(x2, values, metadata, out_features, splits, tile, instr, epilogue, code)
    if plan.dense:
        weight = _sp24_dense_weight(values, metadata, out_features, k)
        if weight is not None and calls.dense_now(plan):
            return calls.dense_result(x, x2, weight, bias, out, epilogue)
    y, shaped = calls.output_for(x, x2, out, plan.width, y_dtype)
    plan.run(x2, values, bias, y, scales)
    return shaped


def sp24_lean_plan(x, values, metadata, out_features: int, epilogue: str = "none"):
    """As bsr.ops.bsr_lean_plan, for 2:4 products (16-bit; W's values as the plan found them)."""
    if not (calls.runs_16bit_kernels(x) and x.numel() and out_features and calls.tma_ready(values) and calls.tma_ready(metadata)):
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    x2 = calls.rows_2d(x)
    plan = _kept_sp24_plan(x2, values, metadata, out_features, None, epilogue)
    if plan.dense_eager:
        return None
    if plan.dense:  # the copy a CUDA graph capture takes, built now (sp24_dds builds it on every call)
        _sp24_dense_weight(values, metadata, out_features, x2.shape[1])
    return plan


# The most tokens a quantizing product takes: each block reads all of X (its scales), so its GPU
# time grows with them (tools/probe_quantizing.py on an H100, e4m3, against quantize + product:
# 0.42x / 0.31x at 16 tokens of K 4096 / 14336, 0.28x / 0.20x at 32). At 32 a Llama-3-8B-shaped
# decode step under plain compile went from 1.01x to 0.92x of dense (twice), so 16 it stays.
QUANTIZING_ROWS = 16


def quantizes_in_product(x2: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor) -> bool:
    """Whether the scaled product takes these 16-bit activations and quantizes them itself
    (one launch, not sp24_quantize's and the product's): wgmma.sp (sm_90), at most
    QUANTIZING_ROWS tokens, rows as sp24_quantize takes them, W as TMA reads it - and no CUDA
    graph being captured. Why: the quantizing kernel saves a launch's host time (a decode
    step is host-bound) but takes more GPU time (each block reads all of X for its scales:
    tools/probe_quantizing.py, 0.5-0.8x the two kernels' GPU time at 1-8 tokens on an H100); a graph's replay
    pays no host time per launch, so there the two kernels are faster."""
    return (_quantizing_signature(x2, values, metadata) and quantizes_on_kernel(x2)
            and not torch.cuda.is_current_stream_capturing())


def _quantizing_signature(x2, values, metadata) -> bool:
    """quantizes_in_product but for X's address and strides (which a compiled call checks per call)."""
    return (x2.dim() == 2 and 0 < x2.shape[0] <= QUANTIZING_ROWS and x2.dtype in SCALED_OUTPUT_CODES
            and x2.shape[1] % 8 == 0 and runs_byte_kernels(values) and runtime.device_arch(x2.device) == 90
            and values.shape[0] > 0 and calls.tma_ready(values) and calls.tma_ready(metadata))


def sp24_quantizing_plan(x2, values, metadata, out_features: int, epilogue: str):
    """The plan of a quantizing product (quantizes_in_product said yes): Y in x2's dtype."""
    code = SCALED_OUTPUT_CODES[x2.dtype]
    return _kept_sp24_plan(x2, values, metadata, out_features, None, epilogue, code, quantize=1)


def sp24_quantizing_lean_plan(x2, values, metadata, out_features: int, epilogue: str):
    """The quantizing plan a compiled graph's sp24_scaled_linear launches straight, or None."""
    if not _quantizing_signature(x2, values, metadata) or torch.cuda.is_current_stream_capturing():
        return None
    return sp24_quantizing_plan(x2, values, metadata, out_features, epilogue)


def sp24_quantized_dds(x2, values, metadata, w_scale, bias, input_scale, out_features: int, epilogue: str,
                       out=None) -> torch.Tensor:
    """What sp24_quantize then sp24_scaled_dds compute - the same bytes, the same Y - in one
    launch, where quantizes_in_product says so. The caller checks the operands (scaled.py)."""
    plan = sp24_quantizing_plan(x2, values, metadata, out_features, epilogue)
    y = out if out is not None else x2.new_empty((x2.shape[0], plan.width))
    plan.run(x2, values, bias, y, (input_scale, w_scale, None))
    return y


def sp24_scaled_lean_plan(x2, values, metadata, out_features: int, epilogue: str, code: int):
    """The plan a compiled graph's scaled product launches straight (one-byte X [M, K], Y's
    dtype code), or None where it takes sp24_scaled_dds's full path."""
    if not (runs_byte_kernels(values) and x2.dim() == 2 and x2.numel() and out_features
            and calls.tma_ready(values) and calls.tma_ready(metadata)):
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    plan = _kept_sp24_plan(x2, values, metadata, out_features, dispatch.wanted_splits(None, x2.dtype, code),
                           epilogue, code)
    return None if plan.dense else plan


def _kept_sp24_plan(x2, values, metadata, out_features: int, splits, epilogue: str, scales: int = 0,
                    quantize: int = 0):
    """The plan for these operands with default kernels, made once per weight and signature."""
    return _PLANS.get(metadata, (*x2.shape, x2.dtype, out_features, splits, values.data_ptr(), epilogue, scales),
                      lambda: _sp24_plan(x2, values, metadata, out_features, splits, epilogue=epilogue, scales=scales,
                                         quantize=quantize))


def _sp24_dense_weight(values, metadata, out_features: int, k: int):
    return dense_path.copy_of(metadata, values, semi24.decompress, values, metadata, (out_features, k))


@dataclasses.dataclass(frozen=True)
class _Sp24Plan:
    kern: runtime.Kernel
    launch: runtime.PackedLaunch      # its parameters: X, W's values and metadata, scales, bias, Y, sums, counts
    keep: tuple[torch.Tensor, ...]    # copies W's pointers or maps point into (aligned ones made for it)
    workspace: int                    # float32 split-K sums, splits x M x N (0: no split)
    counters: int                     # int32 split-K tile counters
    width: int                        # Y's columns (half of W's rows for a gated epilogue)
    dense: bool = False               # cuBLAS on a dense copy of W first (dense_path), in CUDA graphs
    dense_eager: bool = False         # and outside them (not host-bound: calls.dense_outside_graphs)
    quantizes: bool = False           # takes X in 16 bits and quantizes it (specs.quantizes_x)

    def run(self, x2: torch.Tensor, values, bias, y: torch.Tensor, scales=None) -> None:
        """Launch on these operands (of the plan's signature, W as the plan bound it; Y
        contiguous, 16-byte aligned; scales (x_scale, w_scale, code) for a scaled plan)."""
        self.run_at(x2.data_ptr(), bias.data_ptr() if bias is not None else 0, y.data_ptr(), scales)

    def run_at(self, x_address: int, bias_address: int, y_address: int, scales=None, weight=None) -> None:
        """run, given the operands' addresses (bias 0 for none): a compiled graph's launcher
        has read them already (every frame and query here is paid per launch). A quantizing
        plan's scales[0] is the static input scale, or None for a scale per token. `weight`:
        (values' address, metadata's) to bind first, for a plan kept per signature."""
        space = self.split_workspace()
        launch, pointers = self.launch, self.launch.pointers
        with launch.lock:
            launch.bind(0, x_address)
            if weight is not None:
                launch.bind(1, weight[0])
                launch.bind(2, weight[1])
            if self.quantizes:  # X's address twice: its boxes' map and the pointer its scales are found by
                pointers[0] = x_address
            if scales is not None:
                pointers[-6], pointers[-5] = 0 if scales[0] is None else scales[0].data_ptr(), scales[1].data_ptr()
            pointers[-4], pointers[-3] = bias_address, y_address
            if space is not None:
                pointers[-2], pointers[-1] = space.sums.data_ptr(), space.counts.data_ptr()
            launch.run()


    def split_workspace(self) -> workspace.SplitWorkspace | None:
        """The split-K sums and counters of this launch (None: K is not split): the kept
        workspace where it holds enough (capturing or not), else as made."""
        if not self.workspace:
            return None
        device_index = self.kern.device_index
        return workspace.kept_for(device_index, runtime.current_stream(device_index), self.workspace,
                                  self.counters) or _split_workspace(self, torch.device("cuda", device_index))


def _sp24_plan(x2: torch.Tensor, values, metadata, out_features: int, splits, tile=None, instr=None,
               epilogue="none", scales: int = 0, quantize: int = 0) -> _Sp24Plan:
    """What sp24_dds launches for these operands (`scales`, `quantize`: the kernels' parameters;
    a quantizing kernel's X is 16-bit, its weight type the values')."""
    (m, k), device_index = x2.shape, x2.device.index or 0
    kern = dispatch.forward_kernel(values.dtype, device_index, dispatch.rows_bucket(m), tile, instr,
                        dispatch.narrow_tiles(m, out_features, device_index), epilogue, scales, quantize)
    grid, k_split = dispatch.grid(kern.spec, m, k, out_features, device_index, splits, kern.resident_blocks)
    sums, counters = dispatch.split_space(kern.spec, grid, m, out_features)
    dense = calls.kernel_left_to_dispatch(tile, instr) and _cublas_wins(values.dtype, device_index, out_features, k, m)
    return _Sp24Plan(kern, *_sp24_launch(kern, grid, k_split, x2, values, metadata, out_features), sums,
                     counters, epilogues.output_features(epilogue, out_features), dense,
                     dense and calls.dense_outside_graphs(m, k, out_features), bool(quantize))


def _split_workspace(plan: _Sp24Plan, device: torch.device) -> workspace.SplitWorkspace:
    """The sums and zeroed counters of a split-K launch. During CUDA graph capture with none
    big enough, ones allocated inside the graph, used by this call only."""
    stream = runtime.current_stream(device.index or 0)
    if runtime.capturing():
        held = workspace.current(device, stream)
        if held is not None and held.holds(plan.workspace, plan.counters):
            return held
        return workspace.SplitWorkspace(_zeros(plan.workspace, torch.float32, device),
                                        _zeros(plan.counters, torch.int32, device))
    return workspace.held(device, stream, plan.workspace, plan.counters, _zeros_outside_graph_pools)


def _zeros(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(count, dtype=dtype, device=device)


def _zeros_outside_graph_pools(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return outside_graphs.run(_zeros, (count, dtype, device), device)


_MAGNITUDE, _MASKED, _MVUE = 0, 1, 2  # sp24_compress's modes


def _rows_or_columns(w: torch.Tensor, mask: torch.Tensor | None):
    """(w, mask, row step, column step) for the compress kernel: a row-major weight, or the
    transposed view of one (dX's W^T: compressed without a transpose copy). The mask is
    brought to w's strides; anything else is made contiguous."""
    transposed = w.dim() == 2 and w.stride() == (1, w.shape[0]) and w.shape[0] > 1
    if not transposed:
        w = calls.aligned(w)
        return w, None if mask is None else calls.aligned(mask.to(w.device)), w.shape[1], 1
    if mask is not None:
        mask = mask.to(w.device)
        mask = mask if mask.stride() == w.stride() else mask.t().contiguous().t()
    return w, mask, 1, w.shape[0]


def sp24_compress(w: torch.Tensor, mask: torch.Tensor | None = None,
                  mvue_seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [N, K/2], metadata [N/16, K/32, 16] int32) of a 16-bit CUDA weight pruned
    to 2:4 on the GPU: the 2 largest |w| of every 4, `mask`'s positions, or (given a seed)
    an MVUE sample. w may be a transposed view."""
    n, k = w.shape
    w, mask, row_step, col_step = _rows_or_columns(w, mask)
    values = torch.empty(n, k // 2, dtype=w.dtype, device=w.device)
    metadata = torch.empty(n // 16, k // 32, 16, dtype=torch.int32, device=w.device)
    if values.numel() == 0:  # nothing to launch over
        return values, metadata
    kern = dispatch.prune_kernel("sp24_compress", w.dtype, w.device.index or 0)
    mask_ptr = 0 if mask is None else mask.view(torch.uint8).data_ptr()
    mode = _MVUE if mvue_seed is not None else _MAGNITUDE if mask is None else _MASKED
    seed = (mvue_seed or 0) % 2**64
    kern.launch((-(-metadata.numel() // kern.threads), 1, 1), (),
                (w.data_ptr(), mask_ptr, values.data_ptr(), metadata.data_ptr(), seed, row_step, col_step),
                (n, k, mode))
    return values, metadata


def quantizes_on_kernel(x2: torch.Tensor) -> bool:
    """Whether sp24_quantize takes these activations (on a GPU runs_byte_kernels accepted):
    16-bit, contiguous rows of whole 16-byte pieces from a 16-byte aligned start."""
    return (x2.dtype in SCALED_OUTPUT_CODES and x2.is_cuda and x2.is_contiguous() and x2.shape[-1] % 8 == 0
            and x2.data_ptr() % 16 == 0)


def sp24_quantize(x2: torch.Tensor, dtype: torch.dtype, static_scale: torch.Tensor | None = None):
    """(x2 quantized to `dtype` [M, K], its float32 scales [M]) in one pass: each row by its
    largest magnitude (or every row by `static_scale`, a float32 CUDA scalar), as
    scaled.row_scales and scaled.quantize compute it. x2 as quantizes_on_kernel says."""
    m, k = x2.shape
    xq = torch.empty(m, k, dtype=dtype, device=x2.device)
    scales = torch.empty(m, dtype=torch.float32, device=x2.device)
    if m and k:
        kern = dispatch.quantize_kernel(dtype, x2.dtype, x2.device.index)
        fixed = 0 if static_scale is None else static_scale.data_ptr()
        kern.launch((m, 1, 1), (), (x2.data_ptr(), fixed, xq.data_ptr(), scales.data_ptr()), (k,))
    return xq, scales


_EXPAND, _GATHER = 0, 1  # sp24_expand's modes


def sp24_expand(values: torch.Tensor, metadata: torch.Tensor, out_features: int) -> torch.Tensor:
    """The dense [N, K] W of a 16-bit CUDA 2:4 one (zeros where nothing is stored), in one pass."""
    n, k = out_features, 2 * values.shape[1]
    dense = torch.empty(n, k, dtype=values.dtype, device=values.device)
    _launch_expand(dense, calls.aligned(values), metadata, _EXPAND)
    return dense


def sp24_gather(dense: torch.Tensor, metadata: torch.Tensor) -> torch.Tensor:
    """[N, K/2]: a 16-bit CUDA [N, K] tensor's elements at the positions `metadata` stores
    (the values' gradient from a dense dW), in one pass."""
    dense = calls.aligned(dense)
    values = torch.empty(dense.shape[0], dense.shape[1] // 2, dtype=dense.dtype, device=dense.device)
    _launch_expand(dense, values, metadata, _GATHER)
    return values


def sp24_transpose(values: torch.Tensor, metadata: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [K, N/2], metadata [K/16, N/32, 16]) of W^T, from a 16-bit CUDA 2:4 W [N, K]
    whose stored positions are 2:4 along columns as well (the caller knows: a transposable
    mask, autograd.stored_transposable) and N a multiple of 32, in one pass: W^T stores W's
    positions, whatever their values. (Elsewhere a group of 4 of W^T keeps its first 2 stored
    positions and loses the rest.)"""
    n, k = out_features, 2 * values.shape[1]
    expect(n % semi24.COL_GRANULE == 0 and metadata.numel() * 32 == n * k,
           f"W [N, K] with N a multiple of {semi24.COL_GRANULE} and its metadata words for sp24_transpose",
           f"N = {n}, K = {k}, {metadata.numel()} words")
    values_t = torch.empty(k, n // 2, dtype=values.dtype, device=values.device)
    metadata_t = torch.empty(k // 16, n // 32, 16, dtype=torch.int32, device=values.device)
    if values.numel():
        kern = dispatch.prune_kernel("sp24_transpose", values.dtype, values.device.index or 0)
        kern.launch((-(-k // 128), -(-n // 64), 1), (), (calls.aligned(values).data_ptr(),
                    calls.aligned(metadata).data_ptr(), values_t.data_ptr(), metadata_t.data_ptr()), (n, k))
    return values_t, metadata_t


def _launch_expand(dense: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, mode: int) -> None:
    if values.numel() == 0:
        return
    kern = dispatch.prune_kernel("sp24_expand", values.dtype, values.device.index or 0)
    kern.launch((-(-metadata.numel() // kern.threads), 1, 1), (),
                (dense.data_ptr(), values.data_ptr(), metadata.data_ptr()), (*dense.shape, mode))


def sp24_transposable_mask(w: torch.Tensor, out: torch.Tensor | None = None, step: torch.Tensor | None = None,
                           interval: int = 1) -> torch.Tensor:
    """The transposable 2:4 mask (bool, w's shape) of a 16-bit CUDA weight, on the GPU: what
    format.transposable_mask computes. With `step` (an int64 scalar on w's device)
    the kernel writes `out` only when the step is a positive multiple of `interval`, decided
    on the device (no host sync, and a CUDA graph keeps the schedule)."""
    w, (n, k) = calls.aligned(w), w.shape
    mask = torch.empty(n, k, dtype=torch.bool, device=w.device) if out is None else out
    tiles = (n // 4) * (k // 4)
    if tiles == 0:
        return mask
    kern = dispatch.prune_kernel("sp24_mask", w.dtype, w.device.index or 0)
    kern.launch((-(-tiles // kern.threads), 1, 1), (),
                (w.data_ptr(), mask.data_ptr(), 0 if step is None else step.data_ptr()), (n, k, interval))
    return mask


_FORWARD, _BACKWARD = 0, 1  # gated_product's modes


def gated_product(y: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up [..., N] of a training step's gated product y [..., 2N] (16-bit CUDA,
    gate and up in epilogues' interleaved groups), in one pass; act "silu" or "gelu"."""
    h = torch.empty(*y.shape[:-1], y.shape[-1] // 2, dtype=y.dtype, device=y.device)
    _launch_gated(y, None, h, act, _FORWARD)
    return h


def gated_product_grad(dh: torch.Tensor, y: torch.Tensor, act: str) -> torch.Tensor:
    """The gradient of gated_product at y, given dH (y's dtype and device, [..., N]): dY
    [..., 2N], gate and up columns interleaved as y's, in one pass."""
    dy = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    _launch_gated(y, calls.aligned(dh), dy, act, _BACKWARD)
    return dy


def _launch_gated(y: torch.Tensor, dh, out: torch.Tensor, act: str, mode: int) -> None:
    _check_gated(y, dh, act)
    y = calls.aligned(y)
    rows, groups = y.numel() // max(y.shape[-1], 1), y.shape[-1] // (2 * epilogues.GATE_GROUP)
    if rows * groups == 0:
        return
    kern = dispatch.gated_kernel(y.dtype, y.device.index or 0, act == "gelu")
    kern.launch((-(-rows * groups // kern.threads), 1, 1), (),
                (y.data_ptr(), 0 if dh is None else dh.data_ptr(), out.data_ptr()), (rows, groups, mode))


def _check_gated(y: torch.Tensor, dh, act: str) -> None:
    """What the kernel reads, checked before it reads it: y 16-bit CUDA of whole gate/up
    groups, dH (for the gradient) of h's shape in y's dtype on y's device."""
    expect(act in ("silu", "gelu"), "a gate activation 'silu' or 'gelu'", repr(act))
    expect(y.is_cuda and y.dtype in calls.SIXTEEN_BIT and y.dim() >= 1 and y.shape[-1] % (2 * epilogues.GATE_GROUP) == 0,
           f"a 16-bit CUDA product of [..., a multiple of {2 * epilogues.GATE_GROUP}] columns",
           f"{y.dtype} on {y.device}, shape {tuple(y.shape)}")
    if dh is not None:
        shape = (*y.shape[:-1], y.shape[-1] // 2)
        expect(dh.shape == shape and dh.dtype == y.dtype and dh.device == y.device,
               f"dH of shape {shape}, {y.dtype} on {y.device}", f"{tuple(dh.shape)}, {dh.dtype} on {dh.device}")


# The kernels the layout kit (and every layout's gated layers) call without naming 2:4
KIT_KERNELS = {"gated_product": gated_product, "gated_product_grad": gated_product_grad}
