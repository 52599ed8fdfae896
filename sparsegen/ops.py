"""Ops over block-CSR weights: input checks, the CPU reference, and the GPU launch."""
from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from . import dense_path, epilogues, library, outside_graphs, plans, runtime, workspace
from .errors import InputError, expect
from .layouts import bsr, semi24
from .spec import (ARCHS, MIN_ARCH, TMA_INSTRS, forward_spec, has_call_variants, input_grad_spec, scatter_spec,
                   sdd_spec, sp24_compress_spec, sp24_spec)

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# One-byte 2:4 products (Sparse24Tensor inference) and the dtype each writes Y in.
BYTE_DTYPE_NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "e4m3"}
_SP24_DTYPE_NAMES = {**DTYPE_NAMES, **BYTE_DTYPE_NAMES}
_SP24_OUTPUT_DTYPES = {torch.int8: torch.int32, torch.float8_e4m3fn: torch.bfloat16}


def sp24_output_dtype(dtype: torch.dtype) -> torch.dtype:
    return _SP24_OUTPUT_DTYPES.get(dtype, dtype)


def check_inputs(x: torch.Tensor, values: torch.Tensor, bias, in_features: int) -> None:
    """Every "Expected X. Got Y." check, before any kernel runs. The common, valid case is
    decided by one cheap test; the messages are only built when something is wrong."""
    if (isinstance(x, torch.Tensor) and x.dtype is values.dtype and x.device == values.device
            and x.dim() >= 1 and x.shape[-1] == in_features and x.dtype in DTYPE_NAMES
            and (bias is None or (bias.dtype is values.dtype and bias.device == values.device))):
        return
    _explain_bad_inputs(x, values, bias, in_features)


def _explain_bad_inputs(x, values, bias, in_features: int) -> None:
    expect(isinstance(x, torch.Tensor), "input to be a torch.Tensor", type(x).__name__)
    expect(x.dim() >= 1 and x.shape[-1] == in_features,
           f"input of shape (..., {in_features})", tuple(x.shape))
    expect(x.dtype == values.dtype, f"input dtype {values.dtype} (the layer's dtype)", x.dtype)
    expect(x.device == values.device, f"input on {values.device} (the layer's device)", x.device)
    if values.is_cuda:
        expect(x.dtype in DTYPE_NAMES, f"a dtype in {list(DTYPE_NAMES)} on the GPU", x.dtype)
    if bias is not None:
        expect(bias.dtype == values.dtype and bias.device == values.device,
               f"bias of dtype {values.dtype} on {values.device}", f"{bias.dtype} on {bias.device}")


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


@functools.lru_cache(maxsize=None)  # once per device: the forward calls it every time
def _check_byte_arch(dtype: torch.dtype, device_index: int) -> None:
    arch = runtime.device_arch(torch.device("cuda", device_index))
    least = MIN_ARCH.get(BYTE_DTYPE_NAMES[dtype], 80)
    expect(arch >= least and arch in ARCHS, f"a GPU of sm_{least} or later with sparsegen kernels for "
           f"{dtype} 2:4 products (or the tensors on the CPU)", f"sm_{arch}")


def indexed_reference(x, values, bias, flat_index, block, out_features: int, epilogue: str = "none"):
    """Pure PyTorch (the CPU path): rebuild the dense weight from the block index and call
    F.linear (then the epilogue). Static shapes, so it traces; differentiable as it is."""
    weight = bsr.scatter_blocks(values, flat_index, (out_features, x.shape[-1]), block)
    return epilogues.reference(F.linear(x, weight, bias), epilogue)


def bsr_dds_any_device(x, values, bias, row_offsets, col_indices, flat_index, block, out_features,
                       epilogue: str = "none"):
    if x.is_cuda and has_kernels(x.device.index or 0):
        return bsr_dds(x, values, row_offsets, col_indices, bias, block, out_features, epilogue=epilogue)
    return indexed_reference(x, values, bias, flat_index, block, out_features, epilogue)


def input_grad(dy, values, perm, row_offsets, col_indices, flat_index, block, out_features, tile=None, instr=None):
    """dX = dY W for W's stored blocks `values`, given W^T's index (block: W^T's block; its
    block b is values[perm[b]] transposed). Where a kernel reads the stored blocks
    transposed (input_grad_spec) no transposed copy of the values is made."""
    if tile or instr or _input_grad_kernel(dy, block) is not None:
        return bsr_dds(dy, values, row_offsets, col_indices, None, block, out_features, tile=tile, instr=instr,
                       perm=perm)
    return bsr_dds_any_device(dy, bsr.transpose_values(values, perm), None, row_offsets, col_indices, flat_index,
                              block, out_features)


def _input_grad_kernel(dy, block):
    if not (runs_16bit_kernels(dy) and dy.numel() > 0):
        return None
    small = dy.numel() // dy.shape[-1] <= 64
    return _transposed_kernel(tuple(block), dy.dtype, dy.device.index or 0, small)


@functools.lru_cache(maxsize=None)
def _transposed_kernel(block: tuple[int, int], dtype: torch.dtype, device_index: int, small: bool,
                       tile=None, instr=None):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    spec = input_grad_spec(block, DTYPE_NAMES[dtype], arch, rows=1 if small else None, tile=tile, instr=instr)
    return runtime.kernel(spec, device_index) if spec else None


def _input_grad_impl(dy, values, perm, row_offsets, col_indices, flat_index, block_rows, block_cols, out_features):
    return input_grad(dy, values, perm, row_offsets, col_indices, flat_index, (block_rows, block_cols), out_features)


input_grad_op = library.define(
    "bsr_input_grad(Tensor dy, Tensor values, Tensor perm, Tensor row_offsets, Tensor col_indices, "
    "Tensor flat_index, int block_rows, int block_cols, int out_features) -> Tensor",
    _input_grad_impl, lambda dy, *index_and_sizes: library.rows_by(dy, index_and_sizes[-1]))


@functools.lru_cache(maxsize=None)
def has_kernels(device_index: int) -> bool:
    """Whether sparsegen's templates cover this GPU (sm_80 and later, as spec.ARCHS lists).
    Older or unknown GPUs run the PyTorch reference instead, with one warning."""
    arch = runtime.device_arch(torch.device("cuda", device_index))
    if arch in ARCHS:
        return True
    warnings.warn(f"sparsegen: no kernels for sm_{arch} (supported: {', '.join(f'sm_{a}' for a in ARCHS)}); "
                  "using the PyTorch reference on this GPU.", RuntimeWarning, stacklevel=3)
    return False


_16BIT = (torch.float16, torch.bfloat16)


def runs_prune_kernels(t: torch.Tensor) -> bool:
    """A 16-bit or one-byte CUDA tensor on a GPU the templates cover (the 2:4 pruning kernels,
    which need no tensor cores: e4m3 prunes on the GPU whatever its arch)."""
    return _on_covered_gpu(t, _16BIT + tuple(BYTE_DTYPE_NAMES))


def runs_16bit_kernels(t: torch.Tensor) -> bool:
    """A float16/bfloat16 CUDA tensor on a GPU the templates cover (the 2:4 kernels' domain)."""
    return _on_covered_gpu(t, _16BIT)


def _on_covered_gpu(t: torch.Tensor, dtypes: tuple) -> bool:
    return t.is_cuda and t.dtype in dtypes and has_kernels(t.device.index or 0)


def _bsr_dds_impl(x, values, bias, row_offsets, col_indices, flat_index, block_rows, block_cols, out_features,
                  epilogue="none"):
    return bsr_dds_any_device(x, values, bias, row_offsets, col_indices, flat_index, (block_rows, block_cols),
                              out_features, epilogue)


def fake_product(x, *args):
    """A fake forward result: x's leading dims by the epilogue's output width (the last two
    arguments: the weight's rows and the epilogue)."""
    return library.rows_by(x, epilogues.output_features(args[-1], args[-2]))


bsr_dds_op = library.define(
    "bsr_dds(Tensor x, Tensor values, Tensor? bias, Tensor row_offsets, Tensor col_indices, Tensor flat_index, "
    "int block_rows, int block_cols, int out_features, str epilogue) -> Tensor",
    _bsr_dds_impl, fake_product)


@functools.lru_cache(maxsize=None)
def _forward_kernel(block: tuple[int, int], dtype: torch.dtype, device_index: int, small: bool,
                    tile=None, instr=None, epilogue: str = "none"):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    # The CUBIN is built for the device's own compute capability: sm_80 code won't load on sm_90.
    spec = forward_spec(block, DTYPE_NAMES[dtype], arch, tile, instr, rows=1 if small else None, epilogue=epilogue)
    return runtime.kernel(spec, device_index)


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous() if not x2.is_contiguous() else x2.clone()
    return x2


def _output(out, m: int, n: int, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(m, n, dtype=dtype, device=x.device)
    if not (out.is_contiguous() and out.numel() == m * n and out.dtype == dtype
            and out.device == x.device and out.data_ptr() % 16 == 0):
        _explain_bad_out(out, m * n, x.device, dtype)  # (formatting the message costs more than the call)
    return out.view(m, n)


def _explain_bad_out(out, elements: int, device, dtype: torch.dtype) -> None:
    raise InputError(f"Expected out: contiguous, 16-byte aligned, {elements} elements, {dtype} on {device}. "
                     f"Got {tuple(out.shape)} {out.dtype} on {out.device}, contiguous={out.is_contiguous()}, "
                     f"address % 16 = {out.data_ptr() % 16}.")


def _output_for(x: torch.Tensor, x2: torch.Tensor, out, out_features: int, dtype: torch.dtype | None = None):
    """(Y [M, N] to write, Y in x's leading shape)."""
    y = _output(out, x2.shape[0], out_features, x, dtype or x.dtype)
    return y, y if x.dim() == 2 else y.view(*x.shape[:-1], out_features)


def bsr_dds(x, values, row_offsets, col_indices, bias, block, out_features, out=None, tile=None,
            instr=None, perm=None, epilogue="none"):
    """Y = X W^T (+ bias) on the GPU with a generated kernel; x may have leading batch dims.
    `out` (contiguous, [..., width]) receives Y when given; `tile` overrides the default
    TileConfig and `instr` the kernel family (spec.INSTRS). With `perm`, W^T's block b is
    values[perm[b]] transposed (input_grad). `epilogue` (epilogues.EPILOGUES) is applied in
    the kernel's store; a gated one makes Y out_features / 2 wide."""
    x2 = _rows_2d(x)
    m, k = x2.shape
    if m == 0 or values.shape[0] == 0:  # no block at all (and TMA cannot describe an empty tensor)
        return _product_without_weight(x, x2, bias, out, out_features, epilogue)
    if tile is None and instr is None:
        plan = _kept_bsr_plan(x2, values, row_offsets, col_indices, perm, block, out_features, epilogue)
    else:
        plan = _bsr_plan(x2, values, row_offsets, col_indices, perm, block, out_features, tile, instr, epilogue)
    if plan.dense:
        weight = _dense_forward_weight(x2, values, row_offsets, col_indices, block, out_features,
                                       plan.scatter_when_trained)
        if weight is not None and _dense_now(plan):
            return _dense_result(x, x2, weight, bias, out, epilogue)
    y, shaped = _output_for(x, x2, out, plan.width)
    plan.run(x2, values, bias, y)
    return shaped


def bsr_lean_plan(x, values, row_offsets, col_indices, block, out_features: int, epilogue: str = "none"):
    """The plan that repeated inference calls of x's signature run straight (plan.run, on
    inputs that passed check_inputs; lean.py); None where every such call must take bsr_dds:
    off the GPU, an empty product, the dense path outside graphs, a CUDA graph capture."""
    if not (x.is_cuda and has_kernels(x.device.index or 0) and x.numel() and values.shape[0]):
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    x2 = _rows_2d(x)
    plan = _kept_bsr_plan(x2, values, row_offsets, col_indices, None, block, out_features, epilogue)
    if plan.dense_eager:
        return None
    if plan.dense:  # the copy a CUDA graph capture takes, built now (bsr_dds builds it on every call)
        _dense_forward_weight(x2, values, row_offsets, col_indices, block, out_features, False)
    return plan


def _kept_bsr_plan(x2, values, row_offsets, col_indices, perm, block, out_features: int, epilogue: str):
    """The plan for these operands with default kernels, made once per layout and signature."""
    return _PLANS.get(row_offsets, (x2.shape[0], x2.dtype, tuple(block), out_features, perm is None, epilogue),
                      lambda: _bsr_plan(x2, values, row_offsets, col_indices, perm, block, out_features,
                                        epilogue=epilogue))


@dataclasses.dataclass(frozen=True)
class _BsrPlan:
    kern: runtime.Kernel
    launch: runtime.PackedLaunch    # its parameters: X and W (pointers or TMA maps), index, bias, Y
    keep: tuple[torch.Tensor, ...]  # what the index pointers point into, row_offsets (the plan's key) aside
    width: int                      # Y's columns (half of W's rows for a gated epilogue)
    dense: bool = False             # cuBLAS on a dense copy of W first (dense_path), in CUDA graphs
    dense_eager: bool = False       # and outside them (not host-bound: dense_outside_graphs)
    scatter_when_trained: bool = False  # and on a weight scattered per call once W is trained

    def run(self, x2: torch.Tensor, values: torch.Tensor, bias, y: torch.Tensor) -> None:
        """Launch on these operands (of the plan's signature; Y contiguous, 16-byte aligned)."""
        launch, pointers = self.launch, self.launch.pointers
        with launch.lock:
            launch.bind(0, x2.data_ptr())
            launch.bind(1, values.data_ptr())
            pointers[-2], pointers[-1] = bias.data_ptr() if bias is not None else 0, y.data_ptr()
            launch.run()


_PLANS = plans.PlanCache()


def _bsr_plan(x2, values, row_offsets, col_indices, perm, block, out_features, tile=None, instr=None,
              epilogue="none"):
    """What bsr_dds launches for these operands: the kernel, its grid and index, and whether
    cuBLAS on a dense weight comes first (forward calls with default kernels only)."""
    (m, k), device_index = x2.shape, x2.device.index or 0
    if perm is None:
        kern = _forward_kernel(tuple(block), x2.dtype, device_index, m <= 64, tile, instr, epilogue)
    else:
        expect(epilogue == "none", "no epilogue for the product with W^T", repr(epilogue))
        kern = _transposed_kernel(tuple(block), x2.dtype, device_index, m <= 64, tile, instr)
    dense = scatter = False
    if tile is None and instr is None:
        kern = _swap_variant(kern, x2.dtype, m, row_offsets, col_indices, perm)
        if perm is None:
            grid_blocks = (out_features // block[0]) * (k // block[1])
            scatter = _dense_pays(block, values.shape[0], m, k, out_features)
            dense = scatter or dense_path.wanted("bsr", device_index, out_features, k, m, tuple(block),
                                                 values.shape[0] / max(grid_blocks, 1))
    index = _kernel_index(kern.spec, row_offsets, col_indices, perm)
    # keep holds no row_offsets: the plan cache keys plans by it, weakly (plans.PlanCache)
    return _BsrPlan(kern, _bsr_launch(kern, x2, values, block, out_features, index),
                    tuple(t for t in index if t is not None and t is not row_offsets),
                    epilogues.output_features(epilogue, out_features), dense,
                    dense and (scatter or dense_outside_graphs(m, k, out_features)), scatter)


def _bsr_launch(kern, x2, values, block, out_features: int, index: tuple) -> runtime.PackedLaunch:
    """The packed launch of a block-sparse product: X and W as TMA maps or the first two
    pointers (bound per call), the index, then bias and Y (written per call)."""
    (m, k), maps = x2.shape, _operand_maps(kern.spec, x2, values, block)
    pointers = (0,) * (2 - len(maps)) + tuple(t.data_ptr() if t is not None else 0 for t in index) + (0, 0)
    return runtime.PackedLaunch(kern, _grid(kern, m, out_features), maps, pointers,
                                (m, k, out_features) + _tma_tail(kern.spec, values))


# Small blocks at high density lose to cuBLAS on the same weight made dense: on an H100
# (BENCHMARKS.md) block 16 ran 0.6-0.84x dense at d 0.1 and 0.2x at 0.5, block 32 0.9-1.03x
# at 0.25 and 0.45-0.54x at 0.5, while scattering the blocks into a dense weight (the
# generated bsr_scatter kernel: 25 us for 4096 x 4096, 58 us for 11008 x 4096) costs 5-14%
# of the GEMM at M = 4096-8192. Per smaller block side, the density from which the forward
# takes that path, for DENSE_MIN_ROWS tokens or more (with fewer the GEMM does too little
# work to pay for reading and writing a dense weight).
DENSE_FROM_DENSITY = {16: 0.08, 32: 0.3}
DENSE_MIN_ROWS = 1024


# The dense path wins GPU time (crossovers); outside a CUDA graph a small call is bound by the
# host instead, and there the dense path costs more: F.linear's host path (cuBLAS heuristics)
# is heavier than our launch. On the H100 machine's host (24 stacked 1024x1024 bf16 layers,
# 16 tokens, no_grad, us a call): block-sparse kernels 20.2, their dense path 28.7; 2:4 kernels
# 22.0, dense path 44.9; nn.Linear 26.9. Below HOST_BOUND_FLOPS (about 30 us of a 16-bit GEMM
# on an H100, a slow host's cost of a call) a call keeps its kernels outside graphs, and takes
# the dense path (copy built while outside) once captured, where host time is gone.
HOST_BOUND_FLOPS = 2 ** 34


def dense_outside_graphs(m: int, k: int, n: int) -> bool:
    return 2 * m * k * n >= HOST_BOUND_FLOPS


def _dense_now(plan) -> bool:
    """Whether a plan with the dense path takes it on this call (a _BsrPlan or _Sp24Plan)."""
    return plan.dense_eager or torch.cuda.is_current_stream_capturing()


def _dense_pays(block, stored_blocks: int, m: int, k: int, out_features: int) -> bool:
    if m < DENSE_MIN_ROWS:  # first: the cheapest test, and the one small batches fail
        return False
    least = DENSE_FROM_DENSITY.get(min(block))
    return least is not None and stored_blocks >= least * (out_features // block[0]) * (k // block[1])


def _dense_result(x, x2, weight, bias, out, epilogue="none"):
    """Y = X W^T (+ bias) by cuBLAS on a dense weight, then the epilogue, into `out` or a new
    tensor. Like the kernels, it records no autograd (the layers' autograd Functions
    differentiate the ops)."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return _dense_result(x, x2, weight, bias, out, epilogue)
    y, shaped = _output_for(x, x2, out, epilogues.output_features(epilogue, weight.shape[0]))
    if epilogues.is_gated(epilogue):  # the product is twice Y's width
        epilogues.gated_into(y, F.linear(x2, weight, bias), epilogue)
    else:
        epilogues.apply_in_place(dense_path.linear_into(y, x2, weight, bias), epilogue)
    return shaped


def _product_without_weight(x, x2, bias, out, out_features: int, epilogue: str):
    """What a product with no rows of X or no stored weight gives: the epilogue of the bias
    (or of zeros), in x's leading shape."""
    y, shaped = _output_for(x, x2, out, epilogues.output_features(epilogue, out_features), sp24_output_dtype(x.dtype))
    z = bias.to(y.dtype).expand(y.shape[0], out_features) if bias is not None else y.new_zeros(y.shape[0], out_features)
    y.copy_(epilogues.reference(z, epilogue))
    return shaped


def _dense_forward_weight(x2, values, row_offsets, col_indices, block, out_features: int, scatter: bool):
    """The layer's dense copy of W, or (`scatter`, once W is being trained) one scattered for
    this call; None where there is neither (the kernels then)."""
    inputs = (values, row_offsets, col_indices, (out_features, x2.shape[1]), block)
    weight = dense_path.copy_of(row_offsets, values, dense_weight, *inputs)
    return dense_weight(*inputs) if weight is None and scatter else weight


def dense_weight(values, row_offsets, col_indices, shape, block) -> torch.Tensor:
    """The dense W [N, K] of CUDA `values` on the generated bsr_scatter kernel: one pass that
    writes W once (about 3x faster on an H100 than zeros plus an indexed write, BENCHMARKS.md)."""
    (n, k), (bm, bk) = shape, tuple(block)
    slot = _per_layout("block slots", row_offsets, bsr.block_slots, row_offsets, col_indices, k // bk)
    kern = _scatter_kernel((bm, bk), values.dtype, values.device.index or 0)
    values = values.contiguous() if values.data_ptr() % 16 == 0 else values.clone()  # read 16 bytes at a time
    dense = values.new_empty(n, k)
    chunks = -(-bm * k * values.element_size() // 16 // kern.threads)
    kern.launch(((n // bm) * chunks, 1, 1), (), (values.data_ptr(), slot.data_ptr(), dense.data_ptr()), (k, chunks))
    return dense


@functools.lru_cache(maxsize=None)
def _scatter_kernel(block: tuple[int, int], dtype: torch.dtype, device_index: int):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    return runtime.kernel(scatter_spec(block, DTYPE_NAMES[dtype], arch), device_index)


def _kernel_index(spec, row_offsets, col_indices, perm) -> tuple:
    """The index tensors a kernel takes: W's block CSR, and perm for swap (None: none); pairs
    take the union columns of pairs of block rows, each row's block there and the pairs'
    rows instead."""
    if spec.instr == "pairs":
        return tuple(_pair_index(row_offsets, col_indices, perm))
    return (row_offsets, col_indices, perm) if spec.instr == "swap" else (row_offsets, col_indices)


# Tensors derived from a layer's index that cost host work (or a sync) to build, kept while
# the index tensor they are keyed by lives (by identity: a layer rebuilds its index tensors
# when its layout changes; the stamp of data pointers and _version catches edits in place).
_PER_LAYOUT = WeakIdKeyDictionary()


def _per_layout(what: str, key: torch.Tensor, build, *inputs, reads_host: bool = False):
    """build(*inputs), remembered per (key tensor, what) until one of the tensor inputs changes.
    Not during CUDA graph capture: what a captured build allocates only holds its values when
    the graph replays. A build that reads the index on the host cannot run then at all."""
    stamp = tuple((t.data_ptr(), t._version) if isinstance(t, torch.Tensor) else t for t in inputs)
    entries = _PER_LAYOUT.setdefault(key, {})
    if what in entries and entries[what][0] == stamp:
        return entries[what][1]
    if key.is_cuda and torch.cuda.is_current_stream_capturing():
        expect(not reads_host, f"a warm-up call of the layer before CUDA graph capture (its {what} index is "
               "built on the host once per layout)", "a first call inside the capture")
        return build(*inputs)
    entries[what] = (stamp, outside_graphs.run(build, inputs, key.device))
    return entries[what][1]


def _pair_index(row_offsets, col_indices, perm) -> tuple[torch.Tensor, ...]:
    """bsr.pair_index, which reads the index on the host: built once per layout."""
    return _per_layout("pairs", row_offsets, bsr.pair_index, row_offsets, col_indices, perm, reads_host=True)


def _swap_variant(kern, dtype: torch.dtype, m: int, row_offsets, col_indices, perm):
    """The swap family's choices at 64-row blocks that depend on the call (H100 sweeps,
    BENCHMARKS.md): the forward runs `pairs` where the layout's pairs share enough columns
    (dX always does), and clusters of two blocks share W's copies where tiles are many and
    long (_cluster_pays)."""
    spec = kern.spec
    if not has_call_variants(spec):
        return kern
    pairs = spec.instr == "pairs" or (perm is None and _pairs_pay(row_offsets, col_indices))
    instr = "pairs" if pairs else "swap"
    cluster = 2 if _cluster_pays(-(-m // spec.tile.tile_m), col_indices.numel() * spec.block[1] // 64,
                                 row_offsets.numel() - 1) else 1
    if (instr, cluster) == (spec.instr, spec.tile.cluster):
        return kern
    tile = dataclasses.replace(spec.tile, cluster=cluster)
    return runtime.kernel(dataclasses.replace(spec, tile=tile, instr=instr), kern.device_index)


def _cluster_pays(token_tiles: int, stages: int, block_rows: int) -> bool:
    """Clusters of two (sharing W's copies) from 32 token tiles and 16 stages (64 columns of
    K) a block row on average. On an H100 they gained 0-5% at (8192, 4096, 11008) and
    (8192, 11008, 4096) with 16-86 stages a row (dX 3-5%), lost up to 3.5% with 6.4, and 5-6%
    at (4096, 4096, 4096) (16 token tiles) and (16384, 1024, 4096) (4 stages a row)."""
    return token_tiles >= 32 and stages >= 16 * max(block_rows, 1)


def _pairs_pay(row_offsets, col_indices) -> bool:
    """Whether the forward's swap kernel should run over pairs of block rows instead. The
    rule fits an H100 (tmp_probe-style sweep over issue #2's shapes at block 64, BENCHMARKS.md):
    pairs won 6-24% where the two rows of a pair shared a fifth of their columns or more
    (1.2+ blocks per union column, density ~0.4 and up) over long rows, and lost up to 16%
    at density 0.1-0.25 or with 16 blocks a row (K = 1024). Fitted with neighbouring rows as
    pairs; with pairs matched by shared columns, d 0.25 qualifies at (8192, 4096, 11008) and
    (8192, 11008, 4096) and ran 12-16% faster than swap."""
    pair_offsets, _, halves, _ = _pair_index(row_offsets, col_indices, None)
    union, pairs = halves.shape[0], pair_offsets.numel() - 1
    return col_indices.numel() >= 1.2 * union and union >= 24 * pairs


def _grid(kern, m: int, n: int) -> tuple[int, int, int]:
    spec, cluster = kern.spec, kern.spec.tile.cluster
    rows = 128 if spec.instr == "pairs" else spec.block[0]  # pairs: two block rows a tile
    tiles = (-(-n // rows), -(-m // spec.tile.tile_m))
    if cluster > 1:  # persistent clusters, each taking `cluster` neighbouring token tiles of one tile row
        groups = tiles[0] * -(-tiles[1] // cluster)
        return (cluster * min(groups, kern.resident_blocks // cluster), 1, 1)
    if spec.instr in TMA_INSTRS:  # persistent: one block per SM walks the tiles
        return (min(tiles[0] * tiles[1], runtime.sm_count(kern.device_index)), 1, 1)
    return (*tiles, 1)


def _operand_maps(spec, x2: torch.Tensor, values: torch.Tensor, block) -> tuple:
    """The TMA descriptors' shapes (runtime.TensorMap's arguments after the address) of X and
    W as a TMA kernel reads them; none for the others, which take pointers."""
    if spec.instr not in TMA_INSTRS:
        return ()
    sub_k = min(block[1], 64)  # one TMA box per block width, at most 128 bytes
    x_map = (x2.dtype, x2.shape[0], x2.shape[1], spec.tile.tile_m, sub_k)
    share = spec.tile.cluster  # in a cluster each block copies 1/cluster of a W box's rows
    if spec.trans == "nn":  # the stored blocks, [block[1] x block[0]] each, in 64 x 64 boxes
        return x_map, (values.dtype, values.shape[0] * block[1], block[0], 64 // share, 64)
    return x_map, (values.dtype, values.shape[0] * block[0], block[1], block[0] // share, sub_k)


def _tma_tail(spec, values: torch.Tensor) -> tuple:
    # Rows of W's value tensor: reading from there on yields zeros (past a row's last block).
    return (values.shape[0] * spec.block[0],) if spec.instr in TMA_INSTRS else ()


# Measured on an H200 (tools/bench.py --train): the sdd kernel beats cuBLAS + gather below
# about d = 0.3 (mma.sync). The wgmma one (sm_90) took 0.86 ms at block 64, d 0.5, against
# 0.94 ms for cuBLAS's whole dense dW; 0.6 extrapolates from its time growing with the
# blocks kept (cuBLAS's does not), not from a measurement at 0.6.
SDD_MAX_DENSITY = {"mma": 0.3, "tma": 0.6}


@functools.lru_cache(maxsize=None)
def _sdd_spec(block: tuple[int, int], dtype: torch.dtype, device_index: int, many_blocks: bool = False):
    return sdd_spec(block, DTYPE_NAMES[dtype], runtime.device_arch(torch.device("cuda", device_index)),
                    many_blocks=many_blocks)


@functools.lru_cache(maxsize=None)
def _sdd_kernel(block: tuple[int, int], dtype: torch.dtype, device_index: int, many_blocks: bool):
    return runtime.kernel(_sdd_spec(block, dtype, device_index, many_blocks), device_index)


# Stored blocks per SM from which the sdd kernel's wide tile (sdd_spec's many_blocks, items
# of 8 blocks) pays at 64-row blocks. On an H100 (tmp_probe sweep, BENCHMARKS.md), wide over
# narrow time: 0.83-0.85 at 7.8 and 15.5 blocks an SM, 0.90-0.94 at 21-42, 0.99 at 8.3 (short
# rows: partial items); 1.25-1.58 at 0.8-3.9, where the narrow tile's items still fit one
# round on the SMs and the wide one leaves half of them idle.
SDD_WIDE_BLOCKS_PER_SM = 6


def weight_grad(dy2: torch.Tensor, x2: torch.Tensor, flat_index: torch.Tensor, block) -> torch.Tensor:
    """dW at the stored blocks: dY^T X sampled there. [M, N] and [M, K] -> [nnz, bm, bk].
    16-bit GPU tensors at densities up to SDD_MAX_DENSITY run the generated sdd kernel;
    the rest a dense GEMM (cuBLAS) and a gather, which is faster there."""
    blocks = (dy2.shape[1] // block[0]) * (x2.shape[1] // block[1])
    if not (runs_16bit_kernels(dy2) and flat_index.numel() <= _sdd_max_density(dy2, block) * blocks):
        return bsr.gather_blocks(dy2.t() @ x2, flat_index, block)
    dy2, x2 = dy2.contiguous(), x2.contiguous()
    dw = torch.empty(flat_index.numel(), *block, dtype=dy2.dtype, device=dy2.device)
    if flat_index.numel() == 0 or dy2.shape[0] == 0:
        return dw.zero_()
    return sdd_into(dw, dy2, x2, flat_index.contiguous(), tuple(block))


def _sdd_max_density(dy2: torch.Tensor, block) -> float:
    """From the spec alone: deciding on cuBLAS must not compile or load the kernel."""
    return SDD_MAX_DENSITY[_sdd_spec(tuple(block), dy2.dtype, dy2.device.index or 0).instr]


def sdd_kernel_for(dy2: torch.Tensor, flat_index: torch.Tensor, block):
    """The sdd kernel weight_grad runs for this many stored blocks on dy2's GPU: the wide
    tile from SDD_WIDE_BLOCKS_PER_SM blocks an SM (at 64-row blocks on sm_90)."""
    device_index = dy2.device.index or 0
    many_blocks = flat_index.numel() >= SDD_WIDE_BLOCKS_PER_SM * runtime.sm_count(device_index)
    return _sdd_kernel(tuple(block), dy2.dtype, device_index, many_blocks)


def sdd_into(dw, dy2, x2, flat_index, block, kern=None) -> torch.Tensor:
    """Run the generated sdd kernel (or `kern`, a tile being tried) for these contiguous,
    16-bit CUDA operands into dw."""
    kern = kern or sdd_kernel_for(dy2, flat_index, block)
    if kern.spec.instr == "tma":
        _launch_sdd_tma(kern, dy2, x2, flat_index, dw, block)
    else:
        kern.launch((flat_index.numel(), 1, 1), (), (dy2.data_ptr(), x2.data_ptr(), flat_index.data_ptr(),
                                                     dw.data_ptr()), (dy2.shape[0], dy2.shape[1], x2.shape[1]))
    return dw


def _launch_sdd_tma(kern, dy2, x2, flat_index, dw, block) -> None:
    """The Hopper sdd kernel: one block per work item (token-major TMA boxes of tile_m x 64)."""
    (m, n), k = dy2.shape, x2.shape[1]
    starts = _per_layout("sdd items", flat_index, sdd_item_starts, flat_index, k // block[1], n // block[0],
                         kern.spec.sdd_gather // block[1])
    tokens = kern.spec.tile.tile_m  # a stage's box: tokens x 64 features
    maps = (runtime.tensor_map(dy2.data_ptr(), dy2.dtype, m, n, tokens, 64),
            runtime.tensor_map(x2.data_ptr(), x2.dtype, m, k, tokens, 64))
    kern.launch((starts.numel(), 1, 1), maps, (flat_index.data_ptr(), starts.data_ptr(), dw.data_ptr()),
                (m, flat_index.numel(), k // block[1]))


def sdd_item_starts(flat_index: torch.Tensor, blocks_per_row: int, block_rows: int, group: int) -> torch.Tensor:
    """Where the sdd work items start: runs of up to `group` stored blocks of one block row
    (flat_index in row-major order). Padded with -1 to a bound known without reading the
    tensor, so no host sync: each row adds at most one run that is not full."""
    rows = flat_index // blocks_per_row
    in_row = torch.arange(rows.numel(), device=rows.device) - torch.searchsorted(rows, rows)
    bound = rows.numel() // group + min(block_rows, rows.numel())
    return torch.nonzero_static(in_row % group == 0, size=bound, fill_value=-1).squeeze(1)


def _bsr_sdd_impl(dy2, x2, flat_index, block_rows, block_cols):
    return weight_grad(dy2, x2, flat_index, (block_rows, block_cols))


bsr_sdd_op = library.define(
    "bsr_sdd(Tensor dy2, Tensor x2, Tensor flat_index, int block_rows, int block_cols) -> Tensor",
    _bsr_sdd_impl, lambda dy2, x2, flat_index, rows, cols: dy2.new_empty((flat_index.shape[0], rows, cols)))


@functools.lru_cache(maxsize=None)
def _sp24_kernel(dtype: torch.dtype, device_index: int, rows_bucket: int | None, tile=None, instr=None,
                 narrow: bool = False, epilogue: str = "none"):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    spec = sp24_spec(_SP24_DTYPE_NAMES[dtype], arch, tile, rows=rows_bucket, instr=instr, narrow=narrow,
                     epilogue=epilogue)
    return runtime.kernel(spec, device_index)


def _rows_bucket(m: int) -> int | None:
    """The batch sizes sp24_spec tells apart (a few cached kernels, not one per M)."""
    return 32 if m <= 32 else 128 if m <= 128 else None


def _sp24_launch(kern, grid, k_split: int, x2: torch.Tensor, values, metadata, out_features: int):
    """(The packed launch of a 2:4 product, the tensors it points into). X is bound per call
    (a TMA map or the first pointer); W's values and metadata are bound here, the same call
    after call: per stage, 32 kept values and 2 k32 tiles of metadata words per row (twice as
    many of each for one-byte dtypes). Then bias, Y and the split-K sums and counts."""
    spec, (m, k), ints = kern.spec, x2.shape, (x2.shape[0], x2.shape[1], out_features, k_split)
    if spec.instr != "tma":
        pointers = (0, values.data_ptr(), metadata.data_ptr(), 0, 0, 0, 0)
        return runtime.PackedLaunch(kern, grid, (), pointers, ints), ()
    given = (values, metadata)
    values, metadata = _aligned(values), _aligned(metadata)  # TMA reads from 16-byte aligned rows
    (n, half_k), w_rows, per_byte = values.shape, spec.sp24_w_rows, 2 // values.element_size()
    maps = ((x2.dtype, m, k, spec.tile.tile_m // spec.tile.cluster, 64 * per_byte),
            (values.dtype, n, half_k, w_rows, 32 * per_byte),
            (torch.int32, n // 16, half_k, w_rows // 16, 32 * per_byte, False))
    launch = runtime.PackedLaunch(kern, grid, maps, (0, 0, 0, 0), ints)
    launch.bind_map(1, values.data_ptr())
    launch.bind_map(2, metadata.data_ptr())
    # Only copies are kept: the caller's tensors live as long as the call, or (a kept plan) as
    # its key, the metadata, which a plan must not hold (plans.PlanCache) - a training step's
    # fresh compression would never be freed.
    return launch, tuple(t for t, g in zip((values, metadata), given) if t is not g)


SP24_STAGE_K = 128  # dense K per pipeline stage of the sp24 kernel: K splits come in these


def _k_splits(blocks: int, k: int, device_index: int, per_sm: int = 2, min_stages: int = 1) -> int:
    """Small batches give too few output tiles to fill the GPU: split K until about
    `per_sm` blocks per SM run (each split adds its partial sum in float32), each split
    `min_stages` stages of K at least."""
    stages = -(-k // SP24_STAGE_K)
    return max(1, min(stages // min_stages, (per_sm * runtime.sm_count(device_index)) // max(blocks, 1)))


def _narrow_tiles(m: int, n: int, device_index: int) -> bool:
    """33-128 tokens on Hopper: blocks of 64 W rows x 64 tokens, except 65-128 tokens on a
    weight whose 128-row tiles fill half the SMs or more: 128 W rows x 128 tokens. From a
    decode sweep on an H100 (tools/bench24.py --tune-decode, weights read from HBM): at M 128
    11008x4096 ran 1.45x dense that way against 1.17x narrow and 1.00x on 128 x 64 tiles,
    14336x4096 1.54x against 1.25x; 8192x8192 (64 tiles) 1.34x narrow against 1.23x; at M 64
    narrow was as fast or faster everywhere (4096x4096 0.95x against 0.80x)."""
    if _rows_bucket(m) != 128:
        return False
    return m <= 64 or 2 * -(-n // 128) < runtime.sm_count(device_index)


# K splits of wgmma.sp decode launches (the same sweep): one block per SM (a second split per SM
# only added atomics), and for 33-128 tokens at least 24 stages (3072 of K) a split - 4096x4096
# at M 64 ran 0.95x dense unsplit and 0.75x in two.
_DECODE_MIN_STAGES = {32: 1, 128: 24}


def _sp24_grid(spec, m: int, k: int, n: int, device_index: int, splits: int | None, resident: int | None = None):
    """(grid, dense K per split): output tiles (mma.sp: in x and y; wgmma.sp: x, no more blocks
    than `resident` (default: one per SM), each walking tiles x, x + grid x, ...), K splits
    (whole stages) in z."""
    tiles_n, tiles_m = -(-n // spec.sp24_w_rows), -(-m // spec.tile.tile_m)
    decode = spec.instr == "tma" and _rows_bucket(m) is not None
    per_sm, min_stages = (1, _DECODE_MIN_STAGES[_rows_bucket(m)]) if decode else (2, 1)
    wanted = splits or (_k_splits(tiles_n * tiles_m, k, device_index, per_sm, min_stages) if m <= 256 else 1)
    k_split = -(-k // (wanted * SP24_STAGE_K)) * SP24_STAGE_K
    k_splits = -(-k // k_split)
    if spec.instr != "tma":
        return (tiles_n, tiles_m, k_splits), k_split
    cluster = spec.tile.cluster  # a cluster's blocks take neighbouring W tiles: work items of `cluster` tiles
    items, slots = -(-tiles_n // cluster) * tiles_m, (resident or runtime.sm_count(device_index)) // cluster
    return (cluster * (items if k_splits > 1 else min(items, slots)), 1, k_splits), k_split


def sp24_dds(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, bias, out_features: int,
             out=None, tile=None, splits: int | None = None, instr: str | None = None,
             epilogue: str = "none") -> torch.Tensor:
    """Y = X W^T (+ bias) with W 2:4 ([N, K/2] values and mma.sp metadata) on the GPU;
    x may have leading batch dims. The kernel writes Y in its own layout; small batches
    split K across blocks (`splits` overrides how many; `tile` the TileConfig), which add
    their sums in a workspace and the last split of each tile writes Y: one launch.
    `epilogue` as in bsr_dds."""
    x2 = _rows_2d(x)
    m, k = x2.shape
    if m == 0 or out_features == 0 or k == 0:  # (no tensor map describes an empty tensor)
        return _product_without_weight(x, x2, bias, out, out_features, epilogue)
    if x.dtype == torch.int8:  # K splits add float32 partials, which would round int32 sums
        splits = 1
    if tile is None and instr is None and _tma_ready(values) and _tma_ready(metadata):
        plan = _kept_sp24_plan(x2, values, metadata, out_features, splits, epilogue)
    else:  # (a plan would keep aligned copies of W, which go stale when W is trained)
        plan = _sp24_plan(x2, values, metadata, out_features, splits, tile, instr, epilogue)
    if plan.dense:
        weight = _sp24_dense_weight(values, metadata, out_features, k)
        if weight is not None and _dense_now(plan):
            return _dense_result(x, x2, weight, bias, out, epilogue)
    y, shaped = _output_for(x, x2, out, plan.width, sp24_output_dtype(x.dtype))
    plan.run(x2, values, bias, y)
    return shaped


def sp24_lean_plan(x, values, metadata, out_features: int, epilogue: str = "none"):
    """As bsr_lean_plan, for 2:4 products (16-bit; W's values as the plan found them)."""
    if not (runs_16bit_kernels(x) and x.numel() and out_features and _tma_ready(values) and _tma_ready(metadata)):
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    x2 = _rows_2d(x)
    plan = _kept_sp24_plan(x2, values, metadata, out_features, None, epilogue)
    if plan.dense_eager:
        return None
    if plan.dense:  # the copy a CUDA graph capture takes, built now (sp24_dds builds it on every call)
        _sp24_dense_weight(values, metadata, out_features, x2.shape[1])
    return plan


def _kept_sp24_plan(x2, values, metadata, out_features: int, splits, epilogue: str):
    """The plan for these operands with default kernels, made once per weight and signature."""
    return _PLANS.get(metadata, (*x2.shape, x2.dtype, out_features, splits, values.data_ptr(), epilogue),
                      lambda: _sp24_plan(x2, values, metadata, out_features, splits, epilogue=epilogue))


def _sp24_dense_weight(values, metadata, out_features: int, k: int):
    return dense_path.copy_of(metadata, values, semi24.decompress, values, metadata, (out_features, k))


@dataclasses.dataclass(frozen=True)
class _Sp24Plan:
    kern: runtime.Kernel
    launch: runtime.PackedLaunch      # its parameters: X, W's values and metadata, bias, Y, sums, counts
    keep: tuple[torch.Tensor, ...]    # copies W's pointers or maps point into (aligned ones made for it)
    workspace: int                    # float32 words of split-K sums and tile counts (0: no split)
    counts_at: int                    # bytes from the sums (M x N float32) to the tile counts
    width: int                        # Y's columns (half of W's rows for a gated epilogue)
    dense: bool = False               # cuBLAS on a dense copy of W first (dense_path), in CUDA graphs
    dense_eager: bool = False         # and outside them (not host-bound: dense_outside_graphs)

    def run(self, x2: torch.Tensor, values, bias, y: torch.Tensor) -> None:
        """Launch on these operands (of the plan's signature, W as the plan bound it; Y
        contiguous, 16-byte aligned)."""
        sums = _split_sums(self, x2.device) if self.workspace else None
        launch, pointers = self.launch, self.launch.pointers
        with launch.lock:
            launch.bind(0, x2.data_ptr())
            pointers[-4], pointers[-3] = bias.data_ptr() if bias is not None else 0, y.data_ptr()
            if sums is not None:  # the tile counts follow the sums
                pointers[-2], pointers[-1] = sums.data_ptr(), sums.data_ptr() + self.counts_at
            launch.run()


def _sp24_plan(x2: torch.Tensor, values, metadata, out_features: int, splits, tile=None, instr=None,
               epilogue="none") -> _Sp24Plan:
    """What sp24_dds launches for these operands."""
    (m, k), device_index = x2.shape, x2.device.index or 0
    kern = _sp24_kernel(x2.dtype, device_index, _rows_bucket(m), tile, instr,
                        _narrow_tiles(m, out_features, device_index), epilogue)
    grid, k_split = _sp24_grid(kern.spec, m, k, out_features, device_index, splits, kern.resident_blocks)
    workspace = m * out_features + _tile_counts(kern.spec, m, out_features) if grid[2] > 1 else 0
    dense = (tile is None and instr is None and x2.dtype in _16BIT
             and dense_path.wanted("sp24", device_index, out_features, k, m))
    return _Sp24Plan(kern, *_sp24_launch(kern, grid, k_split, x2, values, metadata, out_features), workspace,
                     4 * m * out_features, epilogues.output_features(epilogue, out_features), dense,
                     dense and dense_outside_graphs(m, k, out_features))


def _tile_counts(spec, m: int, n: int) -> int:
    """Arrival counters a split-K launch needs: at most one per token tile, W tile (its
    column count padded to whole clusters) and 64 features of it."""
    tiles_w = -(-(-(-n // spec.sp24_w_rows)) // spec.tile.cluster) * spec.tile.cluster
    return -(-m // spec.tile.tile_m) * tiles_w * (spec.sp24_w_rows // 64)


def _split_sums(plan: _Sp24Plan, device: torch.device) -> torch.Tensor | None:
    """The zeroed workspace a split-K launch adds into (None: no split). During CUDA graph
    capture with none big enough, one zeroed inside the graph, used by this call only."""
    if not plan.workspace:
        return None
    stream = runtime.current_stream(device.index or 0)
    if torch.cuda.is_current_stream_capturing():
        held = workspace.current(device, stream)
        return held if held is not None and held.numel() >= plan.workspace else _zeros(plan.workspace, device)
    return workspace.zeroed(device, stream, plan.workspace, _zeros_outside_graph_pools)


def _zeros(floats: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(floats, dtype=torch.float32, device=device)


def _zeros_outside_graph_pools(floats: int, device: torch.device) -> torch.Tensor:
    return outside_graphs.run(_zeros, (floats, device), device)


@functools.lru_cache(maxsize=None)
def _sp24_prune_kernel(op: str, dtype: torch.dtype, device_index: int):
    arch = runtime.device_arch(torch.device("cuda", device_index))
    return runtime.kernel(sp24_compress_spec(_SP24_DTYPE_NAMES[dtype], arch, op), device_index)


def _tma_ready(t: torch.Tensor) -> bool:
    """Contiguous at a 16-byte aligned address: what _aligned returns as it is."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def _aligned(w: torch.Tensor) -> torch.Tensor:
    """w contiguous at a 16-byte aligned address: the prune kernels read rows in 8 or 16 bytes."""
    w = w.contiguous()
    return w.clone() if w.data_ptr() % 16 else w


_MAGNITUDE, _MASKED, _MVUE = 0, 1, 2  # sp24_compress's modes


def _rows_or_columns(w: torch.Tensor, mask: torch.Tensor | None):
    """(w, mask, row step, column step) for the compress kernel: a row-major weight, or the
    transposed view of one (dX's W^T: compressed without a transpose copy). The mask is
    brought to w's strides; anything else is made contiguous."""
    transposed = w.dim() == 2 and w.stride() == (1, w.shape[0]) and w.shape[0] > 1
    if not transposed:
        w = _aligned(w)
        return w, None if mask is None else _aligned(mask.to(w.device)), w.shape[1], 1
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
    kern = _sp24_prune_kernel("sp24_compress", w.dtype, w.device.index or 0)
    mask_ptr = 0 if mask is None else mask.view(torch.uint8).data_ptr()
    mode = _MVUE if mvue_seed is not None else _MAGNITUDE if mask is None else _MASKED
    seed = (mvue_seed or 0) % 2**64
    kern.launch((-(-metadata.numel() // kern.threads), 1, 1), (),
                (w.data_ptr(), mask_ptr, values.data_ptr(), metadata.data_ptr(), seed, row_step, col_step),
                (n, k, mode))
    return values, metadata


_EXPAND, _GATHER = 0, 1  # sp24_expand's modes


def sp24_expand(values: torch.Tensor, metadata: torch.Tensor, out_features: int) -> torch.Tensor:
    """The dense [N, K] W of a 16-bit CUDA 2:4 one (zeros where nothing is stored), in one pass."""
    n, k = out_features, 2 * values.shape[1]
    dense = torch.empty(n, k, dtype=values.dtype, device=values.device)
    _launch_expand(dense, _aligned(values), metadata, _EXPAND)
    return dense


def sp24_gather(dense: torch.Tensor, metadata: torch.Tensor) -> torch.Tensor:
    """[N, K/2]: a 16-bit CUDA [N, K] tensor's elements at the positions `metadata` stores
    (the values' gradient from a dense dW), in one pass."""
    dense = _aligned(dense)
    values = torch.empty(dense.shape[0], dense.shape[1] // 2, dtype=dense.dtype, device=dense.device)
    _launch_expand(dense, values, metadata, _GATHER)
    return values


def _launch_expand(dense: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, mode: int) -> None:
    if values.numel() == 0:
        return
    kern = _sp24_prune_kernel("sp24_expand", values.dtype, values.device.index or 0)
    kern.launch((-(-metadata.numel() // kern.threads), 1, 1), (),
                (dense.data_ptr(), values.data_ptr(), metadata.data_ptr()), (*dense.shape, mode))


def sp24_transposable_mask(w: torch.Tensor, out: torch.Tensor | None = None, step: torch.Tensor | None = None,
                           interval: int = 1) -> torch.Tensor:
    """The transposable 2:4 mask (bool, w's shape) of a 16-bit CUDA weight, on the GPU: what
    layouts.semi24.transposable_mask computes. With `step` (an int64 scalar on w's device)
    the kernel writes `out` only when the step is a positive multiple of `interval`, decided
    on the device (no host sync, and a CUDA graph keeps the schedule)."""
    w, (n, k) = _aligned(w), w.shape
    mask = torch.empty(n, k, dtype=torch.bool, device=w.device) if out is None else out
    tiles = (n // 4) * (k // 4)
    if tiles == 0:
        return mask
    kern = _sp24_prune_kernel("sp24_mask", w.dtype, w.device.index or 0)
    kern.launch((-(-tiles // kern.threads), 1, 1), (),
                (w.data_ptr(), mask.data_ptr(), 0 if step is None else step.data_ptr()), (n, k, interval))
    return mask
