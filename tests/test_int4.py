"""Int4Sparse24Linear (W4A16 2:4): the 4-bit storage the kernel reads, round-to-nearest group
quantization, the layer against a float64 product of its dequantized weight, state and errors.
CPU here; tests/test_gpu_int4.py runs the sp24_w4 kernels."""
import copy
import io

import pytest
import torch
from torch import nn

import sparsegen
from sparsegen.errors import InputError
from sparsegen.jit import epilogues
from sparsegen.semi24 import format as semi24
from sparsegen.semi24 import int4
from sparsegen.semi24.int4_nn import Int4Sparse24Linear, w4_reference


def relative_error(got, want) -> float:
    return float((got.detach().double() - want).norm() / want.norm())


def make_layer(k=256, n=48, group_size=128, dtype=torch.bfloat16, bias=True):
    linear = nn.Linear(k, n, bias=bias, dtype=dtype)
    return Int4Sparse24Linear.from_dense(linear, group_size), linear


def test_each_lane_word_holds_the_fragment_the_kernel_reads():
    """Word l of line (R, t): nibble h + 2c + 4p is row 16R + 8h + l // 4, kept column
    16t + 8c + 2(l % 4) + p (mma.sp's A fragment of lane l), element by element."""
    q = torch.randint(0, 16, (48, 80), dtype=torch.uint8)
    words = int4.pack(q)
    assert words.shape == (3, 5, 32) and words.dtype == torch.int32
    for rows16, tile, lane in [(0, 0, 0), (2, 4, 31), (1, 3, 13)]:
        word = int(words[rows16, tile, lane]) & 0xFFFFFFFF
        for h in range(2):
            for c in range(2):
                for p in range(2):
                    row, col = 16 * rows16 + 8 * h + lane // 4, 16 * tile + 8 * c + 2 * (lane % 4) + p
                    assert (word >> 4 * (h + 2 * c + 4 * p)) & 0xF == q[row, col]
    assert torch.equal(int4.unpack(words), q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, group", [(256, 128), (384, 256), (96, 96)])  # 384 / 256: a partial last group
def test_quantization_rounds_to_nearest_by_the_rounded_group_scale(dtype, k, group):
    kept = torch.randn(32, k // 2, dtype=dtype) * torch.rand(32, 1, dtype=dtype).add(0.1)
    q, scales = int4.quantize(kept, group, dtype)
    assert scales.dtype == dtype and scales.shape == (-(-k // group), 32)
    per_value = scales.t().float().repeat_interleave(group // 2, dim=1)[:, :k // 2]
    want = (kept.float() / per_value).round().clamp(-8, 7) + 8
    assert torch.equal(q.float(), want)
    back = int4.dequantize(q, scales, group)
    assert back.dtype == dtype
    # half a step, plus the product's rounding to dtype (|q s| <= 8 s, half an ulp: s / 64 in
    # bf16) and a scale rounded below largest / 7 (the largest value clamps to 7: ~s / 36)
    assert ((back.float() - kept.float()).abs() <= per_value * (0.5 + 1 / 16)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5)])
def test_forward_matches_float64_of_the_dequantized_weight(dtype, group_size, shape):
    layer, linear = make_layer(k=384, n=80, group_size=group_size, dtype=dtype)
    x = torch.randn(*shape, 384, dtype=dtype)
    want = w4_reference(x.reshape(-1, 384), layer.qweight, layer.metadata, layer.scales, layer.bias,
                        layer.group_size, "none").reshape(*shape, 80)
    # the same product from the dense linear by the rule written out here: magnitude 2:4, then
    # per row and group the kept values rounded to the nearest multiple of (largest / 7, in dtype)
    pruned = linear.weight.detach().double() * semi24.magnitude_mask(linear.weight.detach())
    group = 384 if group_size == -1 else group_size
    by_group = pruned.reshape(80, -1, group)
    step = (by_group.abs().amax(-1, keepdim=True) / 7).to(dtype).double()
    weight = ((by_group / step).round().clamp(-8, 7) * step).to(dtype).double().reshape(80, 384)
    assert torch.equal(layer.to_dense_weight().double(), weight)
    want_too = x.double() @ weight.t() + linear.bias.double()
    assert torch.allclose(want, want_too.reshape(want.shape))
    y = layer(x)
    assert y.dtype == dtype and y.shape == (*shape, 80)
    assert relative_error(y, want) < 1e-2


def test_the_dequantized_weight_is_2_4_and_near_the_pruned_one():
    layer, linear = make_layer(k=256, n=32)
    w = layer.to_dense_weight()
    assert ((w.reshape(32, -1, 4) != 0).sum(-1) <= 2).all()
    pruned = sparsegen.Sparse24Linear.from_dense(linear).to_dense_weight().float()
    assert relative_error(w, pruned.double()) < 0.12  # 4-bit round to nearest: ~8% of the weight's norm


def test_float32_inputs_are_computed_in_the_layer_dtype_and_returned_in_float32():
    layer, _ = make_layer()
    x = torch.randn(4, 256)
    y = layer(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, layer(x.to(torch.bfloat16)).float())


@pytest.mark.parametrize("epilogue", ["gelu", "swiglu"])
def test_fused_epilogues_match_float64(epilogue):
    layer, _ = make_layer(n=64)
    layer.fuse(epilogue)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    want = epilogues.reference(x.double() @ layer.to_dense_weight().double().t() + layer.bias.double(), epilogue)
    assert layer(x).shape == (5, epilogues.output_features(epilogue, 64))
    assert relative_error(layer(x), want) < 1e-2
    assert relative_error(sparsegen.dense_copy(layer)(x), want) < 1e-2


def test_state_dict_copy_and_save_round_trip():
    layer, _ = make_layer()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    other, _ = make_layer()
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other(x), layer(x))
    assert torch.equal(copy.deepcopy(layer)(x), layer(x))
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    other, _ = make_layer()
    other.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(other(x), layer(x))


@pytest.mark.parametrize("name, broken, message", [
    ("metadata", lambda t: torch.full_like(t, -1), "two increasing positions"),
    ("scales", lambda t: -t, "finite scales above 0"),
    ("scales", lambda t: t.clone().fill_(float("nan")), "finite scales above 0"),
    ("scales", lambda t: t[:, :16].clone(), "scales bfloat16 or float16 of shape"),
    ("qweight", lambda t: t.float(), "qweight int32 of shape")])
def test_a_broken_checkpoint_is_refused_before_anything_is_copied(name, broken, message):
    layer, _ = make_layer()
    before = {key: t.clone() for key, t in layer.state_dict().items()}
    state = layer.state_dict()
    state[name] = broken(state[name])
    with pytest.raises(InputError, match=message):
        make_layer()[0].load_state_dict(state)
    with pytest.raises(InputError, match=message):
        layer.load_state_dict(state)
    assert all(torch.equal(before[key], t) for key, t in layer.state_dict().items())


@pytest.mark.parametrize("call, message", [
    (lambda: make_layer(group_size=100), "group_size a positive multiple of 128, or -1"),
    (lambda: make_layer(k=200), "columns of 32"),
    (lambda: make_layer()[0](torch.randn(2, 255, dtype=torch.bfloat16)), r"input of shape \(..., 256\)"),
    (lambda: make_layer()[0](torch.randn(2, 256, dtype=torch.float16)), "input in torch.bfloat16"),
    (lambda: sparsegen.linear(128, 256, sparsity="2:4", weight_dtype="int8", group_size=128),
     "group_size only with weight_dtype='int4'")])
def test_bad_input_errors(call, message):
    with pytest.raises(InputError, match=message):
        call()


def test_linear_and_patch_build_4_bit_layers():
    layer = sparsegen.linear(256, 64, sparsity="2:4", weight_dtype="int4", dtype=torch.float16)
    assert isinstance(layer, Int4Sparse24Linear) and layer.scales.dtype == torch.float16 and layer.group_size == 128
    model = nn.Sequential(nn.Linear(256, 512, dtype=torch.bfloat16), nn.ReLU(), nn.Linear(512, 128, dtype=torch.bfloat16))
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    sparsegen.patch(model, {"0": {"sparsity": "2:4", "weight_dtype": "int4"}, "2": {"sparsity": "2:4", "group_size": -1}})
    assert isinstance(model[0], Int4Sparse24Linear) and isinstance(model[2], Int4Sparse24Linear)
    assert model[2].group_size == 512 and model[0].group_size == 128
    twin = sparsegen.dense_copy(model)
    assert relative_error(model(x), twin(x).double()) < 1e-2


def test_gated_pair_keeps_each_projections_values_and_scales():
    gate, _ = make_layer(n=64)
    up, _ = make_layer(n=64)
    fused = Int4Sparse24Linear.gated_pair(gate, up, "swiglu")
    assert fused.epilogue == "swiglu" and fused.output_features == 64
    assert torch.equal(fused.to_dense_weight(), epilogues.interleave_rows(gate.to_dense_weight(), up.to_dense_weight()))
    x = torch.randn(6, 256, dtype=torch.bfloat16)
    g = x.double() @ gate.to_dense_weight().double().t() + gate.bias.double()
    u = x.double() @ up.to_dense_weight().double().t() + up.bias.double()
    assert relative_error(fused(x), torch.nn.functional.silu(g) * u) < 1e-2
    assert Int4Sparse24Linear.gated_pair(gate, make_layer(n=64, group_size=-1)[0], "swiglu") is None


def test_the_layer_is_one_op_under_torch_compile_fullgraph():
    """Dynamo traces the checks and calls sparsegen::sp24_w4_linear (shapes from its fake):
    the compiled model's output is eager's, a gated epilogue's width too."""
    model = nn.Sequential(make_layer(n=128)[0].fuse("geglu"), make_layer(k=64, n=32)[0])
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.compile(model, fullgraph=True)(x), model(x))


@pytest.mark.parametrize("m, n, k, tile_rows, kwarps, splits", [
    (1, 4096, 4096, 128, 2, 8),      # narrow: 32 tiles of 128 rows, two blocks per SM -> 8 splits
    (16, 28672, 8192, 256, 1, 2),    # wide: 112 tiles of 256 rows -> 2 splits
    (8, 1024, 4096, 128, 2, 8),      # narrow k/v: 8 tiles; 33 would split K in one-stage slices -> 8 (4 stages each)
    (64, 4096, 4096, 128, 2, 4),     # 33-128 tokens: one block per SM -> 4 splits
    (64, 28672, 8192, 256, 1, 1)])
def test_decode_tiles_and_k_splits_follow_the_weights_width(m, n, k, tile_rows, kwarps, splits, monkeypatch):
    """sp24_w4's rules on a 132-SM GPU (the H200 sweep's choices): narrow weights take 128-row
    tiles with k-warps, 1-32 tokens keep 4 stages a split, and 33-128 tokens split K for one
    block per SM, not two."""
    from sparsegen.launch import runtime
    from sparsegen.semi24 import dispatch
    from sparsegen.semi24.specs import sp24_w4_spec, w4_narrow, w4_rows_bucket, w_rows

    monkeypatch.setattr(runtime, "sm_count", lambda index: 132)
    spec = sp24_w4_spec("bf16", 90, rows=w4_rows_bucket(m), narrow=w4_narrow(n, 132))
    assert (w_rows(spec), spec.param_values["kwarps"], spec.threads) == (tile_rows, kwarps, spec.tile.threads * kwarps)
    assert dispatch.grid(spec, m, k, n, 0, None)[0] == (-(-n // tile_rows), -(-m // spec.tile.tile_m), splits)


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "swiglu"])
def test_input_gradient_of_a_frozen_4_bit_layer(epilogue, mode):
    """Layers around a frozen 4-bit layer train (QLoRA-style): x's gradient is dP W (W
    dequantized, dP the epilogue's gradient at the product), the layer's tensors get none."""
    layer, _ = make_layer()
    layer.fuse(epilogue)
    x = torch.randn(2, 5, 256, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 5, epilogues.output_features(epilogue, 48), dtype=torch.float64)
    run = layer if mode == "eager" else torch.compile(layer, fullgraph=True)
    run(x).backward(dy.to(torch.bfloat16))
    weight = layer.to_dense_weight().double()
    product = (x.detach().double() @ weight.t() + layer.bias.double()).requires_grad_()
    d_product, = torch.autograd.grad(epilogues.reference(product, epilogue), product, dy)
    assert relative_error(x.grad, d_product @ weight) < 2e-2
    assert not any(t.requires_grad for t in (layer.qweight, layer.scales, layer.bias))


def test_8_token_tiles_are_sp24_w4s_alone():
    """OpRules.tile_m_step: the 4-bit kernel's decode tiles may hold 8 tokens (one n8 step of
    mma.sp a W tile); every other kernel keeps tile_m a multiple of 16, and says which op asked."""
    from sparsegen.errors import SpecError
    from sparsegen.jit.spec import TileConfig
    from sparsegen.semi24.specs import sp24_spec, sp24_w4_spec

    assert sp24_w4_spec("bf16", 90, TileConfig(8, 4, 1, 6)).tile.tile_m == 8
    with pytest.raises(SpecError, match="tile_m a multiple of 8.* Got 12"):
        sp24_w4_spec("bf16", 90, TileConfig(12, 4, 1, 6))
    with pytest.raises(SpecError, match="tile_m a multiple of 16 for sp24_dds. Got 8"):
        sp24_spec("bf16", 80, TileConfig(8, 4, 1, 6), instr="mma")
