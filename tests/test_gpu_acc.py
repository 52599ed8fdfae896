"""GPU: the accumulator as a spec parameter (acc="f16", fp16 operands, the mma.sync kernels of
block-CSR and block-ELL) against float64, and evidence the sum really is kept in fp16
(pytest -m gpu)."""
import pytest
import torch

import sparsegen
from sparsegen.jit import epilogues
from sparsegen.bell import ops as bell_ops
from sparsegen.bell.nn import BlockEllLinear
from sparsegen.bsr import ops as bsr_ops

pytestmark = pytest.mark.gpu

GATED = ("swiglu", "geglu")


def relative_error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def csr_layer(in_features, out_features, block, density=0.5):
    return sparsegen.BlockSparseLinear(in_features, out_features, block=block, density=density, device="cuda",
                                       dtype=torch.float16)


def product(layer, x, epilogue="none", acc="f16"):
    """Y through the layer's layout with the given accumulator, into a NaN-poisoned output."""
    width = layer.out_features // (2 if epilogue in GATED else 1)
    out = torch.full((*x.shape[:-1], width), float("nan"), dtype=x.dtype, device=x.device)
    if isinstance(layer, BlockEllLinear):
        bell_ops.bell_dds(x, layer.values, layer.cols, layer.bias, layer.out_features, epilogue, out=out, acc=acc)
    else:
        bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block,
                        layer.out_features, out=out, epilogue=epilogue, acc=acc)
    torch.cuda.synchronize()
    return out


def reference(layer, x, epilogue="none"):
    y = torch.nn.functional.linear(x.double(), layer.to_dense_weight().double(),
                                   None if layer.bias is None else layer.bias.double())
    return epilogues.reference(y, epilogue)


def make(layout, block, k=1024, n=384):
    if layout == "bell":
        return BlockEllLinear(k, n, block, per_row=k // block[1] // 2, device="cuda", dtype=torch.float16)
    return csr_layer(k, n, block)


@pytest.mark.parametrize("layout", ["bsr", "bell"])
@pytest.mark.parametrize("block", [(16, 16), (32, 32), (64, 64), (128, 128), (32, 64)], ids=str)
@pytest.mark.parametrize("m", [1, 7, 1000, 4133])
def test_f16_accumulator_matches_float64(layout, block, m):
    layer = make(layout, block)
    x = torch.randn(m, layer.in_features, device="cuda", dtype=torch.float16)
    out = product(layer, x)
    assert not out.isnan().any()
    # fp16 partial sums round every k16 step: looser than the f32 accumulator's 5e-3, far below a wrong sum's ~1
    assert relative_error(out, reference(layer, x)) < 2e-2


@pytest.mark.parametrize("layout", ["bsr", "bell"])
@pytest.mark.parametrize("epilogue", ["gelu", "silu", "swiglu"])
def test_f16_accumulator_with_fused_epilogues(layout, epilogue):
    layer = make(layout, (32, 32), k=512, n=256)
    x = torch.randn(301, 512, device="cuda", dtype=torch.float16)
    out = product(layer, x, epilogue)
    assert relative_error(out, reference(layer, x, epilogue)) < 2e-2


@pytest.mark.parametrize("layout", ["bsr", "bell"])
def test_partial_sums_are_kept_in_fp16(layout):
    # X all ones; each output row's weights are +160 over K's first half and -160 over the
    # second, all stored. The exact sum is 0, but half-way it is 160 * 512 = 81920, past
    # fp16's 65504: an f32 accumulator returns 0, an fp16 one cannot come back from its overflow.
    k = 1024
    linear = torch.nn.Linear(k, 128, bias=False, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        linear.weight[:, : k // 2] = 160.0
        linear.weight[:, k // 2:] = -160.0
    cls = BlockEllLinear if layout == "bell" else sparsegen.BlockSparseLinear
    layer = cls.from_dense(linear, (64, 64), density=1.0)
    x = torch.ones(64, k, device="cuda", dtype=torch.float16)
    assert reference(layer, x).abs().max().item() == 0
    assert product(layer, x, acc="f32").abs().max().item() == 0
    overflowed = product(layer, x, acc="f16")
    assert (~torch.isfinite(overflowed) | (overflowed.abs() > 1000)).all()


def test_f16_accumulator_rejected_for_bf16_before_any_launch():
    layer = sparsegen.BlockSparseLinear(256, 128, block=(32, 32), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(sparsegen.SpecError, match="Expected dtype one of"):
        bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, None, layer.block,
                        layer.out_features, acc="f16")
