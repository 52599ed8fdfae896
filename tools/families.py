"""Decoder families built from transformers configs (no download), for the generation and
decode benchmarks: each at its named model's layer shapes with a few of its layers and a
32000-token vocabulary (the head stays dense in every variant, so a smaller one keeps the
figures about the layers sparsegen replaces). Bench only.

Chosen to differ where a sparse layer's cost does: q/k/v apart (Llama, Mistral) or with a
bias (Qwen2) or fused into one projection (Phi-3, whose gate/up arrive fused too), SiLU gates
(most) or tanh-GELU gates with head_dim 256 (Gemma), and MLP ratios from 3.5x to 8x.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

VOCAB = 32000


@dataclass(frozen=True)
class Family:
    name: str
    label: str
    config_class: str  # transformers' name for it
    model_class: str
    shape: dict  # the config's layer shapes
    vocab: int = VOCAB


FAMILIES = {f.name: f for f in [
    Family("llama", "Llama-3-8B-shaped", "LlamaConfig", "LlamaForCausalLM",
           dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)),
    Family("qwen2", "Qwen2.5-7B-shaped", "Qwen2Config", "Qwen2ForCausalLM",
           dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4)),
    Family("mistral", "Mistral-7B-shaped", "MistralConfig", "MistralForCausalLM",
           dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                sliding_window=None)),
    Family("gemma", "Gemma-7B-shaped", "GemmaConfig", "GemmaForCausalLM",
           dict(hidden_size=3072, intermediate_size=24576, num_attention_heads=16, num_key_value_heads=16,
                head_dim=256, hidden_activation="gelu_pytorch_tanh")),
    Family("phi3", "Phi-3-medium-shaped", "Phi3Config", "Phi3ForCausalLM",
           dict(hidden_size=5120, intermediate_size=17920, num_attention_heads=40, num_key_value_heads=10),
           vocab=32064),  # (its own: its pad token is 32000)
]}
# The README's suffix patterns: every projection, or the MLP's (Phi-3's fused qkv_proj and
# gate_up_proj end in _proj too).
PATTERNS = {"all": r"(self_attn|mlp)\.\w+_proj", "mlp": r"mlp\.\w+_proj"}
SMOKE_SHAPE = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)


def config(family: Family, layers: int, smoke: bool = False):
    import transformers

    shape = dict(family.shape)
    if smoke:
        shape.update(SMOKE_SHAPE, head_dim=32)
    made = getattr(transformers, family.config_class)(num_hidden_layers=layers, vocab_size=family.vocab,
                                                       max_position_embeddings=4096, **shape)
    made._attn_implementation = "sdpa"
    return made


def build(family: Family, layers: int, device, dtype, smoke: bool = False) -> nn.Module:
    """The family's model with seeded weights, initialised where it runs."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, family.model_class)(config(family, layers, smoke))
    return model.to(dtype=dtype).eval()


class MergedGatedMLP(nn.Module):
    """A gated MLP (gate_proj, up_proj, down_proj, act_fn) with gate and up as one nn.Linear:
    the dense baseline a careful user would run (one product of both, as Phi-3 ships it)."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.gate_up_proj = nn.Linear(gate.in_features, 2 * gate.out_features, bias=gate.bias is not None,
                                      device=gate.weight.device, dtype=gate.weight.dtype)
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(torch.cat([gate.weight, up.weight]))
            if gate.bias is not None:
                self.gate_up_proj.bias.copy_(torch.cat([gate.bias, up.bias]))
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def merge_gated_mlps(model: nn.Module) -> nn.Module:
    """Every MLP with separate gate and up projections merged (MergedGatedMLP), in place."""
    for name, module in list(model.named_modules()):
        if all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, MergedGatedMLP(module))
    return model
