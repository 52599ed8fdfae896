"""GPU numerics of the block-ELL layout against float64: every kernel family, epilogues,
training, torch.compile and CUDA graphs (pytest -m gpu)."""
import pytest
import torch

import sparsegen
from kit_training import capture_forward_backward, fresh_replays

from sparsegen.jit import epilogues
from sparsegen.bell import ops as bell_ops
from sparsegen.bell.nn import BlockEllLinear

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-3}


def relative_error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def reference(layer, x, epilogue="none"):
    y = torch.nn.functional.linear(x.double(), layer.to_dense_weight().double(),
                                   None if layer.bias is None else layer.bias.double())
    return epilogues.reference(y, epilogue)


def poisoned_product(layer, x, instr=None, epilogue="none"):
    width = layer.out_features // (2 if epilogue in ("swiglu", "geglu") else 1)
    out = torch.full((*x.shape[:-1], width), float("nan"), dtype=x.dtype, device=x.device)
    bell_ops.bell_dds(x, layer.values, layer.cols, layer.bias, layer.out_features, epilogue, out=out, instr=instr)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("block", [(16, 16), (32, 32), (64, 64), (128, 128), (32, 64), (64, 32)], ids=str)
@pytest.mark.parametrize("m", [1, 7, 1000, 4133])
@pytest.mark.parametrize("per_row", [1, 3])
def test_forward_matches_float64(block, dtype, m, per_row):
    layer = BlockEllLinear(5 * block[1] + 128, 3 * block[0] + 128, block, per_row=per_row, device="cuda",
                           dtype=dtype)
    x = torch.randn(m, layer.in_features, device="cuda", dtype=dtype)
    out = poisoned_product(layer, x)
    assert not out.isnan().any()
    assert relative_error(out, reference(layer, x)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block", [(16, 16), (64, 64), (128, 128), (32, 64)], ids=str)
def test_mma_sync_path_on_any_arch(block, dtype):
    layer = BlockEllLinear(8 * 128, 3 * 128, block, per_row=5, device="cuda", dtype=dtype)
    x = torch.randn(517, 8 * 128, device="cuda", dtype=dtype)
    assert relative_error(poisoned_product(layer, x, instr="mma"), reference(layer, x)) < TOLERANCE[dtype]


@pytest.mark.parametrize("epilogue", ["gelu", "silu", "swiglu"])
@pytest.mark.parametrize("m", [3, 300])
def test_fused_epilogues_match_float64(epilogue, m):
    layer = BlockEllLinear(512, 256, (32, 32), per_row=4, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    out = poisoned_product(layer, x, epilogue=epilogue)
    assert relative_error(out, reference(layer, x, epilogue)) < 2e-2


def test_batched_input_and_layer_call_through_every_path():
    layer = BlockEllLinear(256, 192, (64, 64), per_row=2, device="cuda", dtype=torch.float16)
    x = torch.randn(2, 5, 256, device="cuda", dtype=torch.float16)
    ref = reference(layer, x)
    with torch.no_grad():
        for _ in range(3):  # full path, then the lean path's planned launch
            assert relative_error(layer(x), ref) < TOLERANCE[torch.float16]
    assert relative_error(layer(x).detach(), ref) < TOLERANCE[torch.float16]


def test_training_gradients_match_float64():
    torch.manual_seed(1)
    layer = BlockEllLinear(384, 256, (32, 32), per_row=3, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(300, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    layer(x).backward(dy)
    x64 = x.detach().double().requires_grad_()
    values64 = layer.values.detach().double().requires_grad_()
    bias64 = layer.bias.detach().double().requires_grad_()
    bell_ops.reference(x64, values64, bias64, layer.cols, layer.per_row, 256).backward(dy.double())
    for got, want in ((x.grad, x64.grad), (layer.values.grad, values64.grad), (layer.bias.grad, bias64.grad)):
        assert relative_error(got, want) < 2e-2


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("m", [77, 1000])
def test_compiled_training_runs_the_kit_kernels_to_float64_gradients(m, mode):
    """dX by the kit's input-grad op (planned on the host, called whole by the compiled
    backward), dW by its sampled kernel at the blocks block_positions finds: three steps on
    fresh inputs (replays under reduce-overhead), gradients against float64 at each."""
    torch.manual_seed(m)
    cols = torch.stack([torch.randperm(10)[:4].sort().values for _ in range(6)])
    layer = BlockEllLinear(320, 192, (32, 32), per_row=4, device="cuda", dtype=torch.bfloat16, cols=cols)
    step = torch.compile(layer, fullgraph=True, mode=mode)
    for _ in range(3):
        layer.values.grad = layer.bias.grad = None
        x = torch.randn(m, 320, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, 192, device="cuda", dtype=torch.bfloat16)
        step(x).backward(dy)
        x64, values64 = x.detach().double().requires_grad_(), layer.values.detach().double().requires_grad_()
        bell_ops.reference(x64, values64, layer.bias.detach().double(), layer.cols, 4, 192).backward(dy.double())
        assert relative_error(x.grad, x64.grad) < 2e-2 and relative_error(layer.values.grad, values64.grad) < 2e-2


@pytest.mark.parametrize("make_layer", [
    lambda: sparsegen.linear(320, 192, sparsity="block-ell", block=(32, 32), per_row=3, device="cuda",
                             dtype=torch.bfloat16),
    lambda: sparsegen.linear(512, 256, sparsity="block-diagonal", nblocks=4, device="cuda", dtype=torch.bfloat16),
], ids=["bell", "bdiag"])
def test_kit_training_steps_replay_as_a_cuda_graph_on_fresh_inputs(make_layer):
    """The kit's forward and backward (its kernels, the sampled or the layout's own dW) captured
    once and replayed on fresh inputs, outputs poisoned first: gradients against float64."""
    torch.manual_seed(5)
    layer = make_layer()
    x = torch.randn(300, layer.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(300, layer.out_features, device="cuda", dtype=torch.bfloat16)
    graph, out = capture_forward_backward(layer, x, dy)
    for _ in fresh_replays(graph, out, layer, x, dy):
        x64 = x.detach().double().requires_grad_()
        values64 = layer.values.detach().double().requires_grad_()
        want = layer.PRODUCT.reference(x64, values64, layer.bias.detach().double(), *layer.op_args(),
                                       layer.out_features)
        want.backward(dy.double())
        for got, ref in ((out, want.detach()), (x.grad, x64.grad), (layer.values.grad, values64.grad),
                         (layer.bias.grad, dy.double().sum(0))):
            assert not got.isnan().any() and relative_error(got, ref) < 2e-2


def test_a_few_training_steps_reduce_the_loss(autocast_losses):
    torch.manual_seed(2)
    model = torch.nn.Sequential(BlockEllLinear(256, 256, (32, 32), per_row=4, device="cuda"), torch.nn.GELU(),
                                BlockEllLinear(256, 64, (32, 32), per_row=4, device="cuda"))
    losses = autocast_losses(model, 256, 64)
    assert losses[-1] < 0.9 * losses[0]


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_model_matches_eager(mode):
    torch.manual_seed(3)
    model = torch.nn.Sequential(BlockEllLinear(512, 512, (64, 64), per_row=3, device="cuda", dtype=torch.float16),
                                torch.nn.ReLU(),
                                BlockEllLinear(512, 256, (64, 64), per_row=2, device="cuda", dtype=torch.float16))
    compiled = torch.compile(model, mode=mode)
    with torch.no_grad():
        for m in (16, 16, 16, 200):
            x = torch.randn(m, 512, device="cuda", dtype=torch.float16)
            assert relative_error(compiled(x).clone(), model[2](model[1](model[0](x))).double()) < 1e-2


def test_cuda_graph_replays_fresh_inputs(graph_replay):
    layer = BlockEllLinear(256, 128, (32, 32), per_row=2, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    y = graph_replay(layer, x)
    assert relative_error(y, reference(layer, x)) < TOLERANCE[torch.bfloat16]
