"""Gradients of the GPU autograd path, checked on the CPU: the kernel launch is replaced by a
float64 reference that reads the same block-CSR index, so the transposed index, the value
permutation and the weight gradient are all exercised (torch.autograd.gradcheck)."""
import pytest
import torch
import torch.nn.functional as F

from sparsegen import autograd, ops
from sparsegen.layouts import bsr


def csr_linear(x, values, row_offsets, col_indices, bias, block, out_features, out=None):
    """Y = X W^T with W rebuilt from (row_offsets, col_indices) alone."""
    rows = row_offsets.numel() - 1
    cols = x.shape[-1] // block[1]
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    for r in range(rows):
        mask[r, col_indices[row_offsets[r]:row_offsets[r + 1]].long()] = True
    return F.linear(x, bsr.values_to_dense(values, mask, block), bias)


@pytest.fixture
def cpu_kernel(monkeypatch):
    monkeypatch.setattr(ops, "bsr_dds", csr_linear)


def random_layout(rows, cols, density=0.5, empty_row=None):
    mask = torch.rand(rows, cols) < density
    if empty_row is not None:
        mask[empty_row] = False
    return mask


@pytest.mark.parametrize("block", [(2, 3), (4, 2), (1, 1)])
def test_gradcheck_float64(cpu_kernel, block):
    mask = random_layout(3, 4, empty_row=1)
    row_offsets, col_indices = bsr.indices(mask)
    layout = autograd.Layout(mask, row_offsets, col_indices, block, (3 * block[0], 4 * block[1]))
    x = torch.randn(2, 5, 4 * block[1], dtype=torch.float64, requires_grad=True)
    values = torch.randn(int(mask.sum()), *block, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3 * block[0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: autograd.block_sparse_linear(*a, layout), (x, values, bias))


def test_transposed_index_reorders_blocks():
    mask = random_layout(5, 7, density=0.4)
    block = (2, 3)
    values = torch.randn(int(mask.sum()), *block)
    row_offsets_t, col_indices_t, perm = bsr.transposed(mask)
    dense_t = bsr.values_to_dense(bsr.transpose_values(values, perm), mask.t().contiguous(), (3, 2))
    torch.testing.assert_close(dense_t, bsr.values_to_dense(values, mask, block).t(), rtol=0, atol=0)
    expected = bsr.indices(mask.t().contiguous())
    assert torch.equal(row_offsets_t, expected[0]) and torch.equal(col_indices_t, expected[1])
