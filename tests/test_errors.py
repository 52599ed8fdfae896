"""Bad inputs fail with InputError ("Expected ... Got ...") before any kernel or matmul runs."""
import numpy as np
import pytest
import torch
from torch import nn

import sparsegen
from sparsegen import BlockSparseLinear
from sparsegen.bsr import ops as bsr_ops

IN, OUT, BLOCK = 4 * 32, 2 * 32, (32, 32)


@pytest.fixture
def layer(monkeypatch):
    """A float32 CPU layer whose compute paths fail the test if they are ever reached."""
    built = sparsegen.linear(IN, OUT, block=BLOCK, density=0.5)

    def unreachable(*args, **kwargs):
        raise AssertionError("input checks must run before any computation")

    monkeypatch.setattr(bsr_ops, "indexed_reference", unreachable)
    monkeypatch.setattr(bsr_ops, "bsr_dds", unreachable)
    return built


def raises_input_error(match: str):
    return pytest.raises(sparsegen.InputError, match=match)


FORWARD_CASES = {
    "wrong dtype": (torch.randn(3, IN, dtype=torch.float64),
                    r"Expected input dtype torch\.float32 .*\. Got torch\.float64\."),
    "bfloat16 into float32": (torch.randn(3, IN).bfloat16(), r"Got torch\.bfloat16\."),
    "wrong last dim": (torch.randn(3, IN - 1),
                       rf"Expected input of shape \(\.\.\., {IN}\)\. Got \(3, {IN - 1}\)\."),
    "features on the wrong axis": (torch.randn(IN, 3), rf"Got \({IN}, 3\)\."),
    "zero-dim tensor": (torch.tensor(1.0), r"Got \(\)\."),
    "wrong device": (torch.empty(3, IN, device="meta"), r"Expected input on cpu .*\. Got meta\."),
    "list": ([[0.0] * IN], r"Expected input to be a torch\.Tensor\. Got list\."),
    "numpy array": (np.zeros((3, IN), dtype=np.float32), r"Got ndarray\."),
}


@pytest.mark.parametrize("x, match", FORWARD_CASES.values(), ids=FORWARD_CASES.keys())
def test_bad_forward_input(layer, x, match):
    with raises_input_error(match) as info:
        layer(x)
    assert isinstance(info.value, ValueError) and isinstance(info.value, sparsegen.SparsegenError)


def test_bias_of_another_dtype(layer):
    layer.bias = nn.Parameter(layer.bias.detach().double())
    with raises_input_error(r"Expected bias of dtype torch\.float32 on cpu\. "
                            r"Got torch\.float64 on cpu\."):
        layer(torch.randn(3, IN))


@pytest.mark.parametrize("which, in_features, out_features, side",
                         [("in_features", 100, 64, 32), ("out_features", 64, 80, 32),
                          ("in_features", 48, 32, 32), ("out_features", 64, 72, 16)])
def test_features_not_a_multiple_of_the_block(which, in_features, out_features, side):
    features = in_features if which == "in_features" else out_features
    lower, upper = features // side * side, -(-features // side) * side
    side_name = "rows" if which == "out_features" else "columns"
    with raises_input_error(rf"Expected {which} \({features}\) to be a multiple of the block's {side_name} "
                            rf"\({side}\); nearest valid sizes are {lower} and {upper}\. "
                            rf"Got {features} % {side} = {features % side}\."):
        BlockSparseLinear(in_features, out_features, block=(side, side))


@pytest.mark.parametrize("layout, match", [
    (torch.ones(4, 2, dtype=torch.bool), r"Expected layout of shape \(2, 4\) .*Got \(4, 2\)\."),
    (torch.ones(8, dtype=torch.bool), r"Expected layout of shape \(2, 4\) .*Got \(8,\)\."),
    (torch.ones(2, 4), r"Expected layout to be a torch\.bool tensor\. Got torch\.float32\."),
    (torch.ones(2, 4, dtype=torch.uint8), r"Got torch\.uint8\."),
    ([[True] * 4] * 2, r"Expected layout to be a torch\.bool tensor\. Got <class 'list'>\."),
], ids=["transposed", "flat", "float", "uint8", "list"])
def test_bad_layout(layout, match):
    with raises_input_error(match):
        sparsegen.linear(IN, OUT, block=BLOCK, layout=layout)


@pytest.mark.parametrize("density", [0, 0.0, -0.1, 1.01, 2.0, float("nan")])
def test_density_out_of_range(density):
    """Density in (0, 1]: a layer of no blocks would return only its bias."""
    with raises_input_error(r"Expected density in \(0, 1\]\. Got "):
        sparsegen.linear(IN, OUT, block=BLOCK, density=density)


@pytest.mark.parametrize("density", [0.0, -1.0, 1.5])
def test_from_dense_density_out_of_range(density):
    with raises_input_error(r"Expected density in \(0, 1\]\. Got "):
        BlockSparseLinear.from_dense(nn.Linear(IN, OUT), block=BLOCK, density=density)


def test_from_dense_needs_a_linear():
    with raises_input_error(r"Expected an nn\.Linear\. Got Conv1d\."):
        BlockSparseLinear.from_dense(nn.Conv1d(IN, OUT, 1), block=BLOCK)


@pytest.mark.parametrize("block", [(32,), (32, 32, 32)], ids=str)
def test_block_needs_two_sides(block):
    with raises_input_error(r"Expected block as \(rows, cols\)\."):
        sparsegen.linear(IN, OUT, block=block)


NONCONTIGUOUS = {
    "transposed": lambda: torch.randn(IN, 7).t(),
    "strided columns": lambda: torch.randn(5, 2 * IN)[:, ::2],
    "permuted batch": lambda: torch.randn(7, IN, 3).permute(2, 0, 1),
    "expanded row": lambda: torch.randn(1, IN).expand(6, IN),
    "offset slice": lambda: torch.randn(9, IN + 3)[2:, 3:],
}


@pytest.mark.parametrize("make", NONCONTIGUOUS.values(), ids=NONCONTIGUOUS.keys())
def test_noncontiguous_input_gives_right_numerics(make, dense_reference):
    x = make()
    assert not x.is_contiguous()
    layer = sparsegen.linear(IN, OUT, block=BLOCK, density=0.5)
    torch.testing.assert_close(layer(x).double(), dense_reference(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [(24, 24), (8, 8), (256, 256), (32, 48)])
def test_block_sides_the_kernels_do_not_take_are_refused_on_every_device(block):
    """One check of block sides (KernelSpec's BLOCK_SIDES) for the layers, precompile and tune:
    the CPU path refuses what the GPU would."""
    with raises_input_error(r"Expected block sides each one of \(16, 32, 64, 128\)"):
        sparsegen.linear(768, 768, block=block, density=0.5)


@pytest.mark.parametrize("dtype, expected", [("bf16", torch.bfloat16), ("float16", torch.float16), ("fp32", torch.float32),
                                             (torch.float64, torch.float64)])
def test_dtypes_by_name_or_torch_dtype(dtype, expected):
    """Every layer takes them (the factory and each class), the kit's layouts through its
    shared _make_parameters."""
    layers = [sparsegen.linear(64, 64, sparsity=sparsity, dtype=dtype, **more)
              for sparsity, more in (("block", {}), ("2:4", {}), ("block-diagonal", dict(nblocks=2)),
                                     ("block-ell", dict(block=(16, 16), per_row=2)), ("2:4", dict(mask_interval=5)))]
    layers += [sparsegen.Sparse24Linear(64, 64, dtype=dtype), sparsegen.BlockSparseLinear(64, 64, (16, 16), dtype=dtype)]
    assert all(next(layer.parameters()).dtype == expected for layer in layers)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, "bf", "int8", 3])
def test_a_dtype_no_layer_takes_lists_the_valid_ones(dtype):
    with raises_input_error(r"Expected dtype one of \[torch.bfloat16, .*\] or a name of one \(float16, fp16"):
        sparsegen.linear(64, 64, dtype=dtype)
