"""Patched transformers models (built from configs) in the modes users run them: eager,
torch.compile, reduce-overhead (CUDA graphs), make_graphed_callables; forward and training
steps, against float64 runs of the dense model with the same (masked) weights."""
import copy

import pytest
import torch
import transformers
from torch import nn

import sparsegen

pytestmark = pytest.mark.gpu

# Which linears each variant replaces in BERT / GPT-2 (the benchmark's variants, small models).
BERT_MLP = r"encoder\.layer\.\d+\.(intermediate|output)\.dense"
BERT_ALL = r"encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)"
GPT2_MLP = r"transformer\.h\.\d+\.mlp\.(c_fc|c_proj)"
VARIANTS = {"b64": {"block": (64, 64), "density": 0.5}, "b128": {"block": (128, 128), "density": 0.25},
            "b16": {"block": (16, 16), "density": 0.5}, "2:4": {"sparsity": "2:4"}}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def small_bert(variant: str, pattern: str = BERT_MLP) -> nn.Module:
    config = transformers.BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=1024, attn_implementation="sdpa")
    model = transformers.BertModel(config, add_pooling_layer=False).cuda().half().eval()
    sparsegen.patch(model, {pattern: VARIANTS[variant]})
    return model


@pytest.mark.parametrize("variant, pattern", [("b64", BERT_MLP), ("b128", BERT_MLP), ("b16", BERT_MLP),
                                              ("2:4", BERT_ALL)])
@pytest.mark.parametrize("mode", ["reduce-overhead", "default"])
def test_compiled_bert_forward_matches_float64(variant, pattern, mode):
    """A model never run before goes straight into torch.compile: reduce-overhead records
    CUDA graphs with sparsegen's per-layout indexes built during PyTorch's own warm-up.
    Every call on fresh inputs (outputs of earlier replays overwritten) matches float64."""
    torch.manual_seed(0)
    model = small_bert(variant, pattern)
    reference = sparsegen.dense_copy(model).double()
    compiled = torch.compile(model, mode=mode)
    with torch.no_grad():
        for rows in (8, 8, 8, 8):  # warm-up, recording, then replays
            ids = torch.randint(0, 1000, (rows, 96), device="cuda")
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(input_ids=ids).last_hidden_state.clone()
            want = reference(input_ids=ids).last_hidden_state
            assert not out.isnan().any() and relative_error(out, want) < 2e-2


def small_gpt2(variant: str) -> nn.Module:
    config = transformers.GPT2Config(n_embd=256, n_layer=2, n_head=4, n_positions=128, vocab_size=1000,
                                     attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).cuda()
    sparsegen.patch(model, {GPT2_MLP: VARIANTS[variant]})
    return model


def train_steps(model: nn.Module, batches: list, compile_mode: str | None) -> list[float]:
    """SGD steps under bf16 autocast; the losses. (SGD, not Adam: Adam's normalised step turns
    rounding noise in near-zero gradients into full-size updates, which would hide a real
    difference among spurious ones.)"""
    run = torch.compile(model, mode=compile_mode) if compile_mode else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for ids in batches:
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("variant", ["b64", "b128", "2:4"])
def test_reduce_overhead_training_steps_match_eager(variant):
    """Whole training steps (forward, backward, optimizer) of a patched GPT-2 under
    reduce-overhead give the eager steps' losses and weight updates."""
    torch.manual_seed(0)
    model = small_gpt2(variant)
    twin, start = copy.deepcopy(model), copy.deepcopy(model)
    batches = [torch.randint(0, 1000, (4, 64), device="cuda") for _ in range(4)]
    eager = train_steps(model, batches, None)
    graphed = train_steps(twin, batches, "reduce-overhead")
    assert all(abs(a - b) < 2e-2 * abs(a) for a, b in zip(eager, graphed)), (eager, graphed)
    for (name, a), b, s in zip(model.named_parameters(), twin.parameters(), start.parameters()):
        assert relative_error(b.detach() - s.detach(), a.detach() - s.detach()) < 5e-2, name


@pytest.mark.parametrize("make_layer", [
    lambda: sparsegen.linear(512, 384, block=(64, 64), density=0.5, device="cuda", dtype=torch.bfloat16),
    lambda: sparsegen.linear(512, 384, block=(32, 32), density=0.25, device="cuda", dtype=torch.bfloat16),
    lambda: sparsegen.Sparse24Linear(512, 384, device="cuda", dtype=torch.bfloat16),
], ids=["b64", "b32", "2:4"])
def test_make_graphed_callables_forward_and_backward(make_layer):
    """torch.cuda.make_graphed_callables on a layer never run before (its own warm-up is the
    only one): replays on fresh inputs give the float64 output and gradients."""
    torch.manual_seed(0)
    layer = make_layer()
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(layer, (x,))
    weight = layer.to_dense_weight().double()
    for _ in range(2):
        x_new = torch.randn_like(x, requires_grad=True)
        dy = torch.randn(300, 384, device="cuda", dtype=torch.bfloat16)
        out = graphed(x_new)
        out.backward(dy)
        want = x_new.detach().double() @ weight.t() + layer.bias.double()
        assert relative_error(out.detach(), want) < 1e-2
        assert relative_error(x_new.grad, dy.double() @ weight) < 1e-2
