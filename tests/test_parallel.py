"""sparsegen.parallel's parts of a layer, on the CPU in one process: each rank's part holds
exactly its rows or columns of the layer's weight (stored positions, bytes and scales kept),
a gated part keeps whole gate/up pairs, and splits that would cut a block, a 2:4 group or a
pair are refused. (tests/test_distributed.py runs the styles across processes.)"""
import pytest
import torch
from torch import nn

import sparsegen
from sparsegen import parallel
from sparsegen.errors import InputError


def layers():
    torch.manual_seed(0)
    dense = nn.Linear(256, 128)
    return {"2:4": sparsegen.Sparse24Linear.from_dense(dense),
            "block": sparsegen.BlockSparseLinear.from_dense(dense, block=(32, 32), density=0.5),
            "int8": sparsegen.ScaledSparse24Linear.from_dense(dense, "int8"),
            "int4": sparsegen.Int4Sparse24Linear.from_dense(dense, group_size=-1),
            "int4 group 128": sparsegen.Int4Sparse24Linear.from_dense(dense, group_size=128)}


@pytest.mark.parametrize("kind", ["2:4", "block", "int8", "int4"])
@pytest.mark.parametrize("ranks, rank", [(2, 0), (2, 1), (4, 3)])
def test_each_part_holds_exactly_its_rows_and_its_columns(kind, ranks, rank):
    layer = layers()[kind]
    whole = layer.to_dense_weight()
    rows = parallel._share(layer.out_features, ranks, rank, parallel._row_granule(layer), "out_features")
    columns = parallel._share(layer.in_features, ranks, rank, parallel._column_granule(layer), "in_features")
    by_rows = parallel._part(layer, rows, slice(None), keep_bias=True)
    by_columns = parallel._part(layer, slice(None), columns, keep_bias=False)
    assert torch.equal(by_rows.to_dense_weight(), whole[rows])
    assert torch.equal(by_columns.to_dense_weight(), whole[:, columns])
    assert torch.equal(by_rows.bias.detach(), layer.bias.detach()[rows]) and by_columns.bias is None
    x = torch.randn(5, layer.in_features)
    if kind != "int8":  # (one-byte layers quantize their own columns of X per token: tested across ranks)
        summed_parts_match(layer, x, ranks)


def summed_parts_match(layer, x, ranks: int) -> None:
    """The column-wise parts' products summed, plus the bias once, are the layer's product (to
    the rounding of each part's output: bfloat16 for a 4-bit layer)."""
    shares = [parallel._share(layer.in_features, ranks, r, parallel._column_granule(layer), "") for r in range(ranks)]
    parts = [parallel._part(layer, slice(None), share, keep_bias=False) for share in shares]
    summed = sum(p(x[:, share]).float() for share, p in zip(shares, parts))
    tol = 3e-2 if isinstance(layer, sparsegen.Int4Sparse24Linear) else 1e-5
    torch.testing.assert_close(summed + layer.bias.detach().float(), layer(x).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("ranks, rank", [(2, 0), (2, 1)])
def test_a_4_bit_part_keeps_its_values_positions_and_scale_groups(ranks, rank):
    """Group 128: rows keep their scales, columns whole groups of them (a split inside a group
    is refused); every part's weight is the whole's, exactly."""
    layer = layers()["int4 group 128"]
    whole = layer.to_dense_weight()
    rows = parallel._share(128, ranks, rank, parallel._row_granule(layer), "out_features")
    columns = parallel._share(256, ranks, rank, parallel._column_granule(layer), "in_features")
    assert torch.equal(parallel._part(layer, rows, slice(None), keep_bias=True).to_dense_weight(), whole[rows])
    assert torch.equal(parallel._part(layer, slice(None), columns, keep_bias=False).to_dense_weight(), whole[:, columns])
    summed_parts_match(layer, torch.randn(3, 256), ranks)
    with pytest.raises(InputError, match="multiple of 4 ranks x 128"):
        parallel._share(256, 4, 0, parallel._column_granule(layer), "in_features")


@pytest.mark.parametrize("ranks, rank", [(2, 1), (4, 2)])
def test_a_block_ell_part_keeps_its_block_rows_and_refuses_a_row_wise_split(ranks, rank):
    torch.manual_seed(1)
    layer = sparsegen.linear(256, 128, sparsity="block-ell", block=(32, 32), per_row=3)
    rows = parallel._share(128, ranks, rank, parallel._row_granule(layer), "out_features")
    part = parallel._part(layer, rows, slice(None), keep_bias=True)
    assert type(part) is type(layer) and part.per_row == 3
    assert torch.equal(part.to_dense_weight(), layer.to_dense_weight()[rows])
    assert torch.equal(part.bias.detach(), layer.bias.detach()[rows])
    x = torch.randn(5, 256)
    torch.testing.assert_close(part(x), layer(x)[:, rows])
    with pytest.raises(InputError, match="block-ELL layer split column-wise"):
        parallel._part(layer, slice(None), parallel._share(256, ranks, rank, 32, "in_features"), keep_bias=False)


def test_a_gated_part_keeps_whole_gate_up_pairs():
    torch.manual_seed(0)
    gate, up = nn.Linear(64, 128, bias=False), nn.Linear(64, 128, bias=False)
    with torch.no_grad():
        fused = sparsegen.Sparse24Linear.from_dense(_interleaved(gate, up)).fuse("swiglu")
    x = torch.randn(3, 64)
    rows = parallel._share(256, 2, 1, parallel._row_granule(fused), "out_features")
    part = parallel._part(fused, rows, slice(None), keep_bias=True)
    torch.testing.assert_close(part(x), fused(x)[:, 64:], rtol=1e-5, atol=1e-5)


def _interleaved(gate: nn.Linear, up: nn.Linear) -> nn.Linear:
    from sparsegen.jit import epilogues
    pair = nn.Linear(gate.in_features, 2 * gate.out_features, bias=False)
    pair.weight.copy_(epilogues.interleave_rows(gate.weight, up.weight))
    return pair


@pytest.mark.parametrize("total, granule", [(96, 64), (100, 4), (128, 48)])
def test_a_split_that_cuts_a_block_group_or_pair_is_refused(total, granule):
    with pytest.raises(InputError, match="a multiple of 2 ranks"):
        parallel._share(total, 2, 0, granule, "in_features")


def test_layouts_other_than_the_defaults_and_sequence_parallelism_are_refused_by_name():
    """A sparsegen layer takes torch's default layouts or Shard(1) on the sequence side
    (input column-wise, output row-wise); any other is an InputError before anything moves."""
    from torch.distributed.tensor import Replicate, Shard

    col, row = parallel.ColwiseParallel, parallel.RowwiseParallel
    assert not parallel._layouts(col(), (Replicate(), parallel._SEQUENCE), Shard(-1), "C", "input_layouts")
    assert parallel._layouts(col(input_layouts=Shard(1)), (Replicate(), parallel._SEQUENCE), Shard(-1), "C",
                             "input_layouts")
    assert parallel._layouts(row(output_layouts=Shard(1)), (Shard(-1),), (Replicate(), parallel._SEQUENCE), "R",
                             "output_layouts")
    for style, inputs, outputs in [(col(input_layouts=Shard(0)), (Replicate(), Shard(1)), Shard(-1)),
                                   (col(use_local_output=False), (Replicate(),), Shard(-1)),
                                   (row(output_layouts=Shard(0)), (Shard(-1),), (Replicate(), Shard(1)))]:
        with pytest.raises(InputError, match="for a sparsegen layer"):
            parallel._layouts(style, inputs, outputs, "S", "input_layouts")


def test_sequence_shares_must_be_equal():
    with pytest.raises(InputError, match="splits in 4 equal shares"):
        parallel._by_sequence(torch.zeros(2, 6, 8), 4)
    assert parallel._by_sequence(torch.zeros(2, 8, 8), 4).shape == (2, 8, 8)


@pytest.mark.parametrize("option", ["broadcast_buffers", "forward_sync_buffers"])
def test_data_parallel_refuses_a_buffer_option_it_sets_itself(option):
    """data_parallel decides how buffers sync: an option that would say otherwise is refused
    by name (before any process group is needed)."""
    with pytest.raises(InputError, match=f"Expected no {option}.*Got {option}=True"):
        parallel.data_parallel(nn.Linear(4, 4), **{option: True})


def test_sync_buffers_without_a_process_group_says_so():
    assert not torch.distributed.is_initialized()
    with pytest.raises(InputError, match="Expected an initialized process group.*Got none"):
        parallel.sync_buffers(nn.BatchNorm1d(4))


def test_sync_buffers_moves_every_buffers_version_so_layers_derive_again(tmp_path):
    """A collective writing into a tensor leaves its version, and the layers rebuild what they
    derived from an index only when its version moves: sync_buffers copies each buffer in,
    so a rewritten layout is seen (a block-ELL model trained on stale indices otherwise)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = nn.Sequential(*layers().values())
        before = {name: buffer._version for name, buffer in model.named_buffers()}
        values = {name: buffer.clone() for name, buffer in model.named_buffers()}
        parallel.sync_buffers(model)
        after = dict(model.named_buffers())
        assert before and all(after[name]._version > version for name, version in before.items())
        assert all(torch.equal(after[name], value) for name, value in values.items())
    finally:
        torch.distributed.destroy_process_group()
