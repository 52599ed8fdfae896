"""Tensor parallelism for sparsegen's layers through PyTorch's own API: ColwiseParallel and
RowwiseParallel as torch.distributed.tensor.parallel has them, which also take every layer
that lends its parts (layer.py's contract): Sparse24Linear, ScaledSparse24Linear,
Int4Sparse24Linear and BlockSparseLinear (fused gated ones included), BlockEllLinear column-wise:

    parallelize_module(model, mesh, {"model.layers.*.mlp.gate_up": sparsegen.parallel.ColwiseParallel(),
                                     "model.layers.*.mlp.down_proj": sparsegen.parallel.RowwiseParallel()})

A column-wise layer keeps whole output rows on each rank (2:4 metadata and block rows with
them; a gated layer whole gate/up pairs) and returns its share of the features; a row-wise
layer keeps whole 2:4 groups and whole blocks of its input columns and sums the ranks'
partial products (the bias lives on the first rank, so it is added once); a layer whose
split would break its layout (block-ELL row-wise) refuses it. These are the
layouts torch's styles give nn.Linear by default (input Replicate / output Shard(-1)
column-wise, input Shard(-1) / output Replicate row-wise) with plain tensors in and out, and
sequence parallelism's: input_layouts=Shard(1) column-wise (the sequence's shards gathered
whole, the gradient reduce-scattered back) and output_layouts=Shard(1) row-wise (the sum
reduce-scattered along the sequence); nn.Linear modules get torch's own behaviour. A sparse
layer's parameters become its rank's part as plain tensors, which each rank's optimizer
steps; a 2:4 part's state_dict shows the whole layer as DTensors (so
torch.distributed.checkpoint saves and reshards it), a block-sparse part's is refused.

Data parallelism: data_parallel(model) is DistributedDataParallel with the buffers synced once,
as it wraps the model, not before every forward (sync_buffers does that sync alone).
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel as _TorchColwise
from torch.distributed.tensor.parallel import RowwiseParallel as _TorchRowwise

from .errors import InputError, expect
from .jit import epilogues



def splittable(module: nn.Module) -> bool:
    """A layer that lends its parts (layer.py's tensor-parallel contract)."""
    return callable(getattr(module, "tp_part", None)) and callable(getattr(module, "tp_granules", None))


class ColwiseParallel(_TorchColwise):
    """torch's ColwiseParallel; a sparsegen layer keeps its rank's output rows."""

    def _apply(self, module: nn.Module, device_mesh):
        if not splittable(module):
            return super()._apply(module, device_mesh)
        sequence = _layouts(self, (Replicate(), _SEQUENCE), Shard(-1), "ColwiseParallel", "input_layouts")
        group, rank, ranks = _group_of(device_mesh)
        rows = _share(module.out_features, ranks, rank, _row_granule(module), "out_features")
        _become(module, _part(module, rows, slice(None), keep_bias=True))
        gather, layout = (_GatheredAlong, _SEQUENCE) if sequence else (_GradientSummed, Replicate())
        module.register_forward_pre_hook(lambda _, args: (gather.apply(_local(args[0], layout), group), *args[1:]))
        _save_as_whole(module, device_mesh, dim=0)
        return module


class RowwiseParallel(_TorchRowwise):
    """torch's RowwiseParallel; a sparsegen layer keeps its rank's input columns and sums."""

    def _apply(self, module: nn.Module, device_mesh):
        if not splittable(module):
            return super()._apply(module, device_mesh)
        sequence = _layouts(self, (Shard(-1),), (Replicate(), _SEQUENCE), "RowwiseParallel", "output_layouts")
        expect(getattr(module, "epilogue", "none") == "none", "a row-wise layer without a fused epilogue (it "
               "applies to the sum over ranks)", getattr(module, "epilogue", None))
        group, rank, ranks = _group_of(device_mesh)
        columns = _share(module.in_features, ranks, rank, _column_granule(module), "in_features")
        # the bias stays with the first rank alone: the sum over ranks adds it once
        _become(module, _part(module, slice(None), columns, keep_bias=rank == 0))
        summed = _ScatteredAlong if sequence else _SummedOverRanks  # (each rank's share of the sequence, or all)
        module.register_forward_hook(lambda _, args, y: summed.apply(y, group))
        _save_as_whole(module, device_mesh, dim=1)
        return module


# Sequence parallelism's layout of the activations between the layers: [batch, sequence, ...]
# split along the sequence (torch's SequenceParallel and the styles' Shard(1)).
_SEQUENCE = Shard(1)


def _layouts(style, inputs: tuple, outputs, name: str, sequence_side: str) -> bool:
    """Check a style's layouts for a sparsegen layer: torch's defaults, or Shard(1) (sequence
    parallelism) on `sequence_side`; plain tensors out. True where the sequence is split."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    got_in, got_out = tuple(style.input_layouts), tuple(style.output_layouts)
    expect(len(got_in) == len(got_out) == 1 and got_in[0] in inputs and got_out[0] in outputs
           and style.use_local_output,
           f"{name}() with input_layouts among {list(inputs)} and output_layouts among {list(outputs)} "
           "(use_local_output=True) for a sparsegen layer", f"{list(got_in)} and {list(got_out)}", InputError)
    return (got_in if sequence_side == "input_layouts" else got_out)[0] == _SEQUENCE


def _local(x: torch.Tensor, layout) -> torch.Tensor:
    """A layer's input as this rank's plain tensor (a SequenceParallel norm hands on a DTensor,
    which must be laid out as the style's input_layouts say)."""
    if not isinstance(x, DTensor):
        return x
    expect(tuple(x.placements) == (layout,), f"an input DTensor placed as {layout}", tuple(x.placements))
    return x.to_local()


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
    granule = module.tp_granules()[0]
    if epilogues.is_gated(getattr(module, "epilogue", "none")):
        granule = max(granule, 2 * epilogues.GATE_GROUP)
    return granule


def _column_granule(module) -> int:
    return module.tp_granules()[1]


def _part(module, rows: slice, columns: slice, keep_bias: bool) -> nn.Module:
    """A layer of the same kind holding `module`'s weight rows and columns (exactly: the
    stored positions are kept, not chosen again), its bias rows where kept."""
    return module.tp_part(rows, columns, keep_bias)


def _become(module: nn.Module, part: nn.Module) -> None:
    """`module` (the object its parent holds) takes `part`'s parameters, buffers and sizes."""
    hooks = {name: value for name, value in vars(module).items() if name.endswith("hooks") or "hooks_" in name}
    vars(module).update({name: value for name, value in vars(part).items() if name not in hooks})


def _save_as_whole(module, device_mesh, dim: int) -> None:
    """A part's state_dict holds DTensors of the whole layer's shapes (so
    torch.distributed.checkpoint saves every rank's part and loads them on any split, or
    none), and load_state_dict takes them back as this rank's part: the entries the layer's
    TP_SHARDED names. A part whose share no DTensor describes (a block-sparse one: no
    TP_SHARDED) has its state_dict refused, by name, rather than let a checkpoint keep one
    rank's part under the whole layer's names."""
    names = getattr(module, "TP_SHARDED", {}).get(dim)
    if names is None:
        module._register_state_dict_hook(_refused)
        return

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
                     f"tensor-parallel {type(module).__name__} part, whose share of the blocks no DTensor describes: "
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


class _GatheredAlong(torch.autograd.Function):
    """X's sequence shards gathered whole; the gradient summed over the ranks and split
    along the sequence again (one reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return funcol.wait_tensor(funcol.all_gather_tensor(_by_sequence(x, 1), _SEQUENCE.dim, group))

    @staticmethod
    def backward(ctx, dx):
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(dx.contiguous(), "sum", _SEQUENCE.dim, ctx.group)), None


class _ScatteredAlong(torch.autograd.Function):
    """The ranks' partial products summed, each rank keeping its share of the sequence (one
    reduce-scatter); the gradient gathered whole."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        shares = dist.get_world_size(group)
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(_by_sequence(y, shares), "sum", _SEQUENCE.dim, group))

    @staticmethod
    def backward(ctx, dy):
        return funcol.wait_tensor(funcol.all_gather_tensor(dy.contiguous(), _SEQUENCE.dim, ctx.group)), None


def _by_sequence(t: torch.Tensor, shares: int) -> torch.Tensor:
    """t, checked to be [batch, sequence, features] with a sequence of `shares` equal parts."""
    expect(t.dim() >= 3 and t.shape[1] % shares == 0, "activations [batch, sequence, features] whose sequence "
           f"splits in {shares} equal shares (sequence parallelism)", tuple(t.shape))
    return t.contiguous()


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(t.contiguous(), "sum", group))


# ---- data parallelism ------------------------------------------------------------------------
# DistributedDataParallel's default broadcasts every buffer from rank 0 before each forward.
# sparsegen's buffers (layouts, 2:4 metadata, training masks and their step counters) need it
# only once: the layouts never change, and a mask refresh reads weights that DDP keeps equal,
# by a kernel that gives every rank the same mask. The transposable 2:4 training layers of a
# Llama-1B-shaped model broadcast 138 MB of masks per step (0.69x of dense DDP there, 0.84x
# without; 2 H100s, eager).

def data_parallel(model: nn.Module, **ddp_options) -> nn.Module:
    """DistributedDataParallel(model, **ddp_options) with every buffer synced from the process
    group's first rank once, as it is made, and never before a forward: for models whose
    buffers stay equal across ranks by themselves (sparsegen's layers; not BatchNorm's
    running statistics, which each rank updates from its own batch)."""
    from torch.nn.parallel import DistributedDataParallel

    for option in ("broadcast_buffers", "forward_sync_buffers"):
        expect(option not in ddp_options, f"no {option} (data_parallel syncs buffers once, as it wraps the model)",
               f"{option}={ddp_options.get(option)!r}")
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return DistributedDataParallel(model, forward_sync_buffers=False, **ddp_options)
    # (an older torch: broadcast_buffers=False also skips the sync at construction)
    sync_buffers(model, ddp_options.get("process_group"))
    return DistributedDataParallel(model, broadcast_buffers=False, **ddp_options)


@torch.no_grad()
def sync_buffers(model: nn.Module, group=None) -> None:
    """Every buffer of `model` as the group's first rank holds it, on every rank of `group`
    (default: the world): its bytes broadcast into a copy (gloo moves no float8, bytes it
    does), then copied in, which moves the buffer's version - a collective writing into a
    tensor leaves it, and the layers rebuild what they derived from an index when it moves."""
    expect(dist.is_available() and dist.is_initialized(), "an initialized process group "
           "(torch.distributed.init_process_group) to sync buffers over", "none")
    first = 0 if group is None else dist.get_global_rank(group, 0)  # (torch before 2.6 has no group_src)
    for buffer in model.buffers():
        received = buffer.contiguous().clone()
        dist.broadcast(received.reshape(-1).view(torch.uint8), src=first, group=group)
        buffer.copy_(received)
