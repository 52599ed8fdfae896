"""Fused epilogues on the GPU: every forward kernel family, each epilogue, against float64,
outputs poisoned first; the layers through the dispatch, torch.compile and CUDA graphs."""
import pytest
import torch

import sparsegen
from sparsegen.jit import epilogues, registry
from sparsegen.jit.spec import TileConfig
from sparsegen.semi24 import ops as sp24_ops
from sparsegen.bsr import ops as bsr_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FUSED = [e for e in epilogues.EPILOGUES if e != "none"]
TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 6e-3, torch.float32: 2e-3}


def is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def want(x, weight, bias, epilogue):
    """The epilogue of X W^T + b, all in float64."""
    z = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return epilogues.reference(z, epilogue)


def poisoned(m: int, n: int, dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)


# (instr, block, dtype): every family of the block-sparse forward
BSR_FAMILIES = [("mma", (32, 32), torch.float16), ("mma", (64, 16), torch.float32)]
if is_hopper():
    BSR_FAMILIES += [("wgmma", (16, 16), torch.bfloat16), ("tma", (128, 128), torch.bfloat16),
                     ("pingpong", (64, 64), torch.float16), ("swap", (128, 64), torch.bfloat16),
                     ("swap", (64, 64), torch.bfloat16), ("pairs", (64, 64), torch.bfloat16)]


@pytest.mark.parametrize("m", [1, 65, 517])
@pytest.mark.parametrize("epilogue", FUSED)
@pytest.mark.parametrize("family", BSR_FAMILIES, ids=lambda f: f"{f[0]}-{f[1][0]}x{f[1][1]}-{str(f[2])[6:]}")
def test_block_sparse_kernel_epilogue_matches_float64(family, epilogue, m):
    instr, block, dtype = family
    layer = sparsegen.linear(256, 5 * block[0], block=block, density=0.5, device="cuda", dtype=dtype)
    x = torch.randn(m, layer.in_features, device="cuda", dtype=dtype)
    width = epilogues.output_features(epilogue, layer.out_features)
    out = poisoned(m, width, dtype)
    tile = None  # the default tile for m; the swap family has one for any m
    if instr in ("swap", "pairs"):
        tile = TileConfig(256, 8, 1, 4)
    bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block, layer.out_features,
                out=out, instr=instr, tile=tile, epilogue=epilogue)
    assert not out.isnan().any()
    assert relative_error(out, want(x, layer.to_dense_weight(), layer.bias, epilogue)) < TOLERANCE[dtype]


SP24_INSTRS = ["mma", "tma"] if is_hopper() else ["mma"]


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("m", [1, 7, 65, 200, 2049])
@pytest.mark.parametrize("epilogue", FUSED)
@pytest.mark.parametrize("instr", SP24_INSTRS)
def test_sp24_kernel_epilogue_matches_float64(instr, epilogue, m, splits):
    """Both stores: the registers' (one split) and the split-K finish (the last split)."""
    dtype = torch.bfloat16
    n, k = 336, 384
    sparse = sparsegen.to_sparse24(torch.randn(n, k, device="cuda", dtype=dtype))
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    out = poisoned(m, epilogues.output_features(epilogue, n), dtype)
    sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, bias, n, out=out, instr=instr, splits=splits, epilogue=epilogue)
    assert not out.isnan().any()
    assert relative_error(out, want(x, sparse.to_dense(), bias, epilogue)) < TOLERANCE[dtype]


def sp24_layer(epilogue):
    return sparsegen.Sparse24Linear(320, 192, device="cuda", dtype=torch.bfloat16).fuse(epilogue)


def bsr_layer(epilogue):
    return sparsegen.linear(320, 192, block=(64, 64), density=0.5, device="cuda", dtype=torch.bfloat16).fuse(epilogue)


LAYERS = {"2:4": sp24_layer, "block": bsr_layer}


@pytest.mark.parametrize("epilogue", ["gelu", "swiglu"])
@pytest.mark.parametrize("kind", LAYERS)
def test_fused_layer_through_the_default_dispatch(kind, epilogue):
    layer = LAYERS[kind](epilogue)
    for shape in [(1, 320), (8, 320), (3, 100, 320), (4097, 320)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            y = layer(x)
        assert y.shape == (*shape[:-1], layer.output_features)
        assert relative_error(y, want(x, layer.to_dense_weight(), layer.bias, epilogue)) < 1.5e-2


@pytest.mark.parametrize("epilogue", ["swiglu", "gelu_tanh"])  # a gated one; one applied in place
@pytest.mark.parametrize("kind", LAYERS)
def test_dense_path_applies_the_epilogue_too(dense_everywhere, kind, epilogue):
    layer = LAYERS[kind](epilogue)
    x = torch.randn(37, 320, device="cuda", dtype=torch.bfloat16)
    out = poisoned(37, layer.output_features, torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
        if kind == "2:4":
            sp24_ops.sp24_dds(x, layer.values, layer.metadata, layer.bias, layer.out_features, out=out, epilogue=epilogue)
        else:
            bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block,
                        layer.out_features, out=out, epilogue=epilogue)
    reference = want(x, layer.to_dense_weight(), layer.bias, epilogue)
    assert relative_error(y, reference) < 1.5e-2 and relative_error(out, reference) < 1.5e-2


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_patched_llama_with_fused_mlps_compiles_and_matches_its_dense_copy(mode):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    sparsegen.patch(model, {r".*mlp\.(gate|up)_proj": {"sparsity": "2:4"},
                            r".*mlp\.down_proj": {"block": (64, 64), "density": 0.5}})
    assert isinstance(model.model.layers[0].mlp, sparsegen.GatedMLP)
    twin = sparsegen.dense_copy(model)
    ids = torch.randint(0, 128, (2, 96), device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(model, mode=mode)
    with torch.no_grad():
        for _ in range(3):  # warm-up, recording, replay
            got = compiled(input_ids=ids).logits
        expected = twin(input_ids=ids).logits
    assert relative_error(got.float(), expected.double()) < 2e-2


GATE_FORMULAS = {"silu": lambda g: g * torch.sigmoid(g), "gelu": lambda g: 0.5 * g * (1 + torch.erf(g / 2 ** 0.5))}


def gated_float64(y: torch.Tensor, dh: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(gate) * up of an interleaved product and its gradient dY at dH, by autograd in float64."""
    wide = y.double().requires_grad_()
    groups = wide.reshape(*wide.shape[:-1], -1, 2, epilogues.GATE_GROUP)
    h = (GATE_FORMULAS[act](groups[..., 0, :]) * groups[..., 1, :]).reshape(*wide.shape[:-1], -1)
    h.backward(dh.double())
    return h.detach(), wide.grad


@pytest.mark.parametrize("shape", [(1, 16), (37, 48), (3, 67, 96), (4099, 1024)])
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_product_kernel_and_its_gradient_match_float64(dtype, act, shape):
    """Both modes of the gated_product kernel into outputs poisoned first, on fresh inputs."""
    y = torch.randn(shape, device="cuda", dtype=dtype) * 3
    dh = torch.randn(*shape[:-1], shape[-1] // 2, device="cuda", dtype=dtype)
    want_h, want_dy = gated_float64(y, dh, act)
    h, dy = torch.full_like(dh, float("nan")), torch.full_like(y, float("nan"))
    sp24_ops._launch_gated(y, None, h, act, sp24_ops._FORWARD)
    sp24_ops._launch_gated(y, dh, dy, act, sp24_ops._BACKWARD)
    assert not h.isnan().any() and not dy.isnan().any()
    assert relative_error(h, want_h) < TOLERANCE[dtype] / 4 and relative_error(dy, want_dy) < TOLERANCE[dtype] / 4


def test_gated_product_kernel_takes_unaligned_and_strided_inputs():
    """Views that start off a 16-byte boundary or skip columns are copied, not read astray."""
    base = torch.randn(40, 4 * 34 + 1, device="cuda", dtype=torch.bfloat16)
    y = base[:, 1:1 + 4 * 32]  # misaligned and strided: 128 of every row's 137 columns
    dh = torch.randn(40, 130, device="cuda", dtype=torch.bfloat16)[:, 2:66]
    want_h, want_dy = gated_float64(y, dh, "silu")
    assert relative_error(sp24_ops.gated_product(y, "silu"), want_h) < 4e-3
    assert relative_error(sp24_ops.gated_product_grad(dh, y, "silu"), want_dy) < 4e-3


@pytest.mark.parametrize("epilogue", ["swiglu", "geglu"])
@pytest.mark.parametrize("kind", LAYERS)
def test_gated_layer_trains_on_the_kernel_as_on_pytorch_ops(kind, epilogue, monkeypatch):
    """A gated layer's training step: the kernel (called, counted) and PyTorch's ops
    (SPARSEGEN_GATED_KERNEL=0) both give float64's output and gradients."""
    layer = LAYERS[kind](epilogue).train()
    x = torch.randn(3, 45, 320, device="cuda", dtype=torch.bfloat16)
    weights = torch.randn(3, 45, layer.output_features, device="cuda", dtype=torch.float64)
    reference = x.double().requires_grad_()
    (want(reference, layer.to_dense_weight(), layer.bias, epilogue) * weights).sum().backward()
    calls = []
    forward = sp24_ops.KIT_KERNELS["gated_product"]
    monkeypatch.setitem(sp24_ops.KIT_KERNELS, "gated_product", lambda *a: calls.append(a) or forward(*a))
    monkeypatch.setattr(registry, "_KIT_KERNELS", {})
    for switch in ("1", "0"):
        monkeypatch.setenv("SPARSEGEN_GATED_KERNEL", switch)
        given = x.clone().requires_grad_()
        (layer(given).double() * weights).sum().backward()
        assert relative_error(given.grad, reference.grad) < 2e-2, switch
    assert len(calls) == 1


def test_gated_product_grad_refuses_a_gradient_of_another_shape_or_dtype():
    y = torch.randn(5, 32, device="cuda", dtype=torch.bfloat16)
    for dh in (torch.randn(5, 8, device="cuda", dtype=torch.bfloat16), torch.randn(5, 16, device="cuda")):
        with pytest.raises(sparsegen.errors.InputError, match="Expected dH of shape"):
            sp24_ops.gated_product_grad(dh, y, "silu")
