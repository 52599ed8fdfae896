"""Inductor lowerings (sparsegen/inductor.py): a compiled graph calls the launchers itself,
into buffers of its own, and computes what eager mode computes."""
import pytest
import torch
from torch._inductor import config
from torch._inductor.utils import run_and_get_code

import sparsegen
from sparsegen.semi24.scaled import dequantized


def compiled_code(layer, x):
    """(output, Inductor's generated source) of a fresh compile of layer(x)."""
    torch._dynamo.reset()
    with torch.no_grad(), config.patch(force_disable_caches=True):
        return run_and_get_code(torch.compile(layer, fullgraph=True), x)


def scaled(bias: bool, weight_dtype: str = "e4m3"):
    dense = torch.nn.Linear(128, 48, bias=bias, dtype=torch.bfloat16)
    return sparsegen.ScaledSparse24Linear.from_dense(dense, weight_dtype)


LAYERS = {
    "block-sparse": lambda bias: sparsegen.linear(96, 48, block=(16, 16), density=0.5, bias=bias),
    "2:4": lambda bias: sparsegen.Sparse24Linear(64, 48, bias=bias),
    "scaled-e4m3": lambda bias: scaled(bias),
    "scaled-int8": lambda bias: scaled(bias, "int8"),
    "int4": lambda bias: sparsegen.Int4Sparse24Linear.from_dense(torch.nn.Linear(128, 48, bias=bias,
                                                                                 dtype=torch.bfloat16)),
}
SIXTEEN_BIT_INPUT = ("scaled-e4m3", "scaled-int8", "int4")
# A graph input is no kernel Inductor computes: the scaled layers quantize it in their launcher
LAUNCHERS = {"block-sparse": "sparsegen_bsr_dds", "2:4": "sparsegen_sp24_dds",
             "scaled-e4m3": "sparsegen_sp24_scaled_linear", "scaled-int8": "sparsegen_sp24_scaled_linear",
             "int4": "sparsegen_sp24_w4_linear"}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", LAYERS)
def test_compiled_graph_calls_the_launcher_into_its_own_buffer(kind, bias):
    layer = LAYERS[kind](bias)
    x = torch.randn(3, 5, layer.in_features, dtype=torch.bfloat16 if kind in SIXTEEN_BIT_INPUT else torch.float32)
    got, (source, *_) = compiled_code(layer, x)
    missing = ('' if bias else '_no_bias') + ('_no_input_scale' if kind.startswith("scaled") else '')
    assert f"extern_kernels.{LAUNCHERS[kind]}{missing}(" in source, source
    assert "torch.ops.sparsegen" not in source
    with torch.no_grad():
        torch.testing.assert_close(got, layer(x))


class NormThenScaled(torch.nn.Module):
    """A norm, then a scaled layer: the norm's kernel quantizes (as in a decoder layer)."""

    def __init__(self, layer):
        super().__init__()
        self.norm, self.layer = torch.nn.RMSNorm(layer.in_features, dtype=torch.bfloat16), layer

    def forward(self, x):
        return self.layer(self.norm(x))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("weight_dtype", ["e4m3", "int8"])
def test_scaled_layer_after_a_norm_quantizes_in_the_norms_kernel(weight_dtype, static):
    dense = torch.nn.Linear(128, 48, dtype=torch.bfloat16)
    layer = sparsegen.ScaledSparse24Linear.from_dense(dense, weight_dtype, input_scale=0.05 if static else None)
    model = NormThenScaled(layer)
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    got, (source, *_) = compiled_code(model, x)
    assert "extern_kernels.sparsegen_sp24_scaled_dds(" in source, source
    assert "sparsegen_sp24_scaled_linear" not in source and "torch.ops.sparsegen" not in source
    with torch.no_grad():  # float64 of the stored weight times the norm's output
        weight = dequantized(layer.values, layer.metadata, layer.weight_scale).double()
        reference = model.norm(x).double() @ weight.t() + layer.bias.double()
        error = lambda y: float((y.double() - reference).norm() / reference.norm())
        # Inductor quantizes the norm's float32 result, eager mode its bf16 rounding: tokens
        # differ by a step of the one-byte type here and there, the error stays as small
        assert error(got) < 1.5 * error(model(x)) + 1e-3, (error(got), error(model(x)))


@pytest.mark.parametrize("bias", [True, False])
def test_static_scale_on_a_graph_input_reaches_the_launcher(bias):
    dense = torch.nn.Linear(128, 48, bias=bias, dtype=torch.bfloat16)
    layer = sparsegen.ScaledSparse24Linear.from_dense(dense, "int8", input_scale=0.03)
    x = torch.randn(7, 128, dtype=torch.bfloat16)
    got, (source, *_) = compiled_code(layer, x)
    assert f"extern_kernels.sparsegen_sp24_scaled_linear{'' if bias else '_no_bias'}(" in source, source
    with torch.no_grad():
        torch.testing.assert_close(got, layer(x))


def test_two_layers_in_one_graph_share_buffers_and_match_eager():
    """The second layer reads the first one's output buffer: Inductor orders and keeps it."""
    model = torch.nn.Sequential(sparsegen.linear(96, 64, block=(16, 16), density=0.5), torch.nn.GELU(),
                                sparsegen.Sparse24Linear(64, 32), torch.nn.Linear(32, 16))
    x = torch.randn(7, 96)
    got, (source, *_) = compiled_code(model, x)
    assert source.count("extern_kernels.sparsegen_") == 2
    with torch.no_grad():
        torch.testing.assert_close(got, model(x))


def test_compiled_training_step_still_matches_eager():
    """Forward lowered, backward through the ops: gradients as in eager mode."""
    layer = LAYERS["block-sparse"](True)
    x = torch.randn(4, 96, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(layer)(x).square().sum().backward()
    grads = [x.grad.clone(), layer.values.grad.clone()]
    x.grad = layer.values.grad = None
    layer(x).square().sum().backward()
    torch.testing.assert_close(grads, [x.grad, layer.values.grad])


class Projections(torch.nn.Module):
    """A norm, then three layers of its output (an attention's q, k and v), each changed after."""

    def __init__(self, make, hidden=128, kv=64):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, dtype=torch.bfloat16)
        self.q, self.k, self.v = make(hidden, hidden), make(hidden, kv), make(hidden, kv)

    def forward(self, x):
        y = self.norm(x)
        return self.q(y) * 2, self.k(y) + 1, self.v(y)


def scaled_layer(weight_dtype, bias=False):
    return lambda k, n: sparsegen.ScaledSparse24Linear.from_dense(
        torch.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16), weight_dtype)


def sixteen_bit_layer(bias=False):
    return lambda k, n: sparsegen.Sparse24Linear(k, n, bias=bias, dtype=torch.bfloat16)


def int4_layer(bias=False, group_size=128):
    return lambda k, n: sparsegen.Int4Sparse24Linear.from_dense(
        torch.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16), group_size)


@pytest.mark.parametrize("weight_dtype", ["e4m3", "int8"])
def test_layers_reading_one_input_are_one_grouped_launch(weight_dtype):
    """q, k and v: one quantization of the norm's output, one launch, each layer a view of its
    columns - against float64 of the stored weights times that output."""
    model = Projections(scaled_layer(weight_dtype))
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    got, (source, *_) = compiled_code(model, x)
    assert source.count("extern_kernels.sparsegen_sp24_group(") == 1, source
    assert "sparsegen_sp24_scaled_dds" not in source and "sparsegen_sp24_scaled_linear" not in source
    with torch.no_grad():
        y, eager = model.norm(x).double(), model(x)
        for out, by_eager, layer, after in zip(got, eager, (model.q, model.k, model.v),
                                               (lambda t: t * 2, lambda t: t + 1, lambda t: t)):
            weight = dequantized(layer.values, layer.metadata, layer.weight_scale).double()
            reference = after(y @ weight.t())
            error = lambda t: float((t.double() - reference).norm() / reference.norm())
            assert error(out) < 1.5 * error(by_eager) + 1e-3, (error(out), error(by_eager))  # as the norm test's


def test_sixteen_bit_layers_reading_one_input_are_one_grouped_launch():
    model = Projections(sixteen_bit_layer()).to(torch.bfloat16)
    x = torch.randn(2, 7, 128, dtype=torch.bfloat16)
    got, (source, *_) = compiled_code(model, x)
    assert source.count("extern_kernels.sparsegen_sp24_group(") == 1, source
    with torch.no_grad():
        for out, want in zip(got, model(x)):
            torch.testing.assert_close(out, want, atol=BF16_NORM_STEP, rtol=2e-2)


# Inductor's norm rounds its float32 result to bf16 once, eager mode's after a bf16 step or two: a
# product of the norm's output can differ by a few bf16 steps of its inputs' size
BF16_NORM_STEP = 1e-2


@pytest.mark.parametrize("make, launcher", [
    (scaled_layer("e4m3", bias=True), "extern_kernels.sparsegen_sp24_scaled_dds("),
    (sixteen_bit_layer(bias=True), "extern_kernels.sparsegen_sp24_dds(")])
def test_layers_with_bias_keep_their_own_launches(make, launcher):
    """The grouped kernel adds no bias: each layer calls its own launcher, as before."""
    model = Projections(make).to(torch.bfloat16)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    got, (source, *_) = compiled_code(model, x)
    assert "sparsegen_sp24_group" not in source and source.count(launcher) == 3, source
    with torch.no_grad():
        for out, want in zip(got, model(x)):
            torch.testing.assert_close(out, want, atol=0.1, rtol=0.05)


def test_a_llama_decoder_layer_groups_its_attention_projections():
    """A transformers Llama built from a config, every linear 2:4 FP8: per decoder layer one
    grouped launch (q, k and v); gate and up stay one gated product; logits as eager mode's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    sparsegen.patch(model, {r"layers\.\d+\.(self_attn|mlp)\.\w+_proj": {"sparsity": "2:4", "weight_dtype": "e4m3"}})
    ids = torch.randint(0, 256, (2, 9))
    got, (source, *_) = compiled_code(lambda t: model(input_ids=t).logits, ids)
    assert source.count("extern_kernels.sparsegen_sp24_group(") == 2, source
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert float((got - want).float().norm() / want.float().norm()) < 5e-2


def test_a_fourth_layer_on_the_same_input_runs_on_its_own():
    """At most three weights a launch: the first three layers share one, the fourth calls its
    own launcher, and nothing is computed twice."""
    layers = torch.nn.ModuleList(sparsegen.Sparse24Linear(128, n, bias=False, dtype=torch.bfloat16)
                                 for n in (128, 64, 64, 32))

    def model(x):
        y = torch.relu(x)
        return [layer(y) for layer in layers]
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    got, (source, *_) = compiled_code(model, x)
    assert source.count("extern_kernels.sparsegen_sp24_group(") == 1, source
    assert source.count("extern_kernels.sparsegen_sp24_dds_no_bias(") == 1, source
    with torch.no_grad():
        for out, want in zip(got, model(x)):
            torch.testing.assert_close(out, want)


@pytest.mark.parametrize("arch, dtype, rows, dense_wins, want", [
    (90, torch.bfloat16, 32, False, True), (80, torch.bfloat16, 32, False, False),
    (90, torch.bfloat16, 2048, True, False), (90, torch.float8_e4m3fn, 2048, True, True),
    (90, torch.bfloat16, None, True, True)])
def test_grouping_is_kept_to_where_the_grouped_kernel_runs(monkeypatch, arch, dtype, rows, dense_wins, want):
    """On a GPU: Hopper only (wgmma.sp), and not where a 16-bit product would take cuBLAS by itself
    at a known token count (one by one into Y's columns each would cost a copy)."""
    from sparsegen.launch import dense_path
    from sparsegen.semi24 import grouped

    monkeypatch.setattr(grouped.runtime, "device_arch", lambda device: arch)
    monkeypatch.setattr(dense_path, "wanted", lambda *args: dense_wins)
    assert grouped.worth_grouping(torch.device("cuda", 0), rows, 4096, [4096, 1024, 1024], dtype) is want
    assert grouped.worth_grouping(torch.device("cpu"), rows, 4096, [4096, 1024], dtype)


def test_grouped_layers_train_under_compile_as_in_eager_mode():
    """A training step through grouped q, k and v: the forward is one launch, the gradients of
    the input and of every layer's values those of eager mode."""
    model = Projections(lambda k, n: sparsegen.Sparse24Linear(k, n, bias=False, dtype=torch.float32))
    model.norm = torch.nn.RMSNorm(128)
    x, cotangent = torch.randn(3, 5, 128, requires_grad=True), torch.randn(128)

    def gradients(step):
        model.zero_grad(set_to_none=True)
        x.grad = None
        sum((out * cotangent[:out.shape[-1]]).sum() for out in step(x)).backward()
        return [x.grad.clone()] + [layer.values.grad.clone() for layer in (model.q, model.k, model.v)]

    torch._dynamo.reset()
    with config.patch(force_disable_caches=True):
        compiled = gradients(torch.compile(model))
    for got, want in zip(compiled, gradients(model)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # (float32 sums in another order)


@pytest.mark.parametrize("make, hidden, launcher", [(sixteen_bit_layer(), 128, "sp24_group"),
                                                   (int4_layer(), 256, "sp24_w4_group")], ids=["16-bit", "4-bit"])
def test_grouped_layers_with_a_dynamic_token_count(make, hidden, launcher):
    """Dynamic shapes: the row count is symbolic at lowering, so the group is decided per call by
    the launcher; two token counts, one graph, eager mode's outputs."""
    model = Projections(make, hidden=hidden).to(torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad(), config.patch(force_disable_caches=True):
        step = torch.compile(model, dynamic=True)
        x = torch.randn(2, 5, hidden, dtype=torch.bfloat16)
        got, (source, *_) = run_and_get_code(step, x)
        assert source.count(f"extern_kernels.sparsegen_{launcher}(") == 1, source
        later = torch.randn(3, 11, hidden, dtype=torch.bfloat16)  # (the same graph: no second compile)
        for inputs, outputs in ((x, got), (later, step(later))):
            for out, want in zip(outputs, model(inputs)):
                torch.testing.assert_close(out, want, atol=BF16_NORM_STEP, rtol=2e-2)



@pytest.mark.parametrize("group_size", [128, None])
def test_4_bit_layers_reading_one_input_are_one_grouped_launch(group_size):
    """4-bit q, k and v of one norm's output: one sp24_w4_group launch, each layer a view of
    its columns; the outputs those of eager mode (the norm's rounding aside)."""
    model = Projections(int4_layer(group_size=group_size), hidden=256)
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    got, (source, *_) = compiled_code(model, x)
    assert source.count("extern_kernels.sparsegen_sp24_w4_group(") == 1, source
    assert "sparsegen_sp24_w4_linear" not in source and "torch.ops.sparsegen" not in source
    with torch.no_grad():
        for out, want in zip(got, model(x)):
            torch.testing.assert_close(out, want, atol=BF16_NORM_STEP, rtol=2e-2)


def test_4_bit_layers_with_bias_or_another_group_keep_their_own_launches():
    """The grouped kernel adds no bias and reads one scale group: such layers launch alone."""
    model = Projections(int4_layer(bias=True), hidden=256)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    got, (source, *_) = compiled_code(model, x)
    assert "sparsegen_sp24_w4_group" not in source and source.count("extern_kernels.sparsegen_sp24_w4_linear(") == 3
    mixed = Projections(int4_layer(), hidden=256)
    mixed.v = int4_layer(group_size=None)(256, 64)
    got, (source, *_) = compiled_code(mixed, x)
    assert source.count("extern_kernels.sparsegen_sp24_w4_group(") == 1  # q and k
    assert source.count("extern_kernels.sparsegen_sp24_w4_linear_no_bias(") == 1, source  # v


def test_4_bit_grouping_stops_at_the_grouped_kernels_rows():
    from sparsegen.semi24 import compiled, int4_nn

    assert compiled._w4_worth_grouping(torch.device("cuda", 0), int4_nn.PREFILL_ROWS, 4096, [4096, 1024], None)
    assert not compiled._w4_worth_grouping(torch.device("cuda", 0), int4_nn.PREFILL_ROWS + 1, 4096, [4096], None)
    assert compiled._w4_worth_grouping(torch.device("cuda", 0), None, 4096, [4096, 1024], None)

