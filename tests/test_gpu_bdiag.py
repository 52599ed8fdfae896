"""GPU numerics of the block-diagonal layout against float64: every kernel family, epilogues,
the kernel backward (dX over W^T's tiles, dW batched), torch.compile and CUDA graphs
(pytest -m gpu)."""
import pytest
import torch

from sparsegen.jit import epilogues
from sparsegen.bdiag import format as diag
from sparsegen.bdiag import ops as diag_ops
from sparsegen.bdiag.nn import BlockDiagonalLinear

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-3}


def relative_error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def reference(layer, x, epilogue="none"):
    """Float64, from the diagonal blocks written out: independent of the layout's tiling."""
    weight = torch.block_diag(*layer.blocks().detach().double().unbind(0))
    y = torch.nn.functional.linear(x.double(), weight, None if layer.bias is None else layer.bias.double())
    return epilogues.reference(y, epilogue)


def poisoned_product(layer, x, instr=None, epilogue="none"):
    width = layer.out_features // (2 if epilogue in ("swiglu", "geglu") else 1)
    out = torch.full((*x.shape[:-1], width), float("nan"), dtype=x.dtype, device=x.device)
    diag_ops.bdiag_dds(x, layer.values, layer.bias, layer.nblocks, epilogue, out=out, instr=instr)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1024, 1024, 4, None), (768, 3072, 3, None), (320, 192, 2, (32, 16)),
                                   (512, 256, 1, (128, 64)), (2048, 512, 8, (16, 32))], ids=str)
@pytest.mark.parametrize("m", [1, 7, 1000, 4133])
def test_forward_matches_float64(shape, dtype, m):
    in_features, out_features, nblocks, block = shape
    layer = BlockDiagonalLinear(in_features, out_features, nblocks, device="cuda", dtype=dtype, block=block)
    x = torch.randn(m, in_features, device="cuda", dtype=dtype)
    out = poisoned_product(layer, x)
    assert not out.isnan().any()
    assert relative_error(out, reference(layer, x)) < TOLERANCE[dtype]


@pytest.mark.parametrize("instr", ["mma", "tma", "pingpong"])
def test_every_kernel_family(instr):
    layer = BlockDiagonalLinear(1024, 2048, 4, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(777, 1024, device="cuda", dtype=torch.bfloat16)
    assert relative_error(poisoned_product(layer, x, instr=instr), reference(layer, x)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("epilogue", ["gelu", "silu", "swiglu"])
@pytest.mark.parametrize("m", [3, 300])
def test_fused_epilogues_match_float64(epilogue, m):
    layer = BlockDiagonalLinear(512, 512, 2, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    assert relative_error(poisoned_product(layer, x, epilogue=epilogue), reference(layer, x, epilogue)) < 2e-2


def test_layer_call_through_every_path():
    layer = BlockDiagonalLinear(256, 384, 2, device="cuda", dtype=torch.float16)
    x = torch.randn(2, 5, 256, device="cuda", dtype=torch.float16)
    ref = reference(layer, x)
    with torch.no_grad():
        for _ in range(3):  # full path, then the lean path's planned launch
            assert relative_error(layer(x), ref) < TOLERANCE[torch.float16]
    assert relative_error(layer(x).detach(), ref) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("shape", [(1024, 3072, 4, None), (384, 256, 2, (32, 64))], ids=str)
def test_training_gradients_match_float64(shape):
    torch.manual_seed(1)
    in_features, out_features, nblocks, block = shape
    layer = BlockDiagonalLinear(in_features, out_features, nblocks, device="cuda", dtype=torch.bfloat16, block=block)
    x = torch.randn(3, 100, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(3, 100, out_features, device="cuda", dtype=torch.bfloat16)
    layer(x).backward(dy)
    x64 = x.detach().double().requires_grad_()
    blocks64 = layer.blocks().detach().double().requires_grad_()
    bias64 = layer.bias.detach().double().requires_grad_()
    y64 = torch.nn.functional.linear(x64, torch.block_diag(*blocks64.unbind(0)), bias64)
    y64.backward(dy.double())
    assert relative_error(x.grad, x64.grad) < 2e-2
    assert relative_error(layer.bias.grad, bias64.grad) < 2e-2
    assert relative_error(diag.untile(layer.values.grad, nblocks), blocks64.grad) < 2e-2


def test_a_few_training_steps_reduce_the_loss(autocast_losses):
    torch.manual_seed(2)
    model = torch.nn.Sequential(BlockDiagonalLinear(256, 512, 4, device="cuda"), torch.nn.GELU(),
                                BlockDiagonalLinear(512, 64, 2, device="cuda"))
    losses = autocast_losses(model, 256, 64)
    assert losses[-1] < 0.9 * losses[0]


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_model_matches_eager(mode):
    torch.manual_seed(3)
    model = torch.nn.Sequential(BlockDiagonalLinear(512, 1024, 4, device="cuda", dtype=torch.float16),
                                torch.nn.ReLU(), BlockDiagonalLinear(1024, 256, 2, device="cuda", dtype=torch.float16))
    compiled = torch.compile(model, mode=mode)
    with torch.no_grad():
        for m in (16, 16, 16, 200):
            x = torch.randn(m, 512, device="cuda", dtype=torch.float16)
            assert relative_error(compiled(x).clone(), model[2](model[1](model[0](x))).double()) < 1e-2


def test_compiled_training_step_matches_eager():
    torch.manual_seed(4)
    layer = BlockDiagonalLinear(512, 1024, 4, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    grads = []
    for step in (layer, torch.compile(layer, fullgraph=True)):
        layer.zero_grad()
        step(x).square().mean().backward()
        grads.append(layer.values.grad.clone())
    assert relative_error(grads[1], grads[0].double()) < 1e-2


def test_cuda_graph_replays_fresh_inputs(graph_replay):
    layer = BlockDiagonalLinear(256, 128, 2, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    y = graph_replay(layer, x)
    assert relative_error(y, reference(layer, x)) < TOLERANCE[torch.bfloat16]
