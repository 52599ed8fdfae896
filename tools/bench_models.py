"""Whole models, dense against sparsegen, side by side in one process: the figure that says
whether sparsegen makes a user's model faster.

GPU:  PYTHONPATH=. python tools/bench_models.py --json out/models.json [--cases bert16,llama_prefill]
      [--modes eager,compile,reduce-overhead] [--variants dense,2:4,b64d0.5] [--host]
then: python tools/bench_models.py --report out/models.json [...more.json] (tools/benchmarks_md.py renders
      recorded runs into BENCHMARKS.md)
CPU smoke run (tiny configs, eager): python tools/bench_models.py --smoke

Models come from transformers configs (no download) and are patched with sparsegen.patch.
Speedup = dense time / variant time in the same mode and run, the two timed in alternating
rounds. Each sparse model's output is compared with its dense equivalent (the same weights,
masked) run eagerly.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import sparsegen  # noqa: E402
from bench_record import meta as run_meta  # noqa: E402
from quantized_dense import quantize_linears  # noqa: E402
from families import FAMILIES, config as family_config  # noqa: E402

# Which linears a variant replaces, per model family: every projection, or the MLP's.
PATTERNS = {
    "bert": {"all": r"encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense"
                    r"|intermediate\.dense|output\.dense)",
             "mlp": r"encoder\.layer\.\d+\.(intermediate|output)\.dense"},
    "llama": {"all": r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj", "mlp": r"model\.layers\.\d+\.mlp\.\w+_proj"},
    "gpt2": {"all": r"transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)",
             "mlp": r"transformer\.h\.\d+\.mlp\.(c_fc|c_proj)"},
}
# variant name -> (which linears, patch settings); None: the dense model. "peer" is PyTorch's
# to_sparse_semi_structured on the weights of sparsegen's 2:4 variant.
VARIANTS = {
    "dense": None,
    "2:4": ("all", {"sparsity": "2:4"}),
    "b64d0.5": ("mlp", {"block": (64, 64), "density": 0.5}),
    "b64d0.25": ("mlp", {"block": (64, 64), "density": 0.25}),
    "b128d0.25": ("mlp", {"block": (128, 128), "density": 0.25}),
    "2:4-mlp": ("mlp", {"sparsity": "2:4"}),
    "2:4t-mlp": ("mlp", {"sparsity": "2:4", "method": "transposable"}),  # dX on the 2:4 kernel too
    "2:4-recipe": ("mlp", {"sparsity": "2:4", "training": {"mask_interval": 100}}),
    "peer-2:4": ("all", {"sparsity": "2:4"}),
    # One-byte weights and per-token activations (issue 30): sparsegen's scaled 2:4 layers, and
    # the same quantization on PyTorch's dense one-byte products (tools/quantized_dense.py).
    "fp8-dense": ("all", "e4m3"),
    "fp8-2:4": ("all", {"sparsity": "2:4", "weight_dtype": "e4m3"}),
    "int8-dense": ("all", "int8"),
    "int8-2:4": ("all", {"sparsity": "2:4", "weight_dtype": "int8"}),
    # 4-bit kept values, 16-bit activations (W4A16, group 128: Int4Sparse24Linear, issue 62)
    "int4-2:4": ("all", {"sparsity": "2:4", "weight_dtype": "int4"}),
}
# The same variants patched with fuse=False: activations and gated products left to PyTorch
# (on request only, to measure what the fused epilogues give).
VARIANTS.update({f"{name}-unfused": VARIANTS[name] for name in ("2:4", "b64d0.5", "b128d0.25", "2:4t-mlp", "b64d0.25")})
INFERENCE_VARIANTS = ["dense", "2:4", "b64d0.5", "b128d0.25", "peer-2:4"]
BYTE_VARIANTS = ["dense", "2:4", "fp8-dense", "fp8-2:4", "int8-dense", "int8-2:4", "int4-2:4"]
FAMILY_VARIANTS = ["dense", "2:4", "b64d0.5", "b128d0.25", "fp8-dense", "fp8-2:4", "int8-dense", "int8-2:4"]
OPTIONAL_VARIANTS = [name for name in VARIANTS if name.endswith("-unfused")]
TRAINING_VARIANTS = ["dense", "2:4", "2:4-mlp", "2:4t-mlp", "b64d0.5", "b64d0.25", "b128d0.25", "2:4-recipe"]
TRAINING_STEPS = 4  # warm-up steps of a training case; the last one's loss is checked (after 3 updates)
MODES = ["eager", "compile", "reduce-overhead"]
# --pin: the timing thread stays on one core while it times; --alone: each compiled variant
# beside a dense twin compiled again with it, after a Dynamo reset; --rounds (set by main)
TIMING = dict(pin=False, alone=False, rounds=5)


@dataclass
class Case:
    """A model and one call of it: `build(dtype-ready model)` -> step(model) -> tensor to check."""
    name: str
    family: str
    make_model: Callable[[], nn.Module]
    make_step: Callable[[nn.Module], Callable[[], torch.Tensor]]
    training: bool = False
    variants: tuple = tuple(INFERENCE_VARIANTS)
    tokens: int = 0  # tokens a step (training: the profile tells dW by it)


# ---- models -------------------------------------------------------------------------------

def bert_config(smoke: bool):
    from transformers import BertConfig

    if smoke:
        return BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)
    return BertConfig()  # BERT-base: 12 layers, hidden 768, MLP 3072


def llama_config(smoke: bool):
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512)
    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=12, num_attention_heads=16,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)


def llama8b_config(smoke: bool, layers: int = 4):
    """Llama-3-8B's layer shapes (hidden 4096, MLP 14336, GQA 32/8) with `layers` of its 32
    layers and a 32000-token vocabulary (the head is dense in every variant: with 4 layers it
    is 13% of the weight bytes a decode step reads, with 32 under 2%)."""
    from transformers import LlamaConfig

    if smoke:
        return llama_config(smoke)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)


def llama_train_config(smoke: bool):
    """The issue's 1B-class decoder: llama_config's shape (hidden 2048, MLP 8192, GQA 16/4)
    with 16 layers."""
    config = llama_config(smoke)
    if not smoke:
        config.num_hidden_layers = 16
    return config


def gpt2_config(smoke: bool):
    """GPT-2 medium without dropout: the training cases check each sparse model's loss against
    its dense twin's, which two different dropout draws would move apart (pretraining runs
    commonly drop none)."""
    from transformers import GPT2Config

    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if smoke:
        return GPT2Config(n_embd=128, n_layer=2, n_head=2, n_positions=128, vocab_size=512, bos_token_id=0,
                          eos_token_id=0, **no_dropout)
    return GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, **no_dropout)


def built(model_class, config, device, dtype) -> nn.Module:
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    with torch.device(device):  # initialised where it runs: a CPU init of the 8B-shaped models took a minute
        return model_class(config).to(dtype=dtype).eval()


def bert_case(batch: int, device, dtype, smoke: bool) -> Case:
    from transformers import BertModel

    config = bert_config(smoke)
    tokens = 16 if smoke else 128
    ids = torch.randint(0, config.vocab_size, (batch, tokens), device=device)
    return Case(f"BERT-base, batch {batch} x {tokens}", "bert",
                lambda: built(lambda c: BertModel(c, add_pooling_layer=False), config, device, dtype),
                lambda model: lambda: model(input_ids=ids).last_hidden_state)


def llama_prefill_case(device, dtype, smoke: bool, config=None, label="Llama-shaped",
                       variants=INFERENCE_VARIANTS) -> Case:
    from transformers import LlamaForCausalLM

    config = config or llama_config(smoke)
    tokens = 32 if smoke else 2048
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)
    # As generate's prefill: logits of the last position only, no cache kept.
    return Case(f"{label} prefill 1 x {tokens}", "llama", lambda: built(LlamaForCausalLM, config, device, dtype),
                lambda model: lambda: model(input_ids=ids, logits_to_keep=1, use_cache=False).logits,
                variants=tuple(variants))


def llama_decode_case(batch: int, device, dtype, smoke: bool, config=None, label="Llama-shaped",
                      variants=INFERENCE_VARIANTS, model_class: str = "LlamaForCausalLM") -> Case:
    """One decode step of a decoder (a Llama, or any family of tools/families.py: their layers
    are named as Llama's, so the "llama" patterns find them)."""
    import transformers

    config = config or llama_config(smoke)
    context = 16 if smoke else 512
    prompt = torch.randint(0, config.vocab_size, (batch, context + 1), device=device)
    return Case(f"{label} decode {batch} seq, {context}-token KV cache", "llama",
                lambda: built(getattr(transformers, model_class), config, device, dtype),
                lambda model: decode_step(model, config, prompt), variants=tuple(variants))


def decode_step(model: nn.Module, config, prompt: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One decode step the way generate runs it with a static cache: all but the last token
    of `prompt` are prefilled once (untimed); every timed step writes the same position, so
    each sees the same state."""
    from transformers import StaticCache

    batch, context = prompt.shape[0], prompt.shape[1] - 1
    cache = StaticCache(config=config, max_cache_len=context + 8)
    with torch.no_grad():  # eagerly (a compiled model's own module): the cache's tensors, made on
        # first use, then live outside any CUDA graph's pool, as generate's do
        getattr(model, "_orig_mod", model)(input_ids=prompt[:, :context], past_key_values=cache, use_cache=True)
    token, position = prompt[:, context:], torch.tensor([context], device=prompt.device)

    def step() -> torch.Tensor:
        return model(input_ids=token, past_key_values=cache, cache_position=position,
                     position_ids=position.expand(batch, 1), use_cache=True).logits

    def rewind() -> None:
        """Newer transformers' static layers count their length themselves: back to the prompt."""
        for layer in getattr(cache, "layers", []):
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length.fill_(context)
    step.reset = rewind  # called before each step, outside its timing
    return step


def gpt2_train_case(device, smoke: bool) -> Case:
    from transformers import GPT2LMHeadModel

    config = gpt2_config(smoke)
    batch, tokens = (2, 32) if smoke else (8, 1024)
    ids = token_ids(config.vocab_size, (batch, tokens), device)
    return Case(f"GPT-2-medium training step, batch {batch} x {tokens}, bf16 autocast, fused AdamW", "gpt2",
                lambda: built(GPT2LMHeadModel, config, device, torch.float32).train(),
                lambda model: train_step(model, ids), training=True, variants=tuple(TRAINING_VARIANTS),
                tokens=ids.numel())


def llama_train_case(kilotokens: int, checkpointing: bool, device, smoke: bool) -> Case:
    """A training step of the 1B-class Llama: fp32 weights, bf16 autocast, fused AdamW,
    sequences of 2048 tokens, `kilotokens` x 1024 tokens a step; activation checkpointing
    (transformers' own, non-reentrant) where asked."""
    from transformers import LlamaForCausalLM

    config = llama_train_config(smoke)
    seq = 32 if smoke else 2048  # the smoke run keeps the number of sequences
    ids = token_ids(config.vocab_size, (kilotokens * 1024 // 2048, seq), device)

    def make_model() -> nn.Module:
        model = built(LlamaForCausalLM, config, device, torch.float32).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    ckpt = ", activation checkpointing" if checkpointing else ""
    return Case(f"Llama-1B-shaped training step, {ids.shape[0]} x {seq}{ckpt}, bf16 autocast, fused AdamW",
                "llama", make_model, lambda model: train_step(model, ids), training=True,
                variants=tuple(TRAINING_VARIANTS), tokens=ids.numel())


def token_ids(vocab: int, shape: tuple, device) -> torch.Tensor:
    """A training case's tokens, the same in every run (its losses then repeat across runs)."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0)).to(device)


def train_step(model: nn.Module, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Forward, backward and a fused AdamW step; returns the loss (of the weights before the step).
    The learning rate is large enough that a few steps move the loss (the check against the
    dense twin then sees a wrong gradient)."""
    fused = ids.is_cuda
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=fused)

    def step() -> torch.Tensor:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def cases(names: list[str], device, smoke: bool) -> list[Case]:
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    bf16 = torch.bfloat16 if device.type == "cuda" else torch.float32
    makers = {"bert16": lambda: bert_case(16, device, dtype, smoke), "bert128": lambda: bert_case(128, device, dtype, smoke),
              "llama_prefill": lambda: llama_prefill_case(device, bf16, smoke),
              "llama_decode1": lambda: llama_decode_case(1, device, bf16, smoke),
              "llama_decode8": lambda: llama_decode_case(8, device, bf16, smoke),
              "gpt2_train": lambda: gpt2_train_case(device, smoke)}
    eight_b = dict(config=llama8b_config(smoke), label="Llama-3-8B-shaped (4 layers)", variants=BYTE_VARIANTS)
    makers["llama8b_prefill"] = lambda: llama_prefill_case(device, bf16, smoke, **eight_b)
    for batch in (1, 8, 32, 64):
        makers[f"llama8b_decode{batch}"] = lambda b=batch: llama_decode_case(b, device, bf16, smoke, **eight_b)
    # all 32 layers: the whole model a decode-speed target speaks of (the 4-bit layers' issue 62)
    deep = dict(eight_b, config=llama8b_config(smoke, layers=32), label="Llama-3-8B-shaped (32 layers)")
    for batch in (8, 32):
        makers[f"llama8b32_decode{batch}"] = lambda b=batch: llama_decode_case(b, device, bf16, smoke, **deep)
    for family in (f for f in FAMILIES.values() if f.name != "llama"):  # the generation benchmark's families
        # (its Llama-3-8B shape is llama8b_decode*; llama_decode* keep their smaller Llama)
        shaped = dict(config=family_config(family, 4, smoke), label=f"{family.label} (4 layers)",
                      variants=FAMILY_VARIANTS, model_class=family.model_class)
        for batch in (1, 8, 32):
            makers[f"{family.name}_decode{batch}"] = lambda b=batch, f=shaped: llama_decode_case(b, device, bf16, smoke, **f)
    for kilotokens in (8, 32):
        for ckpt in ("", "_ckpt"):
            makers[f"llama_train{kilotokens}k{ckpt}"] = (
                lambda k=kilotokens, c=bool(ckpt): llama_train_case(k, c, device, smoke))
    return [makers[name]() for name in names if name != "none"]


# ---- variants ------------------------------------------------------------------------------

def patched(model: nn.Module, family: str, variant: str) -> nn.Module:
    """The model with the variant's layers swapped in (in place; the peer's are sparsegen's 2:4
    layers until peer_semi_structured swaps them)."""
    if VARIANTS[variant] is None:
        return model
    which, settings = VARIANTS[variant]
    if isinstance(settings, str):  # a dense one-byte baseline
        return quantize_linears(model, PATTERNS[family][which], settings)
    sparsegen.patch(model, {PATTERNS[family][which]: settings}, fuse=not variant.endswith("-unfused"))
    return model


def peer_semi_structured(model: nn.Module) -> nn.Module:
    """Each sparsegen 2:4 layer becomes an nn.Linear whose weight is PyTorch's
    SparseSemiStructuredTensor (cuSPARSELt on sm_90) of the same pruned weight."""
    from torch.sparse import to_sparse_semi_structured

    for name, module in list(sparsegen.dense_copy(model).named_modules()):
        if isinstance(module, nn.Linear) and isinstance(model.get_submodule(name), sparsegen.Sparse24Linear):
            module.weight = nn.Parameter(to_sparse_semi_structured(module.weight.detach()), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module)
    return model


# ---- modes and timing ----------------------------------------------------------------------

def in_mode(model: nn.Module, mode: str) -> nn.Module:
    if mode == "eager":
        return model
    return torch.compile(model, mode=None if mode == "compile" else mode)


def timed_ms(step: Callable, device, reps: int) -> float:
    """Median of `reps` calls, each between CUDA events (wall clock on the CPU)."""
    times, reset = [], getattr(step, "reset", lambda: None)
    for _ in range(reps):
        reset()
        torch.compiler.cudagraph_mark_step_begin()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            step()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def measure(case: Case, variant: str, modes: list[str], dense: "DenseSteps", device, reps: int) -> list[dict]:
    """One model of `variant`: its time in every mode beside the dense model's, and its output
    against the masked dense model."""
    model = patched(case.make_model(), case.family, variant)
    expected = expected_output(case, reference_model(case, variant, model), model)
    try:
        model = peer_semi_structured(model) if variant == "peer-2:4" else model
    except Exception as error:  # a peer that refuses the device or the shapes: recorded, the run goes on
        return [failed_row(dict(case=case.name, variant=variant, mode=mode), error) for mode in modes]
    return [measure_mode(case, variant, model, mode, expected, dense, device, reps) for mode in modes]


def reference_model(case: Case, variant: str, model: nn.Module) -> nn.Module:
    """The dense model with the sparse model's (masked) weights; for one-byte variants the
    16-bit model they quantize (for 2:4 ones pruned by the same magnitude masks), so their
    error is the quantization's."""
    settings = VARIANTS[variant][1] if VARIANTS[variant] else None
    if isinstance(settings, str):
        return case.make_model()
    if isinstance(settings, dict) and "weight_dtype" in settings:
        return sparsegen.dense_copy(patched(case.make_model(), case.family, "2:4"))
    return sparsegen.dense_copy(model)


def expected_output(case: Case, reference: nn.Module, model: nn.Module) -> list[torch.Tensor]:
    """The case's outputs over its warm-up steps on the reference model, eagerly; in training
    that twin's pruned weights stay zero (their gradients masked), so it takes the steps a
    sparse model with a fixed mask takes."""
    if case.training:
        mask_gradients(reference, model)
    with torch.set_grad_enabled(case.training):
        return warmed_up(case, case.make_step(reference))[1]


def mask_gradients(twin: nn.Module, model: nn.Module) -> None:
    """Zero, in every step, the gradient of the twin's weights where the sparse model stores
    none (the twin's dense copies hold exact zeros there)."""
    sparse = (sparsegen.BlockSparseLinear, sparsegen.Sparse24Linear, sparsegen.Sparse24TrainingLinear)
    twins = dict(twin.named_modules())
    for name, module in model.named_modules():
        if isinstance(module, sparse):
            for linear in (m for part in twin_parts(twins, name) for m in part.modules()):
                if isinstance(linear, nn.Linear):
                    kept = linear.weight.detach() != 0
                    linear.weight.register_hook(lambda grad, kept=kept: grad * kept)


def twin_parts(twins: dict, name: str) -> list[nn.Module]:
    """The dense twin's modules ({name: module}) holding what the sparse model's module `name`
    holds: the same name, or for a GatedMLP's gate_up (dense_copy gives the model's own MLP
    back) its gate and up projections."""
    parent = name.rpartition(".")[0]
    parts = [twins[name]] if name in twins else [twins[f"{parent}.{p}"] for p in ("gate_proj", "up_proj")
                                                 if f"{parent}.{p}" in twins]
    if not parts:
        raise KeyError(f"the dense twin has no module for {name}")
    return parts


def check_error(case: Case, outputs: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """Inference: the first output's relative error. Training: the last step's loss against
    the twin's, as a fraction of the most the twin's loss moved from its first (a wrong
    gradient moves it otherwise; the most, not the last: a loss that spikes and comes back
    to near its start would make any bf16 difference look large)."""
    if not case.training:
        return relative_error(outputs[0], expected[0])
    moved = max(float((expected[0] - loss).abs()) for loss in expected[1:])
    return float((outputs[-1] - expected[-1]).abs()) / max(moved, 1e-6)


class DenseSteps:
    """The case's dense model, one warmed-up step per mode, built on first use and timed
    beside every variant in that mode."""

    def __init__(self, case: Case):
        self.case, self.model, self.steps = case, case.make_model(), {}

    def compile_again(self, mode: str) -> None:
        """Forget every compiled graph (Dynamo's caches, CUDA graph trees) and this mode's
        step: the next variant and its dense twin are the process's only compiled models."""
        torch._dynamo.reset()
        self.steps.pop(mode, None)

    def __call__(self, mode: str) -> Callable:
        if mode not in self.steps:
            self.steps[mode] = warmed_up(self.case, self.case.make_step(in_mode(self.model, mode)))[0]
        return self.steps[mode]


def variant_step(case: Case, variant: str, mode: str) -> Callable:
    """A fresh model of the case with `variant` swapped in, its step in `mode`, warmed up (the
    profiling and probing tools' start)."""
    model = patched(case.make_model(), case.family, variant)
    return warmed_up(case, case.make_step(in_mode(model, mode)))[0]


def warmed_up(case: Case, step: Callable) -> tuple[Callable, list[torch.Tensor]]:
    """(step, the outputs of the warm-up calls that compile and record: TRAINING_STEPS of a
    training case, 3 of the others)."""
    reset = getattr(step, "reset", lambda: None)
    outputs = []
    with torch.set_grad_enabled(case.training):
        for _ in range(TRAINING_STEPS if case.training else 3):
            reset()
            torch.compiler.cudagraph_mark_step_begin()  # as timed_ms: each call a new step
            outputs.append(step().float().clone())
    return step, outputs


def round_times(steps: list[Callable], device, reps: int, rounds: int = 5) -> list[list[float]]:
    """Per round, each step's median of `reps` calls, the steps taken in turn, round r starting
    with step r (none is always the first after a switch): the host's speed and the GPU's clocks
    drift during a run by more than the margins measured (a host-bound decode step's dense twin
    measured 1.9 to 3.7 ms in one process), less so within a round. Rows list steps as given."""
    rows = []
    for r in range(rounds):
        times = {at: timed_ms(steps[at], device, reps) for at in in_turn(list(range(len(steps))), r)}
        rows.append([times[at] for at in range(len(steps))])
    return rows


def in_turn(items: list, r: int) -> list:
    """The items in round r's order: round r starts with item r (none always follows a switch)."""
    start = r % len(items)
    return items[start:] + items[:start]


def interleaved_ms(steps: list[Callable], device, reps: int, rounds: int = 5) -> list[float]:
    """Each step's median over `rounds` rounds that take the steps in turn (round_times)."""
    return [statistics.median(column) for column in zip(*round_times(steps, device, reps, rounds))]


def current_core() -> int:
    """The core this thread runs on now (field 39 of its /proc stat line, after the name)."""
    stat = Path("/proc/thread-self/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[36])


@contextlib.contextmanager
def pinned(enabled: bool):
    """This thread on the core it is on, until the block ends. Only while timing: the models are
    compiled by then, and worker processes started before inherit every core."""
    if not enabled:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {current_core()})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def measure_mode(case: Case, variant: str, model: nn.Module, mode: str, expected, dense: DenseSteps, device,
                 reps: int) -> dict:
    row = dict(case=case.name, variant=variant, mode=mode)
    if TIMING["alone"] and mode != "eager":
        dense.compile_again(mode)
    try:
        state = copy.deepcopy(model.state_dict()) if case.training else None
        step, outputs = warmed_up(case, case.make_step(in_mode(model, mode)))
        row["error"] = check_error(case, outputs, expected)
        if case.training:
            row["loss"], row["dense_loss"] = float(outputs[-1]), float(expected[-1])
        with torch.set_grad_enabled(case.training), pinned(TIMING["pin"]):
            row.update(timed_against_dense(dense(mode), step, device, reps))
        if state is not None:
            model.load_state_dict(state)
    except Exception as error:  # a cell that fails is recorded, and the run goes on
        return failed_row(row, error)
    print(json.dumps(row), flush=True)
    return row


def timed_against_dense(dense_step: Callable, step: Callable, device, reps: int) -> dict:
    """Both steps' medians and each round's dense/variant ratio (speedup takes their median)."""
    times = round_times([dense_step, step], device, reps, TIMING["rounds"])
    dense_ms, ms = (statistics.median(column) for column in zip(*times))
    return dict(dense_ms=dense_ms, ms=ms, round_speedups=[d / v for d, v in times])


def failed_row(row: dict, error: Exception) -> dict:
    text = str(error).strip().splitlines()
    row["failed"] = f"{type(error).__name__}: {text[0][:200] if text else ''}"
    print(json.dumps(row), flush=True)
    return row


def run_case(case: Case, variants: list[str], modes: list[str], device, reps: int, save: Callable) -> None:
    """Every variant of the case in every mode; save(rows) after each variant."""
    dense = DenseSteps(case)
    for variant in [v for v in (*case.variants, *OPTIONAL_VARIANTS) if v in variants and v != "dense"]:
        save(measure(case, variant, modes, dense, device, reps))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    torch._dynamo.reset()


# ---- host cost per linear call -------------------------------------------------------------

HOST_LAYERS, HOST_WIDTH, HOST_TOKENS = 24, 1024, 16
HOST_KINDS = {"nn.Linear": lambda: nn.Linear(HOST_WIDTH, HOST_WIDTH),
              "BlockSparseLinear b64 d0.5": lambda: sparsegen.linear(HOST_WIDTH, HOST_WIDTH, block=(64, 64), density=0.5),
              "Sparse24Linear": lambda: sparsegen.linear(HOST_WIDTH, HOST_WIDTH, sparsity="2:4"),
              "Int4Sparse24Linear": lambda: sparsegen.linear(HOST_WIDTH, HOST_WIDTH, sparsity="2:4", weight_dtype="int4",
                                                             dtype=torch.bfloat16)}


def host_stack(kind: str, device) -> nn.Module:
    """24 stacked 1024x1024 layers of one kind: a forward whose GPU work is small."""
    torch.manual_seed(0)
    make = HOST_KINDS[kind]
    return nn.Sequential(*[make() for _ in range(HOST_LAYERS)]).to(device=device, dtype=torch.bfloat16)


def host_us_per_call(stack: nn.Module, x: torch.Tensor, bursts: int = 5, forwards: int = 12) -> float:
    """Host time per linear call: bursts of `forwards` forwards, each timed from an idle GPU
    to the last launch queued (not to the GPU's finish: a few hundred launches fit the
    driver's queue, so the host never waits on the GPU). Median over bursts."""
    times = []
    with torch.no_grad():
        for _ in range(20):
            stack(x)
        for _ in range(bursts):
            torch.cuda.synchronize() if x.is_cuda else None
            begin = time.perf_counter()
            for _ in range(forwards):
                stack(x)
            times.append(time.perf_counter() - begin)
        torch.cuda.synchronize() if x.is_cuda else None
    return statistics.median(times) / (forwards * HOST_LAYERS) * 1e6


def host_costs(device, rounds: int = 5) -> list[dict]:
    """Host us per linear call of each layer kind, eager and compiled, measured in alternating
    rounds (the host's speed drifts: one kind measured after another would carry the drift)."""
    x = torch.randn(HOST_TOKENS, HOST_WIDTH, device=device, dtype=torch.bfloat16)
    runs = {(kind, mode): in_mode(host_stack(kind, device), mode) for kind in HOST_KINDS
            for mode in ["eager", "compile"]}
    times = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            times[key].append(host_us_per_call(run, x))
    rows = [dict(layer=kind, mode=mode, host_us=statistics.median(t)) for (kind, mode), t in times.items()]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


# ---- report --------------------------------------------------------------------------------

def speedups(rows: list[dict]) -> list[dict]:
    return [dict(r, speedup=speedup(r)) for r in rows]


def speedup(row: dict) -> float | None:
    """The median of the rounds' dense/variant ratios (each round times both within tens of
    milliseconds, where the host's speed holds); rows recorded before that: the medians' ratio."""
    if row.get("round_speedups"):
        return statistics.median(row["round_speedups"])
    return row["dense_ms"] / row["ms"] if row.get("ms") else None


def cell(runs: list[dict]) -> str:
    """A variant's cell from its runs: one run's speedup; of several, the median of those that
    ran and then every run's (host-bound cases spread between runs by more than their margins:
    one figure would hide it)."""
    if not runs:
        return "-"
    ran = [run for run in runs if "failed" not in run and run.get("speedup")]
    if len(runs) == 1 or not ran:
        text = run_text(runs[-1])
    else:
        text = (f"{statistics.median(run['speedup'] for run in ran):.2f}x median (runs: "
                + " / ".join(map(run_text, runs)) + ")")
    errors = [run["error"] for run in ran if run.get("error") is not None]
    return text + (f" (err {max(errors):.0e})" if errors and max(errors) > 2e-2 else "")


def run_text(run: dict) -> str:
    return "fails" if "failed" in run else f"{run['speedup']:.2f}x" if run.get("speedup") else "-"


def model_table(rows: list[dict]) -> list[str]:
    rows = speedups(rows)
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    lines = ["| model | mode | dense ms | " + " | ".join(variants) + " |", "|---|---|---|" + "---|" * len(variants)]
    for case in dict.fromkeys(r["case"] for r in rows):
        for mode in dict.fromkeys(r["mode"] for r in rows if r["case"] == case):
            runs = [r for r in rows if r["case"] == case and r["mode"] == mode]
            dense_ms = statistics.median([r["dense_ms"] for r in runs if r.get("dense_ms")] or [0])
            lines.append(f"| {case} | {mode} | {dense_ms:.3f} | " if dense_ms else f"| {case} | {mode} | - | ")
            lines[-1] += " | ".join(cell([r for r in runs if r["variant"] == v]) for v in variants) + " |"
    return lines


def failures(rows: list[dict]) -> list[str]:
    return [f"- {r['case']}, {r['variant']}, {r['mode']}: {r['failed']}" for r in rows if "failed" in r]


def errors_line(rows: list[dict]) -> str:
    lines = []
    inference = [r["error"] for r in rows if r.get("error") is not None and "loss" not in r]
    if inference:
        lines.append(f"Output against the dense model with the same (masked) weights (one-byte variants: "
                     f"the 16-bit model they quantize): relative error {min(inference):.1e} - "
                     f"{max(inference):.1e} over {len(inference)} cells.")
    training = [r["error"] for r in rows if r.get("error") is not None and "loss" in r]
    if training:
        lines.append(f"Training: the loss after {TRAINING_STEPS - 1} optimizer steps against the dense twin's "
                     f"(masked weights, masked gradients, same data), as a fraction of the most the twin's "
                     f"loss moved from its first (runs before 96da768: from first to last): "
                     f"{min(training):.1e} - {max(training):.1e} over {len(training)} cells.")
    return " ".join(lines)


def host_table(rows: list[dict]) -> list[str]:
    base = {r["mode"]: r["host_us"] for r in rows if r["layer"] == "nn.Linear"}
    lines = ["| layer | mode | host us per call | x nn.Linear |", "|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['mode']} | {r['host_us']:.1f} | {r['host_us'] / base[r['mode']]:.2f} |"
              for r in rows if r["mode"] in base]
    return lines


def report(results: list[dict], markdown: Path | None, plot_path: Path | None) -> None:
    rows = [r for result in results for r in result.get("rows", [])]
    host = [r for result in results for r in result.get("host", [])]
    meta = results[0]["meta"]
    lines = [f"GPU: {meta['gpu']} - date: {meta['date']} - torch {meta['torch']}, transformers "
             f"{meta['transformers']} - commands: " + "; ".join(f"`{r['meta']['command']}`" for r in results), "",
             "Speedup over dense in the same mode and run (above 1: faster); dense ms is the dense model's "
             "median time in that mode.", ""]
    if rows:
        lines += model_table(rows) + ["", errors_line(rows)] + failures(rows)
    if host:
        lines += ["", f"Host time per linear call ({HOST_LAYERS} stacked {HOST_WIDTH}x{HOST_WIDTH} bf16 layers, "
                  f"{HOST_TOKENS} tokens):", ""] + host_table(host)
    text = "\n".join(lines) + "\n"
    print(text)
    if markdown:
        markdown.write_text(text)
    if plot_path:
        plot(speedups(rows), plot_path)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [r for r in rows if r["variant"] != "dense" and r.get("speedup")]
    labels = list(dict.fromkeys(f"{r['case']}\n{r['mode']}" for r in cells))
    variants = list(dict.fromkeys(r["variant"] for r in cells))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(labels)), 5))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        pick = {f"{r['case']}\n{r['mode']}": r["speedup"] for r in cells if r["variant"] == variant}
        ax.bar([j + i * width for j in range(len(labels))], [pick.get(label, 0) for label in labels], width,
               label=variant)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=70, fontsize=6)
    ax.set(ylabel="speedup over dense, same mode", title="sparsegen: whole models")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- main ----------------------------------------------------------------------------------

def meta(argv) -> dict:
    import transformers

    return dict(run_meta("bench_models.py", argv), transformers=transformers.__version__)


ALL_CASES = ["bert16", "bert128", "llama_prefill", "llama_decode1", "llama_decode8", "gpt2_train", "llama_train8k"]


def main(argv=None) -> None:
    torch._dynamo.config.cache_size_limit = 64  # dense and variant models compiled side by side
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(ALL_CASES), help="'none': only --host")
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v not in OPTIONAL_VARIANTS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--reps", type=int, default=10, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds that time dense and the variant in turn; the speedup is their ratios' median")
    parser.add_argument("--host", action="store_true", help="also the host cost per linear call")
    parser.add_argument("--smoke", action="store_true", help="tiny configs on the CPU, eager only")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--report", type=Path, nargs="+", help="tabulate these result files instead")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--apart", action="store_true",
                        help="each case and variant in a process of its own, beside its own dense model")
    parser.add_argument("--repeat", type=int, default=1,
                        help="with --apart: that many fresh processes per case and variant, every run a row")
    parser.add_argument("--alone", action="store_true",
                        help="compiled modes: a Dynamo reset before each variant, its dense twin compiled again "
                             "beside it (as --apart, in one process)")
    parser.add_argument("--pin", action="store_true",
                        help="time on one core: the timing thread stays on the core it is on while it times")
    args = parser.parse_args(argv)
    TIMING.update(pin=args.pin, alone=args.alone, rounds=args.rounds)
    if args.report:
        return report([json.loads(p.read_text()) for p in args.report], args.markdown, args.plot)
    if args.repeat < 1 or (args.repeat > 1 and not args.apart):
        parser.error(f"Expected --repeat N >= 1, N > 1 with --apart (runs in fresh processes). "
                     f"Got --repeat {args.repeat}{'' if args.apart else ' without --apart'}.")
    if args.apart:
        return run_apart(argv, args)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    modes = ["eager"] if args.smoke else args.modes.split(",")
    result = dict(meta=meta(argv), rows=[], host=host_costs(device) if args.host else [])
    def save(rows: list[dict]) -> None:  # as they come: a run stopped at its time limit keeps what it measured
        result["rows"] += rows
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    save([])  # the host figures, even where no case follows
    for case in cases(args.cases.split(","), device, args.smoke):
        run_case(case, args.variants.split(","), modes, device, 3 if args.smoke else args.reps, save)
    report([result], args.markdown, args.plot)


def run_apart(argv: list[str], args) -> None:
    """--apart: this command once per (case, variant) in a fresh process, its rows gathered
    (--alone does as much for Dynamo's state in one process, for less time).
    Models compiled side by side in one process slowed each other's calls: in one plain
    compile run of llama8b_decode8 the dense model's step went from 1.74 ms to 2.70 ms as
    variants were compiled after it. --repeat N: N such processes each, in turns (fresh
    processes of one tree spread by more than a host-bound case's margin: 0.89x-1.16x for FP8
    2:4 at decode 32 under plain compile, 2026-11-27)."""
    result = dict(meta=meta(argv), rows=[], host=[])
    rest = without_options(argv, flags=("--apart",), valued=("--json", "--cases", "--variants", "--repeat"))
    for _ in range(args.repeat):
        for case in args.cases.split(","):
            for variant in [v for v in args.variants.split(",") if v != "dense"]:
                result["rows"] += rows_of_process(rest + ["--cases", case, "--variants", variant])
                if args.json:
                    args.json.write_text(json.dumps(result, indent=1))
    report([result], args.markdown, args.plot)


def rows_of_process(argv: list[str]) -> list[dict]:
    """The rows this tool records when run with argv in a process of its own (none if it failed)."""
    with tempfile.TemporaryDirectory() as scratch:
        part = Path(scratch) / "rows.json"
        subprocess.run([sys.executable, __file__, *argv, "--json", str(part)], check=False)
        return json.loads(part.read_text())["rows"] if part.exists() else []


def without_options(argv: list[str], flags: tuple, valued: tuple) -> list[str]:
    """argv without those flags and options (with their values, as "--x v" or "--x=v")."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in valued:
            skip = True
        elif arg not in flags and not arg.startswith(tuple(f"{option}=" for option in valued)):
            kept.append(arg)
    return kept


if __name__ == "__main__":
    main()
