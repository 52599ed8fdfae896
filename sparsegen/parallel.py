"""Tensor parallelism for sparsegen's layers through PyTorch's own API: ColwiseParallel and
RowwiseParallel as torch.distributed.tensor.parallel has them, which also take
Sparse24Linear, ScaledSparse24Linear and BlockSparseLinear (fused gated ones included):

    parallelize_module(model, mesh, {"model.layers.*.mlp.gate_up": sparsegen.parallel.ColwiseParallel(),
                                     "model.layers.*.mlp.down_proj": sparsegen.parallel.RowwiseParallel()})

A column-wise layer keeps whole output rows on each rank (2:4 metadata and block rows with
them; a gated layer whole gate/up pairs) and returns its share of the features; a row-wise
layer keeps whole 2:4 groups and whole blocks of its input columns and sums the ranks'
partial products (the bias lives on the first rank, so it is added once). These are the
layouts torch's styles give nn.Linear by default (input Replicate / output Shard(-1)
column-wise, input Shard(-1) / output Replicate row-wise) with plain tensors in and out;
nn.Linear modules get torch's own behaviour. A sparse layer's parameters become its rank's
part as plain tensors, which each rank's optimizer steps; a 2:4 part's state_dict shows
the whole layer as DTensors (so torch.distributed.checkpoint saves and reshards it), a
block-sparse part's is refused.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel as _TorchColwise
from torch.distributed.tensor.parallel import RowwiseParallel as _TorchRowwise

from .bsr.nn import BlockSparseLinear
from .errors import InputError, expect
from .jit import epilogues
from .semi24 import format as semi24
from .semi24.nn import Sparse24Linear
from .semi24.scaled import ScaledSparse24Linear

SPLITTABLE = (Sparse24Linear, BlockSparseLinear, ScaledSparse24Linear)
_GROUP_COLUMNS = 64  # a row-wise 2:4 split keeps whole 4-groups, at the kernels' K granule


class ColwiseParallel(_TorchColwise):
    """torch's ColwiseParallel; a sparsegen layer keeps its rank's output rows."""

    def _apply(self, module: nn.Module, device_mesh):
        if not isinstance(module, SPLITTABLE):
            return super()._apply(module, device_mesh)
        _expect_default_layouts(self, Replicate(), Shard(-1), "ColwiseParallel")
        group, rank, ranks = _group_of(device_mesh)
        rows = _share(module.out_features, ranks, rank, _row_granule(module), "out_features")
        _become(module, _part(module, rows, slice(None), keep_bias=True))
        module.register_forward_pre_hook(lambda _, args: (_GradientSummed.apply(args[0], group), *args[1:]))
        _save_as_whole(module, device_mesh, dim=0)
        return module


class RowwiseParallel(_TorchRowwise):
    """torch's RowwiseParallel; a sparsegen layer keeps its rank's input columns and sums."""

    def _apply(self, module: nn.Module, device_mesh):
        if not isinstance(module, SPLITTABLE):
            return super()._apply(module, device_mesh)
        _expect_default_layouts(self, Shard(-1), Replicate(), "RowwiseParallel")
        expect(getattr(module, "epilogue", "none") == "none", "a row-wise layer without a fused epilogue (it "
               "applies to the sum over ranks)", getattr(module, "epilogue", None))
        group, rank, ranks = _group_of(device_mesh)
        columns = _share(module.in_features, ranks, rank, _column_granule(module), "in_features")
        # the bias stays with the first rank alone: the sum over ranks adds it once
        _become(module, _part(module, slice(None), columns, keep_bias=rank == 0))
        module.register_forward_hook(lambda _, args, y: _SummedOverRanks.apply(y, group))
        _save_as_whole(module, device_mesh, dim=1)
        return module


def _expect_default_layouts(style, inputs, outputs, name: str) -> None:
    expect(tuple(style.input_layouts) == (inputs,) and tuple(style.output_layouts) == (outputs,)
           and style.use_local_output,
           f"{name}() with its default layouts for a sparsegen layer", "other input/output layouts", InputError)


def _group_of(device_mesh):
    expect(device_mesh.ndim == 1, "a 1-D device mesh for tensor parallelism", f"{device_mesh.ndim} dimensions")
    group = device_mesh.get_group()
    return group, dist.get_rank(group), dist.get_world_size(group)


def _share(total: int, ranks: int, rank: int, granule: int, what: str) -> slice:
    expect(total % (ranks * granule) == 0, f"{what} a multiple of {ranks} ranks x {granule} (whole blocks, "
           "2:4 groups or gate/up pairs per rank)", total)
    size = total // ranks
    return slice(rank * size, (rank + 1) * size)


def _row_granule(module) -> int:
    granule = module.block[0] if isinstance(module, BlockSparseLinear) else 16
    if epilogues.is_gated(getattr(module, "epilogue", "none")):
        granule = max(granule, 2 * epilogues.GATE_GROUP)
    return granule


def _column_granule(module) -> int:
    if isinstance(module, ScaledSparse24Linear):
        return semi24.BYTE_COL_GRANULE
    return module.block[1] if isinstance(module, BlockSparseLinear) else _GROUP_COLUMNS


def _part(module, rows: slice, columns: slice, keep_bias: bool) -> nn.Module:
    """A layer of the same kind holding `module`'s weight rows and columns (exactly: the
    stored positions are kept, not chosen again), its bias rows where kept."""
    if isinstance(module, ScaledSparse24Linear):
        return _scaled_part(module, rows, columns, keep_bias)
    weight = module.to_dense_weight().detach()[rows, columns]
    dense = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        dense.weight.copy_(weight)
    if isinstance(module, BlockSparseLinear):
        layout = module.layout[_divided(rows, module.block[0]), _divided(columns, module.block[1])]
        part = BlockSparseLinear.from_dense(dense, block=module.block, layout=layout)
    else:
        part = Sparse24Linear.from_dense(dense, mask=module.mask[rows, columns])
    part.bias = nn.Parameter(module.bias.detach()[rows].clone()) if keep_bias and module.bias is not None else None
    part.epilogue = getattr(module, "epilogue", "none")
    return part.train(module.training)


def _scaled_part(module: ScaledSparse24Linear, rows: slice, columns: slice, keep_bias: bool) -> nn.Module:
    """The one-byte layer's part as stored: its bytes, kept positions and channel scales
    (a column slice of whole 4-groups keeps each row's scale: the ranks' partial products
    are scaled alike, and each quantizes its own activation columns per token)."""
    n, k = module.out_features, module.in_features
    positions = semi24.stored_positions(module.metadata, n, k)[rows, _divided(columns, 4)]  # (per 4-group)
    bias = module.bias.detach()[rows] if keep_bias and module.bias is not None else None
    values = module.values[rows, _divided(columns, 2)].contiguous()  # (two kept per 4-group)
    part = ScaledSparse24Linear(values, semi24.pack_metadata(positions.contiguous()),
                                module.weight_scale[rows], bias, module.input_scale)
    part.epilogue = module.epilogue
    return part.train(module.training)


def _divided(cut: slice, by: int) -> slice:
    """The slice of whole units of `by` that `cut` (a slice of whole units) covers."""
    return slice(None if cut.start is None else cut.start // by, None if cut.stop is None else cut.stop // by)


def _become(module: nn.Module, part: nn.Module) -> None:
    """`module` (the object its parent holds) takes `part`'s parameters, buffers and sizes."""
    hooks = {name: value for name, value in vars(module).items() if name.endswith("hooks") or "hooks_" in name}
    vars(module).update({name: value for name, value in vars(part).items() if name not in hooks})


# What a column-wise (dim 0) or row-wise (dim 1) part of a 2:4 layer holds of the whole
# layer's tensors: 2:4 metadata is laid out in tiles of 16 rows x 32 columns, so a part's is
# the whole's rows or columns of tiles. (A row-wise part's bias sits on the first rank alone,
# its scales are the whole's.)
_SHARDS = {0: ("values", "metadata", "bias", "weight_scale"), 1: ("values", "metadata")}


def _save_as_whole(module, device_mesh, dim: int) -> None:
    """A part's state_dict holds DTensors of the whole layer's shapes (so
    torch.distributed.checkpoint saves every rank's part and loads them on any split, or
    none), and load_state_dict takes them back as this rank's part. A block-sparse part holds
    a share of the blocks no DTensor describes: its state_dict is refused (by name) rather
    than let a checkpoint keep one rank's part under the whole layer's names."""
    if isinstance(module, BlockSparseLinear):
        module._register_state_dict_hook(_refused)
        return
    names = _SHARDS[dim]

    def whole(_, state, prefix, *rest):
        for name in names:
            t = state.get(prefix + name)
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                state[prefix + name] = DTensor.from_local(t, device_mesh, [Shard(dim)], run_check=False)

    def part(state, prefix):
        for name in names:
            t = state.get(prefix + name)
            if isinstance(t, DTensor):
                state[prefix + name] = t.redistribute(device_mesh, [Shard(dim)]).to_local()
    module._register_state_dict_hook(whole)
    module._load_adapters = [part]


def _refused(module, state, prefix, *rest):
    raise InputError(f"Expected a state_dict whose entries describe whole layers. Got {prefix or 'a '}"
                     "tensor-parallel BlockSparseLinear part, whose share of the blocks no DTensor describes: "
                     "save the model before parallelize_module (or each rank's part by its own name)")


# The sums go through functional collectives: torch.compile traces those (an in-place
# dist.all_reduce inside an autograd.Function was dropped from the compiled graph: 2 H100s,
# logits off by 0.17-0.69 where eager mode matched its one-GPU twin).
class _GradientSummed(torch.autograd.Function):
    """X as it is; its gradient summed over the ranks (each rank's rows give a part of dX)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return _summed(dx, ctx.group), None


class _SummedOverRanks(torch.autograd.Function):
    """The ranks' partial products summed; the gradient reaches each as it is."""

    @staticmethod
    def forward(ctx, y, group):
        return _summed(y, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(t.contiguous(), "sum", group))
