"""The custom op behind BlockSparseLinear: gradients (float64 gradcheck, through the same
op and index tensors the GPU path uses, with the CPU reference inside) and torch.compile
with fullgraph=True."""
import pytest
import torch

import sparsegen
from sparsegen.bsr import autograd
from sparsegen.bsr.autograd import IndexTensors
from sparsegen.bsr import format as bsr
from sparsegen.bsr import ops as bsr_ops


def random_layout(rows, cols, density=0.5, empty_row=None):
    mask = torch.rand(rows, cols) < density
    if empty_row is not None:
        mask[empty_row] = False
    return mask


def gradcheck_on_3x4_blocks(linear, block, empty_row) -> bool:
    """float64 gradcheck of linear(x, values, bias, index, block, out_features) on a 3 x 4
    block grid with one empty block row and leading batch dims."""
    mask = random_layout(3, 4, empty_row=empty_row)
    index = IndexTensors.of(mask).as_tuple()
    x = torch.randn(2, 5, 4 * block[1], dtype=torch.float64, requires_grad=True)
    values = torch.randn(int(mask.sum()), *block, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3 * block[0], dtype=torch.float64, requires_grad=True)
    op = lambda x, v, b: linear(x, v, b, index, block, 3 * block[0])
    return torch.autograd.gradcheck(op, (x, values, bias))


@pytest.mark.parametrize("block", [(2, 3), (4, 2), (1, 1)])
def test_gradcheck_float64(block):
    assert gradcheck_on_3x4_blocks(autograd.block_sparse_linear, block, empty_row=1)


def kernel_stand_in(x, values, bias, row_offsets, col_indices, flat_index, block, out_features, epilogue="none"):
    """bsr_ops.bsr_dds_any_device computed by the reference from its (row_offsets, col_indices)
    arguments alone, as the kernels read them (flat_index is ignored)."""
    rows = torch.repeat_interleave(torch.arange(row_offsets.numel() - 1), row_offsets.diff())
    flat = rows * (x.shape[-1] // block[1]) + col_indices
    return bsr_ops.indexed_reference(x, values, bias, flat, block, out_features, epilogue)


@pytest.mark.parametrize("block", [(2, 3), (4, 2)])
def test_kernel_path_gradcheck_float64(block, monkeypatch):
    """The autograd.Function as the GPU runs it, the product replaced by a stand-in that reads
    the block CSR as the kernels do: forward and dX (on W^T's index) wired to the right index."""
    monkeypatch.setattr(bsr_ops, "bsr_dds_any_device", kernel_stand_in)
    assert gradcheck_on_3x4_blocks(autograd.block_sparse_linear, block, empty_row=2)


def test_op_matches_masked_dense_reference():
    mask = random_layout(6, 5, density=0.4)
    block = (4, 8)
    values = torch.randn(int(mask.sum()), *block, dtype=torch.float64)
    x = torch.randn(7, 5 * 8, dtype=torch.float64)
    got = autograd.block_sparse_linear(x, values, None, IndexTensors.of(mask).as_tuple(), block, 24)
    want = x @ bsr.values_to_dense(values, mask, block).t()
    torch.testing.assert_close(got, want)


def test_transposed_index_reorders_blocks():
    mask = random_layout(5, 7, density=0.4)
    block = (2, 3)
    values = torch.randn(int(mask.sum()), *block)
    row_offsets_t, col_indices_t, perm = bsr.transposed(mask)
    dense_t = bsr.values_to_dense(bsr.transpose_values(values, perm), mask.t().contiguous(), (3, 2))
    torch.testing.assert_close(dense_t, bsr.values_to_dense(values, mask, block).t(), rtol=0, atol=0)
    expected = bsr.indices(mask.t().contiguous())
    assert torch.equal(row_offsets_t, expected[0]) and torch.equal(col_indices_t, expected[1])


def small_model():
    return torch.nn.Sequential(sparsegen.linear(64, 96, block=(16, 16), density=0.5), torch.nn.GELU(),
                               sparsegen.linear(96, 32, block=(16, 32), density=0.5))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model, twin = small_model(), small_model()
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 10, 64)
    eager_out, compiled_out = model(x), compiled(x)
    torch.testing.assert_close(compiled_out, eager_out)
    eager_out.square().sum().backward()
    compiled_out.square().sum().backward()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


def test_state_dict_with_another_layout_rebuilds_the_derived_index():
    torch.manual_seed(1)
    a, b = sparsegen.linear(64, 64, block=(16, 16), density=0.5), sparsegen.linear(64, 64, block=(16, 16), density=0.5)
    assert not torch.equal(a.layout, b.layout)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 64, requires_grad=True)
    out = autograd.block_sparse_linear(x, b.values, b.bias, b._index(), b.block, 64)
    torch.testing.assert_close(out, a(x))
    assert torch.equal(b.t_row_offsets, a.t_row_offsets) and torch.equal(b.flat_index, a.flat_index)


def train_demo():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "train_demo.py"
    spec = importlib.util.spec_from_file_location("train_demo", path)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def test_demo_gpt_compiles_without_graph_breaks():
    """The training demo's model with block-sparse FFNs: torch._dynamo.explain sees one graph."""
    demo = train_demo()
    model = demo.GPT(layers=2, d=64, heads=4, context=32)
    sparsegen.patch(model, {r"blocks\.\d+\.ffn\.(0|2)": {"block": (32, 32), "density": 0.5}})
    tokens = torch.randint(0, 256, (2, 32))
    explanation = torch._dynamo.explain(model)(tokens)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_demo_seed_table_compares_each_seed_with_dense_at_that_seed():
    runs = {0: [dict(label="dense", val_loss=2.0, step_ms=10.0), dict(label="sparse", val_loss=2.02, step_ms=5.0)],
            1: [dict(label="dense", val_loss=4.0, step_ms=12.0), dict(label="sparse", val_loss=3.96, step_ms=6.0)]}
    dense, sparse = train_demo().seed_rows(runs)
    assert dense == ["dense", "2.0000 / 4.0000", 0.0, 0.0, 11.0, 1.0]
    assert sparse[:2] == ["sparse", "2.0200 / 3.9600"] and sparse[4:] == [5.5, 2.0]
    assert sparse[2] == pytest.approx(0.0) and sparse[3] == pytest.approx(0.01)


def test_input_grad_on_cpu_is_dy_times_w():
    """bsr_ops.input_grad off the GPU: W^T's values transposed from the stored ones, then the
    reference product - the same dX the GPU kernel computes from the stored blocks."""
    torch.manual_seed(3)
    layer = sparsegen.linear(96, 64, block=(16, 32), density=0.5, dtype=torch.float64)
    dy = torch.randn(7, 64, dtype=torch.float64)
    dx = bsr_ops.input_grad(dy, layer.values, layer.t_perm, layer.t_row_offsets, layer.t_col_indices,
                                  layer.t_flat_index, (32, 16), 96)
    torch.testing.assert_close(dx, dy @ layer.to_dense_weight())
