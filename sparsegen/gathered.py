"""The layout kit, launch side: a fixed-rows layout's forward product (gathered_specs.py) on
any device, and the nn module its layers share.

FixedRowsProduct is one registered op, called with the arguments its layout declared
(registry.ProductArgs: x, values, bias[, index], *params, out_features, epilogue). On a
covered GPU it launches the generated kernel, planned once per layout and call signature;
elsewhere it runs the layout's PyTorch reference; inside a compiled graph it is the
torch.library op, which Inductor lowers to `into` (inductor.py). No gradient of its own:
FixedRowsLinear's training calls go through _KitLinear (the product forward; dX by the
layout's kernel over W^T where it gives one, else block-CSR's over W^T's index; dW by the
layout's hook or the kit's sampled kernel at the stored blocks), or a layout's own autograd
Function.

Where this GPU's crossover table (crossovers.py, `sparsegen tune`) says the layout's kernel
loses at a call's shape, the call runs cuBLAS on a dense copy of W instead (dense_path.py),
built by the layout's `dense_weight(values, in_features, *the op's arguments after bias, up
to out_features)` - the same rules as block-CSR's and 2:4's.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import torch
from torch import nn

from .launch import calls, dense_path, lean, library, outside_graphs, plans, runtime
from . import checkpoint
from .errors import SpecError, expect
from .jit import epilogues, gathered_specs, registry
from .layer import SparseLinearForward, dense_linear, layer_dtype

# The plans of a layout that computes its columns depend on the call alone: one owner for all.
_NO_INDEX = torch.empty(0)


@functools.lru_cache(maxsize=None)
def forward_kernel(op: str, block: tuple[int, int], dtype: torch.dtype, device_index: int, params: tuple,
                   small: bool, epilogue: str = "none", tile=None, instr=None, acc: str = "f32") -> runtime.Kernel:
    """The kernel of one (op, block, dtype, device, params, small batch, epilogue), loaded once."""
    arch = runtime.device_arch(torch.device("cuda", device_index))
    spec = gathered_specs.forward_spec(op, block, calls.DTYPE_NAMES[dtype], arch, dict(params),
                                       rows=1 if small else None, epilogue=epilogue, tile=tile, instr=instr, acc=acc)
    return runtime.kernel(spec, device_index)


class Call(NamedTuple):
    """The op's arguments after x, values and bias, by meaning."""
    index: torch.Tensor | None
    params: tuple[int, ...]
    out_features: int
    epilogue: str


@dataclasses.dataclass(frozen=True)
class FixedRowsPlan:
    launch: runtime.PackedLaunch    # X and W (pointers or TMA maps), the index (or null), bias, Y
    width: int                      # Y's columns
    dense: bool = False             # cuBLAS on a dense copy of W first (dense_path), in CUDA graphs
    dense_eager: bool = False       # and outside them (not host-bound: calls.dense_outside_graphs)

    def run(self, x2: torch.Tensor, values: torch.Tensor, bias, y: torch.Tensor) -> None:
        plans.run_product(self.launch, x2, values, bias, y)


_PRODUCTS: dict[str, "FixedRowsProduct"] = {}  # by op: what _KitLinear calls, from the name it is given


class FixedRowsProduct:
    """epilogue(X W^T + b) for the registered fixed-rows op `op`; `reference(x, values, bias,
    *rest)` is its PyTorch definition (differentiable, traceable); `dense_weight(values,
    in_features, *the op's arguments after bias, up to out_features)` W as a dense tensor, for
    tiles of any size (the dense path's copy; the training backward runs it over 1 x 1 tiles
    to learn where the blocks sit). Optional, for the training backward: `transposed(values,
    in_features, *the same)` W^T in the layout's own form, (its values, its op's arguments
    after bias up to out_features), so that dX = dY W runs this product's kernel;
    `weight_grad(dy2, x2, values, *the same)` dW at the stored blocks computed the layout's way
    (else the kit's sampled dY^T X kernel)."""

    def __init__(self, op: str, reference: Callable, dense_weight: Callable | None = None,
                 transposed: Callable | None = None, weight_grad: Callable | None = None):
        self.op, self.reference, self.dense_weight = op, reference, dense_weight
        self.transposed, self.weight_grad = transposed, weight_grad
        # (found now: a compiled backward cannot trace the import that finds it)
        self.sampled_weight_grad = None if weight_grad else registry.kit_kernel("sampled_weight_grad")
        self.sampled_input_grad = None if transposed else registry.kit_kernel("sampled_input_grad")
        _PRODUCTS[op] = self
        rules = registry.op_rules(op)
        self.args, self._compiled_in = rules.args, {p.name for p in rules.params}
        self._plans, self._positions, self._transposed = plans.PlanCache(), plans.PlanCache(), plans.PlanCache()
        self.overload = calls.define_product(op, self.any_device)
        self.lowering = registry.Lowering(op, self.into)

    def __call__(self, x, values, bias, *rest):
        """The op while torch.compile traces (the compiled graph calls it), else any_device."""
        product = self.overload if torch.compiler.is_compiling() else self.any_device
        return product(x, values, bias, *rest)

    def any_device(self, x, values, bias, *rest):
        if x.is_cuda and calls.has_kernels(x.device.index or 0):
            return self.gpu(x, values, bias, *rest)
        self._launch_values(self._call(rest))  # (the reference refuses what a launch would)
        return self.reference(x, values, bias, *rest)

    def gpu(self, x, values, bias, *rest, out=None, tile=None, instr=None, acc="f32"):
        """On the GPU; x may have leading batch dims. `out` (contiguous, 16-byte aligned)
        receives Y when given; `tile`, `instr` and `acc` override the default kernel."""
        call, x2 = self._call(rest), calls.rows_2d(x)
        if x2.shape[0] == 0:
            return calls.product_without_weight(x, x2, bias, out, call.out_features, call.epilogue)
        if calls.kernel_left_to_dispatch(tile, instr, acc):
            plan = self._cached_plan(x2, values, call)
        else:
            plan = self._plan(x2, values, call, tile, instr, acc)
        if plan.dense:
            weight = self._dense_copy(x2, values, rest, call)
            if weight is not None and calls.dense_now(plan):
                return calls.dense_result(x, x2, weight, bias, out, call.epilogue)
        y, shaped = calls.output_for(x, x2, out, plan.width)
        plan.run(x2, calls.aligned(values), bias, y)
        return shaped

    def lean_plan(self, x, values, *rest):
        """The plan repeated inference calls of x's signature run straight (lean.py), or None
        where they take the full call: off the GPU, no rows, a CUDA graph capture."""
        if not (x.is_cuda and calls.has_kernels(x.device.index or 0) and x.numel() and calls.tma_ready(values)):
            return None
        if torch.cuda.is_current_stream_capturing():
            return None
        x2, call = calls.rows_2d(x), self._call(rest)
        plan = self._cached_plan(x2, values, call)
        if plan.dense_eager:
            return None
        if plan.dense:  # the copy a CUDA graph capture takes, built now (gpu() builds it on every call)
            self._dense_copy(x2, values, rest, call)
        return plan

    def into(self, x, values, bias, *rest, out):
        """The launcher a compiled graph calls: Y into Inductor's buffer `out`."""
        plan = self.lean_plan(x, values, *rest)
        if plan is not None and lean.runs_into(plan, x, out, x.data_ptr() | out.data_ptr()):
            plan.run(x, values, bias, out)
        else:
            out.copy_(self.overload(x, values, bias, *rest))

    def positions(self, values, in_features: int, rest: tuple) -> torch.Tensor:
        """Where each stored block sits in W's block grid (r * K / bk + c), in values' order:
        kept per index tensor and shape, built outside any CUDA graph's memory pool (the kit's
        gradient ops call this at run time, compiled backwards included)."""
        return self._positions.get(*_kept_by(values, in_features, rest), lambda: outside_graphs.run(
            block_positions, (self.dense_weight, values, in_features, rest), values.device))

    def transposed_index(self, values, in_features: int, rest: tuple) -> tuple:
        """W^T's block-CSR index (transposed_index), kept as positions are: the kernels plan
        once per index tensor, so a kept one is planned once. Built outside any CUDA graph's
        memory pool (outside_graphs: reduce-overhead's warm-up would keep it in the pool)."""
        return self._transposed.get(*_kept_by(values, in_features, rest), lambda: outside_graphs.run(
            self._transposed_index, (values, in_features, rest), values.device))

    def _transposed_index(self, values, in_features: int, rest: tuple) -> tuple:
        positions = self.positions(values, in_features, rest)
        return transposed_index(positions, values.shape[0], in_features // values.shape[3])

    def _call(self, rest: tuple) -> Call:
        index, rest = (rest[0], rest[1:]) if len(self.args.tensors) > 3 else (None, rest)
        count = len(self.args.ints)
        return Call(index, tuple(rest[:count]), rest[count], rest[count + 1] if len(rest) > count + 1 else "none")

    def _dense_copy(self, x2, values, rest: tuple, call: Call) -> torch.Tensor | None:
        """The layer's dense copy of W (None while W is being trained or first seen in a capture)."""
        key = values if call.index is None else call.index
        inputs = rest[:len(self.args.tensors) - 3 + len(self.args.ints) + 1]  # the index, the ints, out_features
        return dense_path.copy_of(key, values, self.dense_weight, values, x2.shape[1], *inputs)

    def _dense_wanted(self, x2, values, call: Call) -> bool:
        """Whether this GPU's crossover table sends calls of this shape to cuBLAS."""
        (m, k), (rows, rowblocks, bm, bk) = x2.shape, values.shape
        return self.dense_weight is not None and dense_path.wanted(
            registry.layout_of(self.op), x2.device.index or 0, rows * bm, k, m, (bm, bk), rowblocks * bk / k)

    def _cached_plan(self, x2, values, call: Call) -> FixedRowsPlan:
        owner = _NO_INDEX if call.index is None else call.index
        signature = (x2.shape[0], x2.dtype, x2.device, tuple(values.shape), call.params, call.out_features,
                     call.epilogue)
        return self._plans.get(owner, signature, lambda: self._default_plan(x2, values, call))

    def _default_plan(self, x2, values, call: Call) -> FixedRowsPlan:
        """The default kernels' plan, and whether cuBLAS on a dense copy comes first."""
        plan, dense = self._plan(x2, values, call), self._dense_wanted(x2, values, call)
        (m, k), width = x2.shape, values.shape[0] * values.shape[2]
        return dataclasses.replace(plan, dense=dense, dense_eager=dense and calls.dense_outside_graphs(m, k, width))

    def likely_specs(self, values, rest: tuple, arch: int) -> list:
        """The kernels a forward with these arguments after bias (op args, out_features,
        epilogue) takes at any token count: the small-batch one and the other (sparsegen.warm
        builds them ahead); none for values of a dtype without kernels."""
        name = calls.DTYPE_NAMES.get(values.dtype)
        if name is None:
            return []
        call = self._call(rest)
        compiled_in, _ = self._split_params(call)
        block = tuple(values.shape[2:])
        return [gathered_specs.forward_spec(self.op, block, name, arch, dict(compiled_in), rows=rows,
                                            epilogue=call.epilogue) for rows in (1, None)]

    def _split_params(self, call: Call) -> tuple[tuple, tuple]:
        """(the parameters compiled into the kernel, as (name, value); the values it takes at launch)."""
        compiled_in = tuple(pair for pair in zip(self.args.ints, call.params) if pair[0] in self._compiled_in)
        return compiled_in, self._launch_values(call)

    def _launch_values(self, call: Call) -> tuple:
        """The run-time parameters (those not compiled in), as positive int32s: they reach the
        kernel unchecked by any spec. Checked on every device alike, so that a layout's CPU
        tests meet what its GPU launch refuses (a band's shift of 0, say)."""
        named = tuple(zip(self.args.ints, call.params))
        at_launch = tuple(value for name, value in named if name not in self._compiled_in)
        expect(all(0 < value < 2 ** 31 for value in at_launch), f"{self.op}'s run-time parameters as positive int32s",
               dict(named))
        return at_launch

    def _plan(self, x2, values, call: Call, tile=None, instr=None, acc="f32") -> FixedRowsPlan:
        (m, k), (rows, rowblocks, bm, bk) = x2.shape, values.shape
        compiled_in, at_launch = self._split_params(call)
        kern = forward_kernel(self.op, (bm, bk), x2.dtype, x2.device.index or 0, compiled_in,
                              m <= gathered_specs.SMALL_ROWS, call.epilogue, tile, instr, acc)
        spec, stored_rows = kern.spec, rows * rowblocks * bm  # W's stored blocks as rows of a [*, bk] matrix
        maps = () if spec.instr == "mma" else (
            (x2.dtype, m, k, spec.tile.tile_m, min(bk, 64)), (values.dtype, stored_rows, bk, bm, min(bk, 64)))
        index_at = 0 if call.index is None else call.index.data_ptr()
        pointers = (0,) * (2 - len(maps)) + (index_at, 0, 0)
        ints = (m, k, rows * bm) + (() if spec.instr == "mma" else (stored_rows,)) + at_launch
        launch = runtime.PackedLaunch(kern, _grid(kern, m, rows), maps, pointers, ints)
        return FixedRowsPlan(launch, epilogues.output_features(call.epilogue, rows * bm))


def _grid(kern, m: int, block_rows: int) -> tuple[int, int, int]:
    tiles = (block_rows, -(-m // kern.spec.tile.tile_m))
    if kern.spec.instr == "mma":
        return (*tiles, 1)
    return (min(tiles[0] * tiles[1], runtime.persistent_blocks(runtime.sm_count(kern.device_index))), 1, 1)  # persistent


class _KitLinear(torch.autograd.Function):
    """X W^T + b for a call that needs gradients: the layout's product forward (the generated
    kernel on the GPU, as inference runs it). The backward, which torch.compile traces with
    the rest: dX = dY W by the product over W^T where the layout gives `transposed` (its
    kernel again), else block-CSR's input-grad kernel over W^T's index (kit_input_grad); dW at
    the stored blocks only, by the layout's `weight_grad` where it has one, else the kit's
    sampled kernel (block-CSR's sdd, lent through registry.kit_kernel) at the places
    block_positions finds, kept per layer (kit_weight_grad)."""

    @staticmethod
    def forward(ctx, x, values, bias, op: str, *rest):
        ctx.save_for_backward(x, values, *[t for t in rest if isinstance(t, torch.Tensor)])
        ctx.op, ctx.has_bias = op, bias is not None
        ctx.rest = tuple(None if isinstance(t, torch.Tensor) else t for t in rest)  # (tensors: saved)
        return _PRODUCTS[op](x, values, bias, *rest, "none")  # (every argument: the op's schema has no defaults)

    @staticmethod
    def backward(ctx, dy):
        x, values, *tensors = ctx.saved_tensors
        rest, need = _with_saved(ctx.rest, tensors), ctx.needs_input_grad
        product, dy2, x2 = _PRODUCTS[ctx.op], dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = _input_grad(product, dy, values, x.shape[-1], rest) if need[0] else None
        dvalues = _values_grad(product, dy2, x2, values, rest) if need[1] else None
        dbias = dy2.sum(0) if ctx.has_bias and need[2] else None
        return (dx, dvalues, dbias, None) + (None,) * len(rest)


def _input_grad(product: "FixedRowsProduct", dy, values, in_features: int, rest: tuple):
    """dX = dY W: the product over the layout's W^T, else the kit's sampled kernel over W^T's
    block-CSR index (kit_input_grad)."""
    if product.transposed is not None:
        values_t, rest_t = product.transposed(values, in_features, *rest)
        return product(dy, values_t, None, *rest_t, "none")
    return kit_input_grad(product.op, dy, values, *_index_and_ints(rest, in_features))


def _kept_by(values, in_features: int, rest: tuple) -> tuple:
    """(owner, signature) under which what the kit derives from a layer's block places is kept:
    its index tensor (the shared no-index owner for a layout without one), and the shapes, the
    index's version and the op's ints."""
    index, ints = _index_and_ints(rest)
    signature = (tuple(values.shape), values.device, in_features, index is not None and index._version, *ints)
    return (_NO_INDEX if index is None else index), signature


def _index_and_ints(rest: tuple, *before_ints) -> tuple:
    """The op's arguments after bias as the kit's gradient ops take them: (index or None,
    *before_ints, [the ints])."""
    index = next((t for t in rest if isinstance(t, torch.Tensor)), None)
    return (index, *before_ints, [r for r in rest if not isinstance(r, torch.Tensor)])


def _kit_input_grad(op: str, dy, values, index, in_features: int, ints: list[int]):
    """dX = dY W by block-CSR's input-grad kernel (registry.kit_kernel) over W^T's index, which
    transposed_index finds from the layout's dense_weight and keeps per index tensor. One op
    to a compiled backward: it plans on the host, so Inductor calls it whole, on the layer's
    own index tensor (found again in the kept plans, step after step)."""
    product, rest = _PRODUCTS[op], ((index,) if index is not None else ()) + tuple(ints)
    (_, _, bm, bk), transposed = values.shape, product.transposed_index(values, in_features, rest)
    return product.sampled_input_grad(dy, values.reshape(-1, bm, bk), *transposed, (bk, bm), in_features)


kit_input_grad = library.eager_or_op(library.define(
    "kit_input_grad(str op, Tensor dy, Tensor values, Tensor? index, int in_features, int[] ints) -> Tensor",
    _kit_input_grad, lambda op, dy, values, index, in_features, ints: library.rows_by(dy, in_features)),
    _kit_input_grad)


def _values_grad(product: "FixedRowsProduct", dy2, x2, values, rest: tuple):
    """dW at the stored blocks, values' shape: the layout's weight_grad, else the kit's sampled
    dY^T X at the blocks' places in the grid."""
    if product.weight_grad is not None:
        return product.weight_grad(dy2, x2, values, *rest)
    return kit_weight_grad(product.op, dy2, x2, values, *_index_and_ints(rest))


def _kit_weight_grad(op: str, dy2, x2, values, index, ints: list[int]):
    """dY^T X at the stored blocks by the kit's sampled kernel, at the places positions()
    keeps: one op to a compiled backward, as kit_input_grad is (no sort of the grid per step)."""
    product, rest = _PRODUCTS[op], ((index,) if index is not None else ()) + tuple(ints)
    positions = product.positions(values, x2.shape[-1], rest)
    return product.sampled_weight_grad(dy2, x2, positions, tuple(values.shape[2:])).reshape(values.shape)


kit_weight_grad = library.eager_or_op(library.define(
    "kit_weight_grad(str op, Tensor dy2, Tensor x2, Tensor values, Tensor? index, int[] ints) -> Tensor",
    _kit_weight_grad, lambda op, dy2, x2, values, index, ints: values.new_empty(values.shape)), _kit_weight_grad)


def block_positions(dense_weight: Callable, values, in_features: int, rest: tuple) -> torch.Tensor:
    """The stored blocks' row-major places in W's block grid, in values' order: the layout's
    dense_weight over 1 x 1 tiles numbered 1, 2, ... puts each number at its block's place,
    and a sort of the grid finds them (static shapes)."""
    rows, rowblocks, bm, bk = values.shape
    count = rows * rowblocks
    numbers = torch.arange(1, count + 1, dtype=torch.float64, device=values.device).reshape(rows, rowblocks, 1, 1)
    grid = dense_weight(numbers, in_features // bk, *rest[:-1], rest[-1] // bm)
    shape = (rest[-1] // bm, in_features // bk)
    expect(tuple(grid.shape) == shape, f"dense_weight over 1 x 1 tiles to give the block grid {shape} (the kit "
           "finds the blocks' places by it: read bm and bk from the values' shape)", tuple(grid.shape), SpecError)
    if not torch.compiler.is_compiling():  # (once per layer shape: one look at the device)
        placed = int(torch.count_nonzero(grid))
        expect(placed == count, f"dense_weight to place each of the {count} blocks once", f"{placed} places", SpecError)
    return torch.argsort(grid.flatten(), stable=True)[-count:]


def transposed_index(positions, rows: int, gridcols: int) -> tuple:
    """W^T's block-CSR index from the stored blocks' places in W's [rows, gridcols] block grid:
    (perm, row_offsets, col_indices, flat_index), W^T's b-th block being values[perm[b]]
    transposed (its rows: W's block columns, each listing W's block rows in order)."""
    r, c = positions // gridcols, positions % gridcols
    key = c * rows + r
    perm = torch.argsort(key)
    counts = torch.bincount(c, minlength=gridcols)
    row_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    return perm, row_offsets, r[perm].to(torch.int32), key[perm]


def _with_saved(rest: tuple, tensors: list) -> tuple:
    """rest with its tensors (None in it) put back, in order, from the saved ones."""
    left = iter(tensors)
    return tuple(next(left) if r is None else r for r in rest)


class FixedRowsLinear(SparseLinearForward, lean.LeanLayer, epilogues.Fusable, checkpoint.CheckedLoad, nn.Module):
    """What a fixed-rows layout's nn.Linear replacement shares. A subclass sets PRODUCT (its
    FixedRowsProduct) and defines `op_args()` (its op's arguments after bias, up to
    out_features) and `to_dense_weight()`. Training runs the product forward and the kit's
    backward (_KitLinear: PRODUCT's hooks, its dense_weight, the sampled dW kernel); a layout
    without dense_weight, or with a backward of its own, overrides
    `_differentiable_product(x, values, bias)`."""

    PRODUCT: FixedRowsProduct

    def _make_parameters(self, block_rows: int, rowblocks: int, bias: bool, factory: dict) -> None:
        """values [block_rows, rowblocks, bm, bk] and bias, initialised as nn.Linear's; factory's
        dtype as every layer takes it (layer_dtype: a torch.dtype or its name; None: torch's default)."""
        factory = dict(factory, dtype=layer_dtype(factory.get("dtype")) or torch.get_default_dtype())
        self.values = nn.Parameter(torch.empty(block_rows, rowblocks, *self.block, **factory))
        self.bias = nn.Parameter(torch.empty(self.out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.values.shape[1] * self.block[1])  # nn.Linear's, on each output's fan-in
        nn.init.uniform_(self.values, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def op_args(self) -> tuple:
        raise NotImplementedError

    def _product(self, x, values, bias) -> torch.Tensor:
        return self.PRODUCT(x, values, bias, *self.op_args(), self.out_features, self.epilogue)

    def likely_specs(self, arch: int, sm_count: int) -> list:
        """The kernels this layer's forward takes (sparsegen.warm builds them ahead when patch
        makes the layer), every layout of the kit's alike."""
        return self.PRODUCT.likely_specs(self.values, (*self.op_args(), self.out_features, self.epilogue), arch)

    def _differentiable_product(self, x, values, bias) -> torch.Tensor:
        """x W^T + b, before the layer's epilogue, with gradients (the kit applies the epilogue)."""
        product = self.PRODUCT
        if product.dense_weight is None:
            return product.reference(x, values, bias, *self.op_args(), self.out_features)
        return _KitLinear.apply(x, values, bias, product.op, *self.op_args(), self.out_features)

    @torch.no_grad()
    def copy_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "FixedRowsLinear":
        """Keep, of a dense [out_features, in_features] weight, the blocks this layer stores (at
        block_positions' places), and the bias where both have one."""
        expect(tuple(weight.shape) == (self.out_features, self.in_features),
               f"a weight of shape {(self.out_features, self.in_features)}", tuple(weight.shape))
        bm, bk = self.values.shape[2:]
        positions = self.PRODUCT.positions(self.values, self.in_features, (*self.op_args(), self.out_features))
        blocks = weight.reshape(self.out_features // bm, bm, -1, bk).transpose(1, 2).reshape(-1, bm, bk)
        self.values.copy_(blocks[positions.to(weight.device)].reshape(self.values.shape))
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)
        return self

    def _lean_call(self, x: torch.Tensor, values: torch.Tensor, bias):
        calls.check_inputs(x, values, bias, self.in_features)
        plan = self.PRODUCT.lean_plan(x, values, *self.op_args(), self.out_features, self.epilogue)
        return None if plan is None else lean.LeanCall(plan, x, values, bias)

    def _after_load(self) -> None:
        self._forget_lean_calls()

    def to_linear(self) -> nn.Module:
        """A dense nn.Linear with this layer's weights (zeros where blocks are absent), then the
        epilogue where one is fused."""
        return self._dense_twin(dense_linear(self.to_dense_weight().detach(), self.bias))

    def extra_repr(self) -> str:
        """What a new layout's layer prints without writing its own: shapes, blocks kept per
        block row, bias, epilogue (a layout may override it to name its own parameters)."""
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={tuple(self.block)}, "
                f"per_row={self.values.shape[1]}, bias={self.bias is not None}{self._epilogue_repr()}")


def face_patch(build: Callable) -> Callable:
    """A registry.Face's `patch` for a kit layout: the layer `build` makes for a linear's shape
    (a rule's settings, but its sparsity, as the arguments given), with the linear's weights at
    the stored blocks (FixedRowsLinear.copy_dense) where from_dense."""
    def patch(linear: nn.Linear, settings: dict, from_dense: bool) -> FixedRowsLinear:
        weight = linear.weight
        given = {key: value for key, value in settings.items() if key != "sparsity"}
        layer = build(linear.in_features, linear.out_features, linear.bias is not None, weight.device, weight.dtype,
                      given)
        return layer.copy_dense(weight, linear.bias) if from_dense else layer
    return patch
