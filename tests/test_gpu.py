"""GPU numerics of every generated kernel against a float64 reference (pytest -m gpu)."""
import pytest
import torch

import sparsegen

from sparsegen.bsr import dispatch as bsr_dispatch
from sparsegen.bsr import format as bsr
from sparsegen.bsr import ops as bsr_ops
from sparsegen.jit.spec import TileConfig

from kit_training import capture_forward_backward, fresh_replays

pytestmark = pytest.mark.gpu

BLOCKS = [(16, 16), (32, 32), (64, 64), (128, 128), (32, 64), (64, 32), (128, 64), (16, 128)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-3}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def reference(layer: sparsegen.BlockSparseLinear, x: torch.Tensor) -> torch.Tensor:
    weight = layer.to_dense_weight().double()
    bias = layer.bias.double() if layer.bias is not None else None
    return torch.nn.functional.linear(x.double(), weight, bias)


def run_poisoned(layer, x):
    """Launch into an output filled with NaN, so any element the kernel skips shows up."""
    out = torch.full((*x.shape[:-1], layer.out_features), float("nan"), dtype=x.dtype, device=x.device)
    bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block,
                layer.out_features, out=out)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("m", [1, 7, 1000, 4133])
def test_forward_matches_float64(block, dtype, m):
    in_features, out_features = 6 * block[1] + 2 * 128, 5 * block[0] + 128
    layer = sparsegen.linear(in_features, out_features, block=block, density=0.4,
                             device="cuda", dtype=dtype)
    x = torch.randn(m, in_features, device="cuda", dtype=dtype)
    out = run_poisoned(layer, x)
    assert not out.isnan().any()
    assert relative_error(out, reference(layer, x)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block", [(16, 16), (64, 64), (128, 128), (32, 64)], ids=str)
def test_mma_sync_path_on_any_arch(block, dtype):
    """The sm_80 code path (mma.sync), forced even where wgmma is the default."""
    layer = sparsegen.linear(4 * 128, 3 * 128, block=block, density=0.5, device="cuda", dtype=dtype)
    x = torch.randn(517, 4 * 128, device="cuda", dtype=dtype)
    out = torch.full((517, 3 * 128), float("nan"), device="cuda", dtype=dtype)
    bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block,
                layer.out_features, out=out, instr="mma")
    assert relative_error(out, reference(layer, x)) < TOLERANCE[dtype]


def is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not is_hopper(), reason="wgmma and TMA need sm_90")
@pytest.mark.parametrize("instr", ["wgmma", "tma", "pingpong"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block", [(16, 16), (32, 32), (64, 64), (128, 128), (32, 64), (64, 32),
                                   (128, 16), (16, 128)], ids=str)
@pytest.mark.parametrize("m", [1, 300, 2049])
def test_hopper_paths(block, dtype, instr, m):
    """Both Hopper kernels, whatever the default is, with partial stages and empty rows."""
    layout = torch.rand(5, 7) < 0.45
    layout[1] = False
    layer = sparsegen.linear(7 * block[1], 5 * block[0], block=block, layout=layout,
                             device="cuda", dtype=dtype)
    x = torch.randn(m, 7 * block[1], device="cuda", dtype=dtype)
    out = torch.full((m, 5 * block[0]), float("nan"), device="cuda", dtype=dtype)
    bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block,
                layer.out_features, out=out, instr=instr)
    assert not out.isnan().any()
    assert relative_error(out, reference(layer, x)) < TOLERANCE[dtype]


@pytest.mark.skipif(not is_hopper(), reason="wgmma and TMA need sm_90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block", [(64, 64), (128, 128), (64, 128), (128, 64)], ids=str)
@pytest.mark.parametrize("m", [65, 300, 2049])
def test_swap_kernel_and_its_transposed_read_match_float64(block, dtype, m):
    """W as wgmma's A (these blocks' default beyond 64 tokens): the forward, and the input
    gradient reading the stored blocks as W^T's (trans nn, no transposed copy), with
    partial token tiles, an empty block row and an empty block column."""
    layout = torch.rand(5, 7) < 0.45
    layout[1], layout[:, 2] = False, False
    layer = sparsegen.linear(7 * block[1], 5 * block[0], block=block, layout=layout, device="cuda", dtype=dtype)
    x = torch.randn(m, 7 * block[1], device="cuda", dtype=dtype)
    out = torch.full((m, 5 * block[0]), float("nan"), device="cuda", dtype=dtype)
    bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block,
                layer.out_features, out=out, instr="swap")
    assert not out.isnan().any()
    assert relative_error(out, reference(layer, x)) < TOLERANCE[dtype]
    assert bsr_dispatch.input_grad_kernel(x, block[::-1]).spec.trans == "nn"
    dy = torch.randn(m, 5 * block[0], device="cuda", dtype=dtype)
    dx = bsr_ops.input_grad(dy, layer.values, layer.t_perm, layer.t_row_offsets, layer.t_col_indices,
                        layer.t_flat_index, block[::-1], 7 * block[1])
    want = dy.double() @ layer.to_dense_weight().double()
    assert not dx.isnan().any()
    assert relative_error(dx, want) < TOLERANCE[dtype]


@pytest.mark.skipif(not is_hopper(), reason="wgmma and TMA need sm_90")
@pytest.mark.parametrize("tile", [None, TileConfig(128, 8, 1, 3), TileConfig(192, 8, 1, 5)],
                         ids=["default", "t128", "t192"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block", [(64, 64), (64, 128), (128, 64)], ids=str)
@pytest.mark.parametrize("m", [65, 300, 2049])
def test_pairs_kernel_forward_and_input_grad_match_float64(block, dtype, m, tile):
    """Pairs of 64-row block rows sharing X's copies (instr "pairs"): the forward where W's
    blocks have 64 rows, dX where W^T's do. Five block rows and seven block columns, so both
    directions end on a row without a partner; an empty block row and column, partial token
    tiles, outputs poisoned first."""
    layout = torch.rand(5, 7) < 0.45
    layout[1], layout[:, 2] = False, False
    layer = sparsegen.linear(7 * block[1], 5 * block[0], block=block, layout=layout, device="cuda", dtype=dtype)
    if block[0] == 64:
        x = torch.randn(m, 7 * block[1], device="cuda", dtype=dtype)
        out = torch.full((m, 5 * block[0]), float("nan"), device="cuda", dtype=dtype)
        bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block,
                    layer.out_features, out=out, tile=tile, instr="pairs")
        assert not out.isnan().any() and relative_error(out, reference(layer, x)) < TOLERANCE[dtype]
    if block[1] == 64:
        dy = torch.randn(m, 5 * block[0], device="cuda", dtype=dtype)
        dx = bsr_ops.input_grad(dy, layer.values, layer.t_perm, layer.t_row_offsets, layer.t_col_indices,
                            layer.t_flat_index, block[::-1], 7 * block[1], tile=tile, instr="pairs")
        want = dy.double() @ layer.to_dense_weight().double()
        assert not dx.isnan().any() and relative_error(dx, want) < TOLERANCE[dtype]


@pytest.mark.skipif(not is_hopper(), reason="wgmma and TMA need sm_90")
@pytest.mark.parametrize("instr", ["swap", "pairs"])
@pytest.mark.parametrize("m", [65, 300, 2049])
def test_clusters_sharing_w_match_float64(instr, m):
    """Clusters of two blocks on neighbouring token tiles, each copying half of every W box
    to both (multicast): forward and dX, a cluster whose second token tile lies past M
    (M = 65, 2049), five block rows (pairs: one without a partner), outputs poisoned."""
    tile = TileConfig(256, 8, 1, 4, cluster=2)
    layout = torch.rand(5, 7) < 0.45
    layout[1], layout[:, 2] = False, False
    layer = sparsegen.linear(7 * 64, 5 * 64, block=(64, 64), layout=layout, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 7 * 64, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, 5 * 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block, layer.out_features,
                out=out, tile=tile, instr=instr)
    assert not out.isnan().any() and relative_error(out, reference(layer, x)) < TOLERANCE[torch.bfloat16]
    dy = torch.randn(m, 5 * 64, device="cuda", dtype=torch.bfloat16)
    dx = bsr_ops.input_grad(dy, layer.values, layer.t_perm, layer.t_row_offsets, layer.t_col_indices,
                        layer.t_flat_index, (64, 64), 7 * 64, tile=tile, instr=instr)
    want = dy.double() @ layer.to_dense_weight().double()
    assert not dx.isnan().any() and relative_error(dx, want) < TOLERANCE[torch.bfloat16]


def test_pairs_index_follows_a_layout_change():
    """The pairs kernel's union index is cached per layout: a new layout must not reuse it."""
    layer = sparsegen.linear(512, 384, block=(64, 64), density=0.5, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(100, 512, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        out = bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block,
                          layer.out_features, instr="pairs")
        assert relative_error(out, reference(layer, x)) < TOLERANCE[torch.bfloat16]
        with torch.no_grad():
            layer.set_layout(layer.layout.flatten()[torch.randperm(48)].view(6, 8))  # same count, moved


# Run in a child process so that a hang fails the test instead of stalling the suite.
PERSISTENT_STRESS = r"""
import torch, sparsegen
from sparsegen.bsr import ops as bsr_ops
from sparsegen.bsr import dispatch as bsr_dispatch

torch.manual_seed(0)
nnz = torch.tensor([0, 1, 0, 1, 8, 0, 1, 12, 1, 0, 2, 1] * 4)       # empty, one-stage and long rows
layout = torch.rand(48, 16).argsort(1) < nnz[:, None]
x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
for instr in ("pingpong", "tma"):
    layer = sparsegen.linear(1024, 3072, block=(64, 64), layout=layout, device="cuda", dtype=torch.bfloat16)
    want = x.double() @ layer.to_dense_weight().double().t() + layer.bias.double()
    for _ in range(40):
        out = torch.full((8192, 3072), float("nan"), device="cuda", dtype=torch.bfloat16)
        bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block, 3072,
                    out=out, instr=instr)
    torch.cuda.synchronize()
    print(instr, ((out.double() - want).norm() / want.norm()).item())
# a few training steps of block-sparse FFNs at density 0.25 (where the ping-pong race showed)
ffn = torch.nn.Sequential(*[sparsegen.linear(d_in, d_out, block=(64, 64), density=0.25, device="cuda",
                                             dtype=torch.bfloat16) for d_in, d_out in [(512, 2048), (2048, 512)] * 3])
for _ in range(5):
    ffn(torch.randn(32, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)).sum().backward()
torch.cuda.synchronize()
print("trained")
"""


def test_persistent_kernels_with_many_empty_and_short_rows_finish():
    """Many tiles per persistent block, with empty and one-stage block rows next to long
    ones: a ping-pong ordering race once hung here (every consumer thread now arrives)."""
    import subprocess
    import sys

    try:
        run = subprocess.run([sys.executable, "-c", PERSISTENT_STRESS], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("a persistent kernel did not finish within 180 s (hung)")
    assert run.returncode == 0, run.stderr[-2000:]
    errors = dict(line.split() for line in run.stdout.splitlines() if line.split()[0] in ("pingpong", "tma"))
    assert set(errors) == {"pingpong", "tma"} and all(float(e) < TOLERANCE[torch.bfloat16] for e in errors.values())
    assert "trained" in run.stdout


def test_layout_without_any_block():
    layer = sparsegen.linear(128, 64, block=(32, 32), layout=torch.zeros(2, 4, dtype=torch.bool),
                             device="cuda", dtype=torch.bfloat16)
    x = torch.randn(10, 128, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(layer(x), layer.bias.expand(10, 64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_batch_dims_no_bias_and_empty_rows(dtype):
    layout = torch.rand(7, 9) < 0.3
    layout[2] = False  # an empty block row must give exactly the (absent) bias: zeros
    layer = sparsegen.linear(9 * 32, 7 * 64, block=(64, 32), layout=layout, bias=False,
                             device="cuda", dtype=dtype)
    x = torch.randn(3, 77, 9 * 32, device="cuda", dtype=dtype)
    out = run_poisoned(layer, x)
    assert not out.isnan().any()
    assert (out[..., 128:192] == 0).all()
    assert relative_error(out, reference(layer, x)) < TOLERANCE[dtype]


def test_noncontiguous_input_and_module_call():
    layer = sparsegen.linear(512, 256, block=(32, 32), density=0.3, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 300, device="cuda", dtype=torch.bfloat16).t()  # a transposed view
    out = layer(x)
    assert out.shape == (300, 256)
    assert relative_error(out, reference(layer, x)) < TOLERANCE[torch.bfloat16]


def test_module_on_gpu_matches_cpu_module():
    torch.manual_seed(0)
    layer = sparsegen.linear(256, 128, block=(16, 16), density=0.5, dtype=torch.float32)
    x = torch.randn(33, 256)
    cpu = layer(x)
    gpu = layer.to("cuda")(x.cuda()).cpu()
    assert relative_error(gpu, cpu.double()) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("rows", [(3, 333), (1, 5)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [(16, 16), (32, 64), (64, 32), (128, 128), (16, 128), (64, 64), (128, 64)],
                         ids=str)
def test_backward_matches_float64(block, dtype, rows):
    layout = torch.rand(6, 5) < 0.25  # at most SDD_MAX_DENSITY: the generated dW kernel runs
    layout[2] = False
    layer = sparsegen.linear(5 * block[1], 6 * block[0], block=block, layout=layout,
                             device="cuda", dtype=dtype)
    x = torch.randn(*rows, 5 * block[1], device="cuda", dtype=dtype, requires_grad=True)
    grad_out = torch.randn(*rows, 6 * block[0], device="cuda", dtype=dtype)
    layer(x).backward(grad_out)

    x64 = x.detach().double().requires_grad_()
    values64 = layer.values.detach().double().requires_grad_()
    bias64 = layer.bias.detach().double().requires_grad_()
    weight64 = bsr.values_to_dense(values64, layer.layout, block)
    torch.nn.functional.linear(x64, weight64, bias64).backward(grad_out.double())
    for got, want in [(x.grad, x64.grad), (layer.values.grad, values64.grad), (layer.bias.grad, bias64.grad)]:
        assert got is not None and not got.isnan().any()
        assert relative_error(got, want) < TOLERANCE[dtype]


def test_training_fits_a_teacher_with_the_same_layout():
    """A student with the teacher's layout can fit it exactly: training must get close."""
    torch.manual_seed(0)
    teacher = sparsegen.linear(256, 128, block=(32, 32), density=0.5, device="cuda", dtype=torch.bfloat16)
    student = sparsegen.linear(256, 128, block=(32, 32), layout=teacher.layout, device="cuda",
                               dtype=torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        target = teacher(x)
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss = torch.nn.functional.mse_loss(student(x).float(), target.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]


def test_torch_compile_fullgraph_on_gpu_matches_eager():
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(
        sparsegen.linear(256, 512, block=(64, 64), density=0.5, device="cuda", dtype=torch.bfloat16),
        torch.nn.GELU(), sparsegen.linear(512, 128, block=(32, 32), density=0.5, device="cuda", dtype=torch.bfloat16))
    model, twin = make(), make()
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(twin, fullgraph=True)
    x = torch.randn(4, 100, 256, device="cuda", dtype=torch.bfloat16)
    eager_out, compiled_out = model(x), compiled(x)
    assert relative_error(compiled_out, eager_out.double()) < 1e-2
    eager_out.float().square().sum().backward()
    compiled_out.float().square().sum().backward()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert relative_error(b.grad, a.grad.double()) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block", [(16, 16), (32, 64), (128, 128), (64, 16), (64, 64), (64, 128), (128, 64)],
                         ids=str)
@pytest.mark.parametrize("m", [1, 77, 4099])
def test_sdd_kernel_matches_float64(block, dtype, m):
    """The weight-gradient kernel itself (on sm_90 the wgmma one for blocks of 64 and 128),
    poisoned output, odd M; rows of up to 9 stored blocks, so work items of 256 gathered
    columns come whole, split and partial (whatever the density rule picks)."""
    mask = torch.rand(7, 9) < 0.6
    flat = bsr.flat_index(mask, "cuda")
    dy = torch.randn(m, 7 * block[0], device="cuda", dtype=dtype)
    x = torch.randn(m, 9 * block[1], device="cuda", dtype=dtype)
    out = torch.full((flat.numel(), *block), float("nan"), device="cuda", dtype=dtype)
    bsr_ops.sdd_into(out, dy, x, flat, block)
    want = bsr.gather_blocks(dy.double().t() @ x.double(), flat, block)
    assert not out.isnan().any()
    assert relative_error(out, want) < TOLERANCE[dtype]


@pytest.mark.skipif(not is_hopper(), reason="wgmma and TMA need sm_90")
@pytest.mark.parametrize("block,tile", [  # (four consumer warpgroups, warps_m 16, only for 64-row blocks)
    (block, tile) for block in [(64, 64), (64, 128), (128, 128)]
    for tile in [TileConfig(32, 8, 1, 6), TileConfig(64, 16, 1, 3), TileConfig(32, 16, 1, 6),
                 TileConfig(48, 16, 1, 4), TileConfig(48, 8, 1, 6)]
    if not (block[0] == 128 and tile.warps_m == 16)], ids=lambda v: v.tag if isinstance(v, TileConfig) else str(v))
@pytest.mark.parametrize("m", [77, 4099])
def test_sdd_hopper_tiles_match_float64(block, tile, m):
    """The wgmma dW kernel's other tiles: 32 or 48 tokens a stage, four consumer warpgroups
    gathering 512 columns at 64-row blocks. Rows of up to 13 stored blocks, so work items
    come whole, split and partial; an empty row, and a row of one block. Output poisoned
    first."""
    kern = sparsegen.launch.runtime.kernel(sparsegen.bsr.specs.sdd_spec(block, "bf16", 90, tile, "tma"), 0)
    mask = torch.rand(7, 13) < 0.6
    mask[1], mask[4] = False, torch.arange(13) == 5
    flat = bsr.flat_index(mask, "cuda")
    dy = torch.randn(m, 7 * block[0], device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 13 * block[1], device="cuda", dtype=torch.bfloat16)
    out = torch.full((flat.numel(), *block), float("nan"), device="cuda", dtype=torch.bfloat16)
    bsr_ops.sdd_into(out, dy, x, flat, block, kern)
    want = bsr.gather_blocks(dy.double().t() @ x.double(), flat, block)
    assert not out.isnan().any() and relative_error(out, want) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not is_hopper(), reason="the wide tile is the wgmma kernel's (an sm_90 GPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_weight_grad_takes_the_wide_tile_for_many_blocks(dtype):
    """Enough stored 64-row blocks for the wide dW tile (bsr_dispatch.SDD_WIDE_BLOCKS_PER_SM an SM):
    the default sdd kernel is the wide one, and it matches float64, output poisoned first."""
    sms = sparsegen.launch.runtime.sm_count(0)
    rows = cols = int((4 * bsr_dispatch.SDD_WIDE_BLOCKS_PER_SM * sms) ** 0.5) + 1  # twice enough at density 0.5
    mask = torch.rand(rows, cols) < 0.5
    flat = bsr.flat_index(mask, "cuda")
    dy = torch.randn(93, rows * 64, device="cuda", dtype=dtype)
    x = torch.randn(93, cols * 64, device="cuda", dtype=dtype)
    assert bsr_dispatch.sdd_kernel_for(dy, flat, (64, 64)).spec.tile == TileConfig(48, 16, 1, 4)
    assert bsr_dispatch.sdd_kernel_for(dy, flat[: 4 * sms], (64, 64)).spec.tile == TileConfig(64, 8, 1, 4)
    got = torch.full((flat.numel(), 64, 64), float("nan"), device="cuda", dtype=dtype)
    bsr_ops.sdd_into(got, dy, x, flat, (64, 64))
    want = bsr.gather_blocks(dy.double().t() @ x.double(), flat, (64, 64))
    assert not got.isnan().any() and relative_error(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("block, density, rows", [((16, 16), 0.5, 1100), ((32, 32), 0.6, 1025), ((32, 64), 0.7, 2000),
                                                  ((16, 16), 0.5, 1000)])
def test_small_blocks_at_high_density_forward_matches_float64(block, density, rows, dtype):
    """Blocks of 16 or 32 dense enough (bsr_dispatch.DENSE_FROM_DENSITY) over enough tokens run cuBLAS on
    the blocks scattered into a dense weight; fewer tokens keep the kernel. Either way the
    answer matches float64, with bias, into a poisoned `out` and with leading batch dims."""
    layer = sparsegen.linear(5 * block[1], 7 * block[0], block=block, density=density, device="cuda", dtype=dtype)
    assert bsr_dispatch.dense_pays(block, layer.values.shape[0], rows, layer.in_features, layer.out_features) == (rows >= 1024)
    x = torch.randn(rows, layer.in_features, device="cuda", dtype=dtype)
    out = torch.full((rows, layer.out_features), float("nan"), device="cuda", dtype=dtype)
    bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block, layer.out_features,
                out=out)
    assert not out.isnan().any() and relative_error(out, reference(layer, x)) < TOLERANCE[dtype]
    batched = layer(x.view(rows // 5, 5, layer.in_features))  # every `rows` here is a multiple of 5
    assert relative_error(batched.reshape(rows, -1), reference(layer, x)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("block", [(16, 16), (32, 32), (16, 64), (64, 16), (128, 32)], ids=str)
def test_dense_weight_kernel_writes_every_element(block, dtype):
    """The generated bsr_scatter kernel (the dense path's weight) against the mask oracle,
    with an empty block row and column; the memory it lands in was NaN just before, so a
    position it skipped would show."""
    mask = torch.rand(7, 5) < 0.5
    mask[2], mask[:, 1] = False, False
    values = torch.randn(int(mask.sum()), *block, device="cuda", dtype=dtype)
    row_offsets, col_indices = bsr.indices(mask, "cuda")
    shape = (7 * block[0], 5 * block[1])
    del_me = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    del del_me  # the caching allocator hands this block to the next allocation of its size
    got = bsr_ops.dense_weight(values, row_offsets, col_indices, shape, block)
    assert torch.equal(got, bsr.values_to_dense(values, mask, block))


def test_autocast_on_gpu_matches_float64():
    layer = sparsegen.linear(512, 256, block=(64, 64), density=0.5, device="cuda")  # float32 params
    x = torch.randn(300, 512, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference(layer, x)) < TOLERANCE[torch.bfloat16]
    out.float().sum().backward()
    assert layer.values.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_layout_change_on_gpu_keeps_forward_and_backward_right():
    torch.manual_seed(4)
    layer = sparsegen.linear(256, 384, block=(64, 32), density=0.25, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16)
    layer(x).float().sum().backward()  # kernels and TMA descriptors cached for the old layout
    sparsegen.topology.prune_and_regrow(layer, 0.5, torch.rand(layer.layout.shape))
    with torch.no_grad():
        layer.values.normal_()
    out = layer(x)
    assert relative_error(out, reference(layer, x)) < TOLERANCE[torch.bfloat16]
    layer.values.grad = None
    out.float().sum().backward()
    x64 = x.double()
    want = bsr.gather_blocks(torch.ones(200, 384, device="cuda", dtype=torch.float64).t() @ x64,
                             layer.flat_index, layer.block)
    assert relative_error(layer.values.grad, want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("make_layer, rows", [
    (lambda: sparsegen.linear(320, 192, block=(16, 16), density=0.25, device="cuda", dtype=torch.bfloat16), 300),
    (lambda: sparsegen.linear(320, 192, block=(16, 16), density=0.5, device="cuda", dtype=torch.bfloat16), 1100),
    (lambda: sparsegen.linear(512, 384, block=(64, 64), density=0.25, device="cuda", dtype=torch.bfloat16), 300),
    (lambda: sparsegen.linear(512, 384, block=(128, 128), density=0.5, device="cuda", dtype=torch.float16), 300),
    (lambda: sparsegen.Sparse24Linear(320, 192, device="cuda", dtype=torch.bfloat16), 300),
], ids=["b16", "b16-dense-forward", "b64", "b128", "2:4"])
def test_cuda_graph_replays_forward_and_backward_on_new_inputs(make_layer, rows):
    """Training steps replayed as one CUDA graph (what torch.compile's reduce-overhead mode
    and the training demo do): no host sync or allocation in the launches, and each replay,
    on fresh inputs and with its outputs poisoned first, gives the float64 answers."""
    torch.manual_seed(0)
    layer = make_layer()
    dtype = layer.values.dtype
    x = torch.randn(rows, layer.in_features, device="cuda", dtype=dtype, requires_grad=True)
    grad_out = torch.randn(rows, layer.out_features, device="cuda", dtype=dtype)
    graph, out = capture_forward_backward(layer, x, grad_out)
    weight64 = layer.to_dense_weight().double()
    for _ in fresh_replays(graph, out, layer, x, grad_out):
        x64, dy64 = x.detach().double(), grad_out.double()
        want_out = torch.nn.functional.linear(x64, weight64, layer.bias.detach().double())
        kept = as_dense(layer, torch.ones_like(layer.values)) != 0  # where the values' gradient lands
        want_dw = torch.where(kept, dy64.t() @ x64, 0.0)
        for got, want in [(out, want_out), (x.grad, dy64 @ weight64), (layer.bias.grad, dy64.sum(0)),
                          (as_dense(layer, layer.values.grad), want_dw)]:
            assert not got.isnan().any() and relative_error(got, want) < TOLERANCE[dtype]


def test_cuda_graph_capture_of_a_layout_never_run_names_the_warm_up():
    """The pairs kernels' index is built on the host once per layout, which cannot happen
    inside a capture: a clear error (the documented warm-up fixes it), not a CUDA one."""
    warm = sparsegen.linear(512, 384, block=(64, 64), density=0.5, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    warm(x)  # kernels compiled and loaded; the new layer's layout is still unseen
    fresh = sparsegen.linear(512, 384, block=(64, 64), density=0.5, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(sparsegen.InputError, match="warm-up"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fresh(x)


def as_dense(layer, values: torch.Tensor) -> torch.Tensor:
    """`values` (the layer's stored values or their gradient) laid out as the dense weight, in float64."""
    if isinstance(layer, sparsegen.BlockSparseLinear):
        return bsr.values_to_dense(values.double(), layer.layout, layer.block)
    from sparsegen.semi24 import format as semi24
    return semi24.decompress(values.double(), layer.metadata, (layer.out_features, layer.in_features))


def test_a_failed_driver_call_names_the_error():
    """The driver is called through ctypes: a failure raises LaunchError with the driver's
    own name for the status, and a module that does not load says which kernel it was."""
    from sparsegen.launch import runtime
    from sparsegen.errors import LaunchError

    with pytest.raises(LaunchError, match=r"cuExample failed: CUDA_ERROR_INVALID_VALUE \(1\)"):
        runtime._call("cuExample", 1)
    kern = runtime.kernel(sparsegen.bsr.specs.forward_spec((32, 32), "bf16", runtime.device_arch(torch.device("cuda"))), 0)
    with pytest.raises(LaunchError, match=rf"cuModuleLoadData\({kern.spec.name}\) failed: CUDA_ERROR_\w+"):
        kern._load(b"not a cubin" * 16)
