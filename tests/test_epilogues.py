"""Fused epilogues on the CPU: the reference, the gated row layout, specs and names, the
layers' fuse(), and sparsegen.patch fusing transformer blocks (the GPU kernels against
float64: tests/test_gpu_epilogues.py)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import sparsegen
from sparsegen.jit import epilogues
from sparsegen.errors import InputError, SpecError
from sparsegen.jit.spec import KernelSpec
from sparsegen.bsr.specs import forward_spec
from sparsegen.semi24.specs import sp24_spec

ACTIVATION_FORMULAS = {  # float64, written out
    "relu": lambda z: z.clamp_min(0),
    "gelu": lambda z: 0.5 * z * (1 + torch.erf(z / 2 ** 0.5)),
    "gelu_tanh": lambda z: 0.5 * z * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (z + 0.044715 * z ** 3))),
    "silu": lambda z: z * torch.sigmoid(z),
}


def formula(z: torch.Tensor, epilogue: str) -> torch.Tensor:
    """The epilogue in float64 from its definition, gate and up taken row group by row group."""
    if epilogue == "none":
        return z
    act = ACTIVATION_FORMULAS[epilogues.activation(epilogue)]
    if not epilogues.is_gated(epilogue):
        return act(z)
    groups = z.reshape(*z.shape[:-1], -1, 2, 8)
    return (act(groups[..., 0, :]) * groups[..., 1, :]).reshape(*z.shape[:-1], -1)


@pytest.mark.parametrize("epilogue", epilogues.EPILOGUES)
def test_reference_matches_the_written_out_formula(epilogue):
    z = torch.randn(3, 5, 32, dtype=torch.float64) * 3
    torch.testing.assert_close(epilogues.reference(z, epilogue), formula(z, epilogue))


@pytest.mark.parametrize("epilogue", [e for e in epilogues.EPILOGUES if not epilogues.is_gated(e)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_epilogue_is_the_reference_bit_for_bit(epilogue, dtype):
    y = torch.randn(33, 40, dtype=dtype) * 4
    expected = epilogues.reference(y.clone(), epilogue)
    assert torch.equal(epilogues.apply_in_place(y, epilogue), expected) and torch.equal(y, expected)
    with pytest.raises(InputError, match="Expected an epilogue that keeps"):
        epilogues.apply_in_place(y, "swiglu")


@pytest.mark.parametrize("epilogue", [e for e in epilogues.EPILOGUES if epilogues.is_gated(e)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gated_into_is_the_reference_within_a_rounding(epilogue, dtype):
    product = torch.randn(9, 4 * epilogues.GATE_GROUP, dtype=dtype) * 3
    expected = epilogues.reference(product.clone(), epilogue)
    y = torch.full((9, 2 * epilogues.GATE_GROUP), float("nan"), dtype=dtype)
    epilogues.gated_into(y, product, epilogue)
    ulp = 0 if dtype == torch.float64 else 2 ** -7
    assert torch.allclose(y, expected, rtol=2 * ulp, atol=1e-12 if ulp == 0 else 1e-2)
    with pytest.raises(InputError, match="Expected a gated epilogue"):
        epilogues.gated_into(y, product, "silu")


@pytest.mark.parametrize("epilogue", [e for e in epilogues.EPILOGUES if epilogues.is_gated(e)])
def test_differentiable_gated_epilogue_is_the_reference_and_its_gradient(epilogue):
    product = (torch.randn(3, 5, 6 * epilogues.GATE_GROUP, dtype=torch.float64) * 3).requires_grad_()
    out = epilogues.differentiable(product, epilogue)
    torch.testing.assert_close(out, epilogues.reference(product, epilogue), rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    got, product.grad = product.grad.clone(), None
    (epilogues.reference(product, epilogue) * weights).sum().backward()
    torch.testing.assert_close(got, product.grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda p: epilogues.differentiable(p, epilogue), (product[0, :2].detach()
                                                                                    .clone().requires_grad_(),))


def test_differentiable_gated_epilogue_refuses_partial_groups():
    with pytest.raises(InputError, match=f"multiple of {2 * epilogues.GATE_GROUP} columns"):
        epilogues.differentiable(torch.randn(2, 3 * epilogues.GATE_GROUP), "swiglu")


def test_gated_reference_rounds_once_in_the_input_dtype():
    z = torch.randn(4, 32, dtype=torch.bfloat16)
    expected = formula(z.double(), "swiglu").to(torch.bfloat16)
    torch.testing.assert_close(epilogues.reference(z, "swiglu"), expected, rtol=0, atol=0)


def test_interleave_and_split_are_inverse_and_group_by_eight():
    gate, up = torch.randn(24, 5), torch.randn(24, 5)
    fused = epilogues.interleave_rows(gate, up)
    assert torch.equal(fused[:8], gate[:8]) and torch.equal(fused[8:16], up[:8]) and torch.equal(fused[16:24], gate[8:16])
    back = epilogues.split_rows(fused)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)
    bias = epilogues.interleave_rows(torch.arange(8.0), -torch.arange(8.0))
    assert torch.equal(epilogues.split_rows(bias)[1], -torch.arange(8.0))


@pytest.mark.parametrize("gate, up", [((12, 4), (12, 4)), ((16, 4), (8, 4))])
def test_interleave_refuses_shapes_it_cannot_pair(gate, up):
    with pytest.raises(InputError, match="Expected gate and up of one shape"):
        epilogues.interleave_rows(torch.zeros(gate), torch.zeros(up))


def test_unknown_epilogue_is_refused():
    with pytest.raises(InputError, match="Expected epilogue one of"):
        epilogues.check("tanh")


@pytest.mark.parametrize("spec", [forward_spec((64, 64), "bf16", 90, epilogue="swiglu"),
                                  forward_spec((32, 32), "fp32", 80, epilogue="gelu_tanh"),
                                  sp24_spec("fp16", 80, epilogue="relu")], ids=lambda s: s.name)
def test_epilogue_round_trips_through_the_kernel_name(spec):
    assert spec.name.endswith("_e" + epilogues.name_token(spec.epilogue))
    assert KernelSpec.from_name(spec.name) == spec


def test_default_epilogue_leaves_kernel_names_as_they_were():
    assert forward_spec((64, 64), "bf16", 90).name == "bsr_dds_b64x64_bf16_nt_sm90a_swap_t256w8x1s4"


@pytest.mark.parametrize("change", [dict(op="bsr_sdd", trans="tn", block=(64, 64)), dict(trans="nn", instr="swap"),
                                    dict(op="sp24_dds", dtype="int8", block=(16, 32))])
def test_epilogue_only_on_float_forward_products(change):
    base = dict(op="bsr_dds", block=(64, 64), dtype="bf16", trans="nt", arch=90, epilogue="silu")
    with pytest.raises(SpecError, match="for an epilogue"):
        KernelSpec(**{**base, **change})


def test_name_with_unknown_epilogue_is_refused():
    with pytest.raises(SpecError, match="Expected an epilogue"):
        KernelSpec.from_name("bsr_dds_b64x64_bf16_nt_sm90a_swap_t256w8x1s4_etanh")


LAYERS = {"block": lambda: sparsegen.linear(48, 32, block=(16, 16), density=0.5, dtype=torch.float64),
          "2:4": lambda: sparsegen.Sparse24Linear(64, 32, dtype=torch.float64)}


@pytest.mark.parametrize("epilogue", epilogues.EPILOGUES)
@pytest.mark.parametrize("kind", LAYERS)
def test_fused_layer_computes_the_epilogue_of_its_product(kind, epilogue):
    layer = LAYERS[kind]()
    x = torch.randn(2, 3, layer.in_features, dtype=torch.float64)
    z = F.linear(x, layer.to_dense_weight(), layer.bias)
    y = layer.fuse(epilogue)(x)
    assert y.shape == (2, 3, layer.output_features)
    torch.testing.assert_close(y, formula(z.detach(), epilogue))
    torch.testing.assert_close(layer.to_linear()(x), y)


@pytest.mark.parametrize("kind", LAYERS)
def test_fused_layer_trains_through_the_unfused_math(kind):
    layer = LAYERS[kind]().fuse("swiglu")
    x = torch.randn(5, layer.in_features, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()
    got = layer.values.grad.clone(), x.grad.clone()
    layer.values.grad = x.grad = None
    layer.epilogue = "none"
    epilogues.reference(layer(x), "swiglu").sum().backward()
    torch.testing.assert_close(got, (layer.values.grad, x.grad))


def test_gated_fuse_needs_whole_row_groups():
    """Every shipped layer has out_features in 16s (blocks of 16 or more, mma.sp tiles), so the
    rule is shown on a layer of 8 rows as a new layout could make one."""
    class EightRows(epilogues.Fusable):
        out_features = 8
    with pytest.raises(InputError, match="out_features a multiple of 16"):
        EightRows().fuse("swiglu")
    assert EightRows().fuse("relu").epilogue == "relu"


def tiny_llama():
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=50)
    return LlamaForCausalLM(config).eval()


def logits(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def test_patch_fuses_a_llama_mlp_into_one_gated_layer_with_the_same_2_4_result():
    torch.manual_seed(0)
    fused, plain = tiny_llama(), tiny_llama()
    plain.load_state_dict(fused.state_dict())
    rules = {r".*mlp\.(gate|up|down)_proj": {"sparsity": "2:4"}}
    names = sparsegen.patch(fused, rules)
    sparsegen.patch(plain, rules, fuse=False)
    mlp = fused.model.layers[1].mlp
    assert isinstance(mlp, sparsegen.GatedMLP) and mlp.gate_up.epilogue == "swiglu"
    assert mlp.gate_up.out_features == 2 * 96 and "model.layers.1.mlp.gate_up" in names
    assert names.fused["model.layers.1.mlp.gate_up"] == ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    assert all(isinstance(fused.get_submodule(name), torch.nn.Module) for name in names)  # (the names as they are now)
    ids = torch.randint(0, 50, (2, 9))
    torch.testing.assert_close(logits(fused, ids), logits(plain, ids))  # 2:4 masks are per row: the same


def test_patched_gated_block_sparse_llama_matches_its_dense_copy():
    torch.manual_seed(1)
    model = tiny_llama()
    sparsegen.patch(model, {r".*mlp\.(gate|up)_proj": {"block": (16, 16), "density": 0.5}})
    assert model.model.layers[0].mlp.gate_up.values.shape[0] == int(0.5 * 12 * 4)
    ids = torch.randint(0, 50, (3, 5))
    torch.testing.assert_close(logits(model, ids), logits(sparsegen.dense_copy(model), ids))


def test_gate_and_up_under_different_rules_stay_apart():
    model = tiny_llama()
    sparsegen.patch(model, {r".*gate_proj": {"sparsity": "2:4"}, r".*up_proj": {"block": (16, 16)}})
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


@pytest.mark.parametrize("build, pattern, act_path", [
    (lambda: BertModel(BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=50)), r".*intermediate\.dense", ("encoder.layer.1.intermediate", "gelu")),
    (lambda: GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=50, bos_token_id=0,
                                        eos_token_id=0)), r".*mlp\.c_fc", ("transformer.h.1.mlp", "gelu_tanh")),
])
def test_patch_fuses_the_mlp_activation_with_the_same_result(build, pattern, act_path):
    torch.manual_seed(2)
    fused, plain = build().eval(), build().eval()
    plain.load_state_dict(fused.state_dict())
    rules = {pattern: {"block": (16, 16), "density": 0.5}}
    sparsegen.patch(fused, rules)
    sparsegen.patch(plain, rules, fuse=False)
    parent, act = act_path
    assert any(getattr(m, "epilogue", None) == act for m in fused.get_submodule(parent).children())
    ids = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(logits(fused, ids), logits(plain, ids))
    torch.testing.assert_close(logits(fused, ids), logits(sparsegen.dense_copy(fused), ids))


def test_compiled_fused_layers_match_eager():
    """The ops carry the epilogue through torch.compile: shapes from the fake, values from the
    reference (CPU)."""
    model = torch.nn.Sequential(sparsegen.linear(64, 64, block=(16, 16)).fuse("geglu"),
                                sparsegen.Sparse24Linear(32, 32).fuse("relu"))
    x = torch.randn(3, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, fullgraph=True)(x), model(x))


def test_differentiable_gated_epilogue_compiles_to_the_eager_gradient():
    product = torch.randn(7, 4 * epilogues.GATE_GROUP, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(7, 2 * epilogues.GATE_GROUP, dtype=torch.float64)
    compiled = torch.compile(lambda p: (epilogues.differentiable(p, "swiglu") * weights).sum(), fullgraph=True)
    compiled(product).backward()
    got, product.grad = product.grad.clone(), None
    (epilogues.reference(product, "swiglu") * weights).sum().backward()
    torch.testing.assert_close(got, product.grad, rtol=1e-12, atol=1e-12)


def test_differentiable_gated_epilogue_runs_given_kernels_and_keeps_only_the_product():
    """With kernels (as layers pass the GPU's gated_product): each called once with the
    product and the activation, the backward's result y's gradient."""
    product = (torch.randn(5, 4 * epilogues.GATE_GROUP, dtype=torch.float64) * 3).requires_grad_()
    seen = []

    def forward(y, act):
        seen.append(("forward", act))
        return epilogues.reference(y, "swiglu")

    def gradient(dh, y, act):
        seen.append(("gradient", act))
        with torch.enable_grad():
            wide = y.detach().requires_grad_()
            return torch.autograd.grad(epilogues.reference(wide, "swiglu"), wide, dh)[0]

    weights = torch.randn(5, 2 * epilogues.GATE_GROUP, dtype=torch.float64)
    (epilogues.differentiable(product, "swiglu", (forward, gradient)) * weights).sum().backward()
    got, product.grad = product.grad.clone(), None
    (epilogues.reference(product, "swiglu") * weights).sum().backward()
    torch.testing.assert_close(got, product.grad, rtol=1e-12, atol=1e-12)
    assert seen == [("forward", "silu"), ("gradient", "silu")]


def test_gated_kernels_are_for_gated_16_bit_cuda_products_only(monkeypatch):
    from sparsegen import layer
    from sparsegen.semi24 import ops

    assert layer.gated_kernels(torch.randn(2, 32, dtype=torch.bfloat16), "swiglu") is None  # (CPU)
    assert layer.gated_kernels(torch.randn(2, 32, dtype=torch.bfloat16), "gelu") is None
    # where the product is one the kernels take (a covered GPU's, here pretended): the pair,
    # unless switched off
    monkeypatch.setattr(layer.calls, "runs_16bit_kernels", lambda t: True)
    y = torch.randn(2, 32, dtype=torch.bfloat16)
    assert layer.gated_kernels(y, "swiglu") == (ops.gated_product, ops.gated_product_grad)
    assert layer.gated_kernels(y, "gelu") is None
    monkeypatch.setenv("SPARSEGEN_GATED_KERNEL", "0")
    assert layer.gated_kernels(y, "geglu") is None


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_gated_product_kernel_is_16_bit_only(dtype):
    from sparsegen.semi24.specs import gated_product_spec

    with pytest.raises(SpecError, match="Expected a 16-bit dtype for gated_product"):
        gated_product_spec(dtype, 80, True).validate()


def test_a_second_backward_through_given_kernels_raises_instead_of_reading_zeros():
    product = torch.randn(2, 2 * epilogues.GATE_GROUP, dtype=torch.float64, requires_grad=True)
    kernels = (lambda y, act: epilogues.reference(y, "swiglu"), lambda dh, y, act: torch.ones_like(y))
    weights = torch.randn(2, epilogues.GATE_GROUP, dtype=torch.float64, requires_grad=True)
    out = (epilogues.differentiable(product, "swiglu", kernels) * weights).sum()
    (grad,) = torch.autograd.grad(out, product, create_graph=True)  # (dH = weights: it has a gradient)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


def test_the_gated_kernels_refuse_what_they_cannot_read_before_any_launch():
    from sparsegen.semi24 import ops

    with pytest.raises(InputError, match="Expected a 16-bit CUDA product"):
        ops.gated_product(torch.randn(4, 32, dtype=torch.bfloat16), "silu")  # (a CPU tensor)
    with pytest.raises(InputError, match="Expected a gate activation"):
        ops.gated_product(torch.randn(4, 32, dtype=torch.bfloat16), "relu")
    with pytest.raises(InputError, match="Expected a 16-bit CUDA product"):
        ops.gated_product_grad(torch.randn(4, 8), torch.randn(4, 16), "gelu")
