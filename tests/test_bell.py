"""The block-ELL layout on the CPU: format, index checks, specs, rendering, the layer's
numerics and gradients against float64, checkpoints. (GPU numerics: test_gpu_bell.py.)"""
import pytest
import torch

from kit_training import eager_and_compiled_grads

from sparsegen.jit import codegen, spec as specmod
from sparsegen.bell import format as ell
from sparsegen.bell import specs as bell_specs
from sparsegen.bell.nn import BlockEllLinear
from sparsegen.errors import InputError, SpecError


def stored_blocks(dense, cols, block):
    """The blocks of a dense [N, K] tensor at cols' places: [rows, per_row, bm, bk]."""
    (n, k), (bm, bk) = dense.shape, block
    blocks = dense.reshape(n // bm, bm, k // bk, bk).transpose(1, 2)
    return blocks[torch.arange(n // bm)[:, None], cols.long()]


def dense_reference(layer, x):
    weight = layer.to_dense_weight().double()
    return torch.nn.functional.linear(x.double(), weight, None if layer.bias is None else layer.bias.double())


@pytest.mark.parametrize("block,per_row", [((16, 16), 1), ((32, 16), 3), ((16, 64), 2)])
def test_dense_round_trip_keeps_exactly_the_stored_blocks(block, per_row):
    grid = (5, 4)
    cols = ell.random_cols(grid, per_row, torch.Generator().manual_seed(per_row))
    values = torch.randn(grid[0], per_row, *block, dtype=torch.float64)
    dense = ell.to_dense(values, cols, (grid[0] * block[0], grid[1] * block[1]))
    blocks = dense.reshape(grid[0], block[0], grid[1], block[1]).transpose(1, 2)
    stored = torch.zeros(grid, dtype=torch.bool)
    stored[torch.arange(grid[0])[:, None], cols.long()] = True
    assert (blocks[~stored] == 0).all()
    assert torch.equal(stored_blocks(dense, cols, block), values)
    assert (stored.sum(1) == per_row).all()


def test_top_norm_cols_keeps_the_largest_blocks_of_each_row():
    weight = torch.randn(64, 128) * 0.01
    weight[0:32, 96:128] = 5.0  # block (0, 3)
    weight[32:64, 0:32] = 5.0   # block (1, 0)
    cols = ell.top_norm_cols(weight, (32, 32), 1)
    assert cols.tolist() == [[3], [0]]


@pytest.mark.parametrize("bad,message", [
    (torch.tensor([[0, 4]]), r"block columns in \[0, 4\)"),
    (torch.tensor([[-1, 2]]), r"block columns in \[0, 4\)"),
    (torch.tensor([[2, 2]]), "increasing"),
    (torch.tensor([[3, 1]]), "increasing"),
    (torch.tensor([[0.0, 1.0]]), "integer tensor"),
    (torch.tensor([[0, 1, 2]]), r"shape \(1, 2\)"),
    ([[0, 1]], "integer tensor"),
])
def test_bad_indices_are_refused_before_any_kernel(bad, message):
    with pytest.raises(InputError, match=message):
        ell.check_cols(bad, (1, 4), 2)


def test_layer_matches_float64_and_its_gradients_do_too():
    torch.manual_seed(0)
    layer = BlockEllLinear(96, 64, block=(16, 32), per_row=2).double()
    x = torch.randn(2, 7, 96, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    assert torch.allclose(y, dense_reference(layer, x))
    inputs = (x.detach()[:, :3].requires_grad_(), layer.values.detach().clone().requires_grad_(),
              layer.bias.detach().clone().requires_grad_())
    # (the kit's training call: the product forward, the backward on the layout's dense_weight)
    assert torch.autograd.gradcheck(layer._differentiable_product, inputs)


def test_compiled_training_step_matches_eager():
    """The kit's autograd Function under torch.compile: the same loss and gradients."""
    torch.manual_seed(0)
    layer = BlockEllLinear(96, 64, block=(16, 32), per_row=2)
    x = torch.randn(5, 96, requires_grad=True)
    grads = eager_and_compiled_grads(layer, x)
    torch.testing.assert_close(grads[0], grads[1])


def test_gradients_reach_only_the_stored_blocks():
    layer = BlockEllLinear(64, 32, block=(16, 16), density=0.5, bias=False).double()
    x = torch.randn(9, 64, dtype=torch.float64)
    layer(x).square().sum().backward()
    weight = layer.to_dense_weight().detach().requires_grad_()
    torch.nn.functional.linear(x, weight).square().sum().backward()
    assert torch.allclose(layer.values.grad, stored_blocks(weight.grad, layer.cols, (16, 16)))


def test_the_kit_finds_each_stored_block_where_the_index_puts_it():
    """The training backward's dW lands on block_positions' places: r * K / bk + cols[r, j]."""
    layer = BlockEllLinear(160, 96, block=(16, 32), per_row=3)
    rest = (*layer.op_args(), layer.out_features)
    positions = layer.PRODUCT.positions(layer.values, layer.in_features, rest)
    rows = torch.arange(layer.values.shape[0])[:, None]
    assert torch.equal(positions, (rows * 5 + layer.cols.long()).flatten())
    assert layer.PRODUCT.positions(layer.values, layer.in_features, rest) is positions  # kept per layer


def test_a_dense_weight_blind_to_the_tile_size_is_refused_before_training():
    from sparsegen import gathered
    layer = BlockEllLinear(64, 32, block=(16, 16), per_row=2)
    def blind(values, in_features, cols, rowblocks, out_features):  # rows of 16 whatever the tiles
        return values.new_zeros(values.shape[0] * 16, in_features)
    with pytest.raises(SpecError, match="dense_weight over 1 x 1 tiles to give the block grid"):
        gathered.block_positions(blind, layer.values, 64, (layer.cols, 2, 32))


def test_a_dense_weight_that_stacks_blocks_is_refused_and_copy_dense_checks_its_shape():
    from sparsegen import gathered
    layer = BlockEllLinear(64, 32, block=(16, 16), per_row=2)
    def stacked(values, in_features, cols, rowblocks, out_features):  # every block at (0, 0)
        grid = values.new_zeros(out_features, in_features)
        grid[0, 0] = values.sum()
        return grid
    with pytest.raises(SpecError, match="dense_weight to place each of the 4 blocks once. Got 1 places"):
        gathered.block_positions(stacked, layer.values, 64, (layer.cols, 2, 32))
    with pytest.raises(InputError, match=r"a weight of shape \(32, 64\)\. Got \(64, 32\)"):
        layer.copy_dense(torch.zeros(64, 32))


def test_parameters_passed_at_launch_are_checked_before_any_kernel():
    """rowblocks reaches the kernel unchecked by a spec: the kit refuses a bad one first - and
    the CPU reference refuses it too, so a layout's CPU tests meet what its GPU launch would."""
    from sparsegen import gathered
    layer = BlockEllLinear(64, 32, block=(16, 16), per_row=2)
    product = layer.PRODUCT
    assert product._split_params(gathered.Call(None, (2,), 32, "none")) == ((), (2,))
    with pytest.raises(InputError, match="bell_dds's run-time parameters as positive int32s"):
        product._split_params(gathered.Call(None, (0,), 32, "none"))
    index, params = layer.op_args()[0], layer.op_args()[1:]
    x = torch.randn(3, 64)
    assert product.any_device(x, layer.values.detach(), None, index, *params, 32).shape == (3, 32)
    with pytest.raises(InputError, match="run-time parameters as positive int32s"):
        product.any_device(x, layer.values.detach(), None, index, *(0 for _ in params), 32)


def test_the_kit_builds_the_transposes_block_csr_index_that_dx_runs_on():
    """transposed_index: W^T's rows are W's block columns, each listing W's block rows in order,
    and its block b is values[perm[b]] transposed - W^T rebuilt from it is the dense W^T."""
    from sparsegen import gathered
    torch.manual_seed(2)
    layer = BlockEllLinear(160, 96, block=(16, 32), per_row=3).double()
    perm, row_offsets, col_indices, flat = layer.PRODUCT.transposed_index(
        layer.values, 160, (*layer.op_args(), layer.out_features))
    blocks = layer.values.detach().reshape(-1, 16, 32)[perm].transpose(1, 2)  # W^T's, [32, 16] each
    rebuilt = torch.zeros(160, 96, dtype=torch.float64)
    for c in range(5):
        for b in range(int(row_offsets[c]), int(row_offsets[c + 1])):
            r = int(col_indices[b])
            assert int(flat[b]) == c * 6 + r and (b == row_offsets[c] or r > int(col_indices[b - 1]))
            rebuilt[c * 32:(c + 1) * 32, r * 16:(r + 1) * 16] = blocks[b]
    assert torch.equal(rebuilt, layer.to_dense_weight().detach().t())
    assert row_offsets.dtype == col_indices.dtype == torch.int32 and perm.dtype == flat.dtype == torch.int64


def test_from_dense_and_to_linear_agree():
    linear = torch.nn.Linear(128, 64).double()
    layer = BlockEllLinear.from_dense(linear, block=(32, 32), per_row=2)
    x = torch.randn(5, 128, dtype=torch.float64)
    assert torch.allclose(layer(x), layer.to_linear()(x))
    assert layer.per_row == 2 and layer.cols.dtype == torch.int32


def test_density_rounds_to_whole_blocks_per_row():
    assert BlockEllLinear(320, 64, block=(32, 32), density=0.25).per_row == 2  # 10 columns x 0.25 = 2.5 -> 2
    assert BlockEllLinear(320, 64, block=(32, 32), density=0.01).per_row == 1


@pytest.mark.parametrize("kwargs,message", [
    (dict(in_features=100), "in_features \\(100\\) to be a multiple of the block's columns \\(32\\); nearest valid sizes are 96 and 128"),
    (dict(per_row=9), "per_row at most the 8 block columns"),
    (dict(per_row=0), "positive int"),
    (dict(block=(32,)), r"block as \(rows, cols\)"),
    (dict(density=0.0), r"density in \(0, 1\]"),
])
def test_bad_layer_arguments_say_what_was_expected(kwargs, message):
    args = dict(in_features=256, out_features=64, block=(32, 32)) | kwargs
    with pytest.raises(InputError, match=message):
        BlockEllLinear(**args)


def test_checkpoint_round_trip_and_a_bad_index_is_refused_whole():
    layer = BlockEllLinear(128, 64, block=(32, 32), per_row=2)
    other = BlockEllLinear(128, 64, block=(32, 32), per_row=2)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.cols, layer.cols) and torch.equal(other.values, layer.values)
    state = layer.state_dict()
    state["cols"] = state["cols"].clone()
    state["cols"][1, 1] = 4  # past the last block column
    before = other.values.detach().clone()
    with pytest.raises(InputError, match="block columns"):
        other.load_state_dict(state)
    assert torch.equal(other.values, before)  # nothing was copied


def test_rowblocks_reaches_the_kernel_at_launch_so_one_kernel_serves_every_row_count():
    spec = bell_specs.forward_spec((32, 32), "bf16", 80)
    assert "_xrowblocks" not in spec.name and specmod.KernelSpec.from_name(spec.name) == spec
    source = codegen.render(spec)
    assert "int rowblocks;" in source and "return r * rowblocks;" in source and "return rowblocks;" in source
    assert "int M, int K, int N, int rowblocks)" in source and "Rows{rowblocks}" in source
    assert "return sg::indexed_col(cols, first, blk);" in source and "sg::GatheredDds<" in source


@pytest.mark.parametrize("change,message", [
    (dict(params={"rowblocks": 4}), r"parameters of bell_dds among \(\)"),
    (dict(instr="tma", arch=80), "sm_90"),
    (dict(instr="swap"), "instr one of"),
    (dict(dtype="int8"), "dtype one of"),
    (dict(trans="nn"), "trans 'nt'"),
])
def test_bad_specs_are_spec_errors(change, message):
    base = dict(op="bell_dds", block=(32, 32), dtype="bf16", arch=90, instr="mma",
                tile=specmod.TileConfig(128, 4, 1, 3))
    with pytest.raises(SpecError, match=message):
        specmod.KernelSpec(**(base | change))


def test_precompile_builds_bell_kernels_for_hopper_and_ampere():
    for arch, instrs in ((90, {"pingpong"}), (80, {"mma"})):
        built = [s for s in specmod.default_specs(arch) if s.op == "bell_dds"]
        assert built and {s.instr for s in built} == instrs
        assert {s.block for s in built} == set(bell_specs.PRECOMPILED_BLOCKS) and not any(s.params for s in built)
