"""The models tests/distributed_worker.py trains: a config-built Llama (2 decoder layers)
whose projections are sparse, one variant per trainable layer type (and a frozen one-byte
attention beside a trainable sparse MLP). Built the same on every rank from a seed."""
import torch
import transformers

import sparsegen

VOCAB, LR = 512, 0.3
MLP = r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj"
GATE_UP = r"model\.layers\.\d+\.mlp\.(gate|up)_proj"
ATTENTION = r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj"
BLOCK_ELL = dict(sparsity="block-ell", block=(64, 64), per_row=2)

# variant: (patch rules, fuse)
VARIANTS = {
    "dense": ({}, True),
    "bsr": ({MLP: {"block": (64, 64), "density": 0.5}}, True),            # GatedMLP of block-CSR
    "bsr-unfused": ({MLP: {"block": (64, 64), "density": 0.5}}, False),   # BlockSparseLinear each
    "2:4": ({MLP: {"sparsity": "2:4"}}, True),                            # GatedMLP of 2:4 (fixed mask)
    "2:4-unfused": ({MLP: {"sparsity": "2:4", "method": "transposable"}}, False),
    "2:4-recipe": ({MLP: {"sparsity": "2:4", "training": {"mask_interval": 2}}}, True),  # mask refresh
    "bdiag": ({MLP: {"sparsity": "block-diagonal", "nblocks": 4}}, False),
    "bell": ({MLP: BLOCK_ELL}, False),
    "bell-colwise": ({GATE_UP: BLOCK_ELL}, False),  # tensor parallelism: block-ELL splits column-wise only
    "scaled+bsr": ({ATTENTION: {"sparsity": "2:4", "weight_dtype": "e4m3"},
                    MLP: {"block": (64, 64), "density": 0.5}}, True),
    "int8+2:4": ({ATTENTION: {"sparsity": "2:4", "weight_dtype": "int8"}, MLP: {"sparsity": "2:4"}}, True),
    "int8-mlp": ({MLP: {"sparsity": "2:4", "weight_dtype": "int8"}}, True),          # frozen one-byte MLP
    "int8-mlp-unfused": ({MLP: {"sparsity": "2:4", "weight_dtype": "int8"}}, False),
}
# (loss, gradient) relative tolerances where rounding differs by more than bf16's default. e4m3
# activations: a token's quantized values move a step where the product before them summed in
# another order (the twin's M is twice a rank's: other kernels and splits); on an H100 the
# layer norm weights' gradients then differed by 2.9e-2 between the twin and both FSDP2 and DDP
# (which agreed with each other).
TOLERANCES = {"scaled+bsr": (5e-3, 5e-2)}


def config(mlp_bias: bool = False) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                    max_position_embeddings=128, tie_word_embeddings=False, mlp_bias=mlp_bias)


def build(variant: str, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The variant's model in bf16 on `device`, the same for a given seed on every rank
    (VARIANT+bias: the MLP's projections with biases)."""
    torch.manual_seed(seed)
    return patched(transformers.LlamaForCausalLM(config(mlp_bias=variant.endswith("+bias"))), variant,
                   from_dense=True).to(device, torch.bfloat16)


def patched(model: torch.nn.Module, variant: str, from_dense: bool) -> torch.nn.Module:
    rules, fuse = VARIANTS[variant.removesuffix("+bias")]
    if rules:
        sparsegen.patch(model, rules, fuse=fuse, from_dense=from_dense)
    return model


def checkpoint_activations(layer: torch.nn.Module) -> None:
    """Recompute the layer's activations in the backward: its forward under non-reentrant
    torch.utils.checkpoint, which torch.compile traces as one region (the composable
    torch.distributed._composable.checkpoint's hooks around a compiled layer recompute its
    tensors in another order: CheckpointError, dense layers included)."""
    forward = layer.forward

    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    layer.forward = checkpointed


def build_on_meta(variant: str) -> torch.nn.Module:
    """The variant's model as a large one is built: no memory, on the meta device, patched
    with from_dense=False (there are no weights to prune), in bf16."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config(mlp_bias=variant.endswith("+bias")))
    return patched(model, variant, from_dense=False).to(torch.bfloat16)
