"""Ops over block-CSR weights: the CPU reference, the GPU launches (forward, dX on W^T, the
sampled dW, the dense copy of W) and the custom ops torch.compile traces."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..launch import calls, dense_path, library, plans, runtime
from ..jit import epilogues
from ..errors import expect
from ..jit.spec import TMA_INSTRS
from . import dispatch, specs
from . import format as bsr

def indexed_reference(x, values, bias, flat_index, block, out_features: int, epilogue: str = "none"):
    """Pure PyTorch (the CPU path): rebuild the dense weight from the block index and call
    F.linear (then the epilogue). Static shapes, so it traces; differentiable as it is."""
    weight = bsr.scatter_blocks(values, flat_index, (out_features, x.shape[-1]), block)
    return epilogues.reference(F.linear(x, weight, bias), epilogue)


def bsr_dds_any_device(x, values, bias, row_offsets, col_indices, flat_index, block, out_features,
                       epilogue: str = "none"):
    if x.is_cuda and calls.has_kernels(x.device.index or 0):
        return bsr_dds(x, values, row_offsets, col_indices, bias, block, out_features, epilogue=epilogue)
    return indexed_reference(x, values, bias, flat_index, block, out_features, epilogue)


def input_grad(dy, values, perm, row_offsets, col_indices, flat_index, block, out_features, tile=None, instr=None):
    """dX = dY W for W's stored blocks `values`, given W^T's index (block: W^T's block; its
    block b is values[perm[b]] transposed). Where a kernel reads the stored blocks
    transposed (input_grad_spec) no transposed copy of the values is made."""
    if tile or instr or dispatch.input_grad_kernel(dy, block) is not None:
        return bsr_dds(dy, values, row_offsets, col_indices, None, block, out_features, tile=tile, instr=instr,
                       perm=perm)
    return bsr_dds_any_device(dy, bsr.transpose_values(values, perm), None, row_offsets, col_indices, flat_index,
                              block, out_features)


def _input_grad_impl(dy, values, perm, row_offsets, col_indices, flat_index, block_rows, block_cols, out_features):
    return input_grad(dy, values, perm, row_offsets, col_indices, flat_index, (block_rows, block_cols), out_features)


input_grad_op = library.define(
    "bsr_input_grad(Tensor dy, Tensor values, Tensor perm, Tensor row_offsets, Tensor col_indices, "
    "Tensor flat_index, int block_rows, int block_cols, int out_features) -> Tensor",
    _input_grad_impl, lambda dy, *index_and_sizes: library.rows_by(dy, index_and_sizes[-1]))


def _bsr_dds_impl(x, values, bias, row_offsets, col_indices, flat_index, block_rows, block_cols, out_features,
                  epilogue="none"):
    return bsr_dds_any_device(x, values, bias, row_offsets, col_indices, flat_index, (block_rows, block_cols),
                              out_features, epilogue)


bsr_dds_op = calls.define_product("bsr_dds", _bsr_dds_impl)


def bsr_dds(x, values, row_offsets, col_indices, bias, block, out_features, out=None, tile=None,
            instr=None, perm=None, epilogue="none", acc="f32"):
    """Y = X W^T (+ bias) on the GPU with a generated kernel; x may have leading batch dims.
    `out` (contiguous, [..., width]) receives Y when given; `tile` overrides the default
    TileConfig, `instr` the kernel family (spec.INSTRS) and `acc` the accumulator (spec.ACCS:
    "f16" for fp16 inputs, on the mma.sync kernel) - each runs that kernel, never the dense
    path. With `perm`, W^T's block b is values[perm[b]] transposed (input_grad). `epilogue`
    (epilogues.EPILOGUES) is applied in the kernel's store; a gated one makes Y out_features / 2 wide."""
    x2 = calls.rows_2d(x)
    m, k = x2.shape
    if m == 0 or values.shape[0] == 0:  # no block at all (and TMA cannot describe an empty tensor)
        return calls.product_without_weight(x, x2, bias, out, out_features, epilogue)
    if calls.kernel_left_to_dispatch(tile, instr, acc):
        plan = _kept_bsr_plan(x2, values, row_offsets, col_indices, perm, block, out_features, epilogue)
    else:
        plan = _bsr_plan(x2, values, row_offsets, col_indices, perm, block, out_features, tile, instr, epilogue,
                         acc)
    if plan.dense:
        weight = _dense_forward_weight(x2, values, row_offsets, col_indices, block, out_features,
                                       plan.scatter_when_trained)
        if weight is not None and calls.dense_now(plan):
            return calls.dense_result(x, x2, weight, bias, out, epilogue)
    y, shaped = calls.output_for(x, x2, out, plan.width)
    plan.run(x2, values, bias, y)
    return shaped


def bsr_lean_plan(x, values, row_offsets, col_indices, block, out_features: int, epilogue: str = "none"):
    """The plan that repeated inference calls of x's signature run straight (plan.run, on
    inputs that passed calls.check_inputs; lean.py); None where every such call must take bsr_dds:
    off the GPU, an empty product, the dense path outside graphs, a CUDA graph capture."""
    if not (x.is_cuda and calls.has_kernels(x.device.index or 0) and x.numel() and values.shape[0]):
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    x2 = calls.rows_2d(x)
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
    dense_eager: bool = False       # and outside them (not host-bound: calls.dense_outside_graphs)
    scatter_when_trained: bool = False  # and on a weight scattered per call once W is trained

    def run(self, x2: torch.Tensor, values: torch.Tensor, bias, y: torch.Tensor) -> None:
        """Launch on these operands (of the plan's signature; Y contiguous, 16-byte aligned)."""
        plans.run_product(self.launch, x2, values, bias, y)

    def run_at(self, x_address: int, values_address: int, bias, y_address: int) -> None:
        """run, given X's, W's and Y's addresses (a compiled graph's launcher has read them)."""
        plans.run_product_at(self.launch, x_address, values_address, bias, y_address)


_PLANS = plans.PlanCache()


def _bsr_plan(x2, values, row_offsets, col_indices, perm, block, out_features, tile=None, instr=None,
              epilogue="none", acc="f32"):
    """What bsr_dds launches for these operands: the kernel, its grid and index, and whether
    cuBLAS on a dense weight comes first (forward calls with default kernels only)."""
    (m, k), device_index = x2.shape, x2.device.index or 0
    if perm is None:
        kern = dispatch.forward_kernel(tuple(block), x2.dtype, device_index, m <= 64, tile, instr, epilogue, acc)
    else:
        expect(epilogue == "none" and acc == "f32", "no epilogue and acc 'f32' for the product with W^T",
               f"{epilogue!r}, {acc!r}")
        kern = dispatch.transposed_kernel(tuple(block), x2.dtype, device_index, m <= 64, tile, instr)
    dense = scatter = False
    if calls.kernel_left_to_dispatch(tile, instr, acc):
        kern = dispatch.swap_variant(kern, x2.dtype, m, row_offsets, col_indices, perm)
        if perm is None:
            grid_blocks = (out_features // block[0]) * (k // block[1])
            scatter = dispatch.dense_pays(block, values.shape[0], m, k, out_features)
            dense = scatter or dense_path.wanted("bsr", device_index, out_features, k, m, tuple(block),
                                                 values.shape[0] / max(grid_blocks, 1))
    index = _kernel_index(kern.spec, row_offsets, col_indices, perm)
    # keep holds no row_offsets: the plan cache keys plans by it, weakly (plans.PlanCache)
    return _BsrPlan(kern, _bsr_launch(kern, x2, values, block, out_features, index),
                    tuple(t for t in index if t is not None and t is not row_offsets),
                    epilogues.output_features(epilogue, out_features), dense,
                    dense and (scatter or calls.dense_outside_graphs(m, k, out_features)), scatter)


def _bsr_launch(kern, x2, values, block, out_features: int, index: tuple) -> runtime.PackedLaunch:
    """The packed launch of a block-sparse product: X and W as TMA maps or the first two
    pointers (bound per call), the index, then bias and Y (written per call)."""
    (m, k), maps = x2.shape, _operand_maps(kern.spec, x2, values, block)
    pointers = (0,) * (2 - len(maps)) + tuple(t.data_ptr() if t is not None else 0 for t in index) + (0, 0)
    return runtime.PackedLaunch(kern, _grid(kern, m, out_features), maps, pointers,
                                (m, k, out_features) + _tma_tail(kern.spec, values))


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
    slot = calls.per_layout("block slots", row_offsets, bsr.block_slots, row_offsets, col_indices, k // bk)
    kern = dispatch.scatter_kernel((bm, bk), values.dtype, values.device.index or 0)
    values = values.contiguous() if values.data_ptr() % 16 == 0 else values.clone()  # read 16 bytes at a time
    dense = values.new_empty(n, k)
    chunks = -(-bm * k * values.element_size() // 16 // kern.threads)
    kern.launch(((n // bm) * chunks, 1, 1), (), (values.data_ptr(), slot.data_ptr(), dense.data_ptr()), (k, chunks))
    return dense


def _kernel_index(spec, row_offsets, col_indices, perm) -> tuple:
    """The index tensors a kernel takes: W's block CSR, and perm for swap (None: none); pairs
    take the union columns of pairs of block rows, each row's block there and the pairs'
    rows instead."""
    if spec.instr == "pairs":
        return tuple(dispatch.pair_index(row_offsets, col_indices, perm))
    return (row_offsets, col_indices, perm) if spec.instr == "swap" else (row_offsets, col_indices)


def _grid(kern, m: int, n: int) -> tuple[int, int, int]:
    spec, cluster = kern.spec, kern.spec.tile.cluster
    rows = 128 if spec.instr == "pairs" else spec.block[0]  # pairs: two block rows a tile
    tiles = (-(-n // rows), -(-m // spec.tile.tile_m))
    if cluster > 1:  # persistent clusters, each taking `cluster` neighbouring token tiles of one tile row
        groups = tiles[0] * -(-tiles[1] // cluster)
        return (cluster * min(groups, runtime.persistent_blocks(kern.resident_blocks) // cluster), 1, 1)
    if spec.instr in TMA_INSTRS:  # persistent: one block per SM walks the tiles
        return (min(tiles[0] * tiles[1], runtime.persistent_blocks(runtime.sm_count(kern.device_index))), 1, 1)
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


def weight_grad(dy2: torch.Tensor, x2: torch.Tensor, flat_index: torch.Tensor, block) -> torch.Tensor:
    """dW at the stored blocks: dY^T X sampled there. [M, N] and [M, K] -> [nnz, bm, bk].
    16-bit GPU tensors at densities up to dispatch.SDD_MAX_DENSITY run the generated sdd kernel;
    the rest a dense GEMM (cuBLAS) and a gather, which is faster there."""
    blocks = (dy2.shape[1] // block[0]) * (x2.shape[1] // block[1])
    if not (calls.runs_16bit_kernels(dy2) and flat_index.numel() <= dispatch.sdd_max_density(dy2, block) * blocks):
        return bsr.gather_blocks(dy2.t() @ x2, flat_index, block)
    dy2, x2 = dy2.contiguous(), x2.contiguous()
    dw = torch.empty(flat_index.numel(), *block, dtype=dy2.dtype, device=dy2.device)
    if flat_index.numel() == 0 or dy2.shape[0] == 0:
        return dw.zero_()
    return sdd_into(dw, dy2, x2, flat_index.contiguous(), tuple(block))


def sdd_into(dw, dy2, x2, flat_index, block, kern=None) -> torch.Tensor:
    """Run the generated sdd kernel (or `kern`, a tile being tried) for these contiguous,
    16-bit CUDA operands into dw."""
    kern = kern or dispatch.sdd_kernel_for(dy2, flat_index, block)
    if kern.spec.instr == "tma":
        _launch_sdd_tma(kern, dy2, x2, flat_index, dw, block)
    else:
        kern.launch((flat_index.numel(), 1, 1), (), (dy2.data_ptr(), x2.data_ptr(), flat_index.data_ptr(),
                                                     dw.data_ptr()), (dy2.shape[0], dy2.shape[1], x2.shape[1]))
    return dw


def _launch_sdd_tma(kern, dy2, x2, flat_index, dw, block) -> None:
    """The Hopper sdd kernel: one block per work item (token-major TMA boxes of tile_m x 64)."""
    (m, n), k = dy2.shape, x2.shape[1]
    starts = calls.per_layout("sdd items", flat_index, sdd_item_starts, flat_index, k // block[1], n // block[0],
                         specs.sdd_gather(kern.spec) // block[1])
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


def sampled_weight_grad(dy2, x2, flat_index, block) -> torch.Tensor:
    """dY^T X at the stored blocks flat_index names: the op inside a compiled graph, else
    weight_grad (the kernel, or a dense GEMM and a gather)."""
    if torch.compiler.is_compiling():
        return bsr_sdd_op(dy2, x2, flat_index, *block)
    return weight_grad(dy2, x2, flat_index, block)


# What the layout kit borrows (registry.kit_kernel): every fixed-rows layout's dW, and dX
# where a layout gives no transposed form of its own (input_grad over W^T's block-CSR index).
KIT_KERNELS = {"sampled_weight_grad": sampled_weight_grad, "sampled_input_grad": input_grad}
