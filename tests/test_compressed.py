"""2:4 checkpoints as llm-compressor saves them (compressed-tensors' sparse-24-bitmask,
sparse-only and with FP8 / int8 weights) loaded by sparsegen.load_compressed, against the
same checkpoint decompressed to dense by compressed-tensors itself."""
import json

import compressed_tensors as ct
import pytest
import safetensors.torch as safetensors_torch
import torch
import transformers
from torch import nn

import sparsegen
from sparsegen.jit import epilogues
from sparsegen.compressed import unpack_bitmask
from sparsegen.errors import InputError
from sparsegen.semi24 import format as semi24

QUANTIZED = {"fp8": ("float", "float-quantized"), "int8": ("int", "int-quantized"),
             "fp8-static": ("float", "float-quantized")}
FOUR_BIT = {"w4a16": ("group", 128), "w4a16-channel": ("channel", None)}  # llm-compressor's W4A16 schemes


def tiny_llama(seed: int, **overrides):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**(dict(hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=311) | overrides))
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def prune_in_place(model) -> None:
    """Magnitude 2:4 on every projection (the decompressed model is then the pruned one)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            module.weight.data.mul_(semi24.magnitude_mask(module.weight.data))


def quantize_weights(model, kind: str) -> None:
    """compressed-tensors' scheme: weights per output channel (scales set as a min-max
    observer would), activations dynamic per token."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    type_, _ = QUANTIZED[kind]
    static = kind.endswith("-static")  # one activation scale per layer, stored with it
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type=type_, strategy="channel", symmetric=True, dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type=type_, strategy="tensor" if static else "token",
                                           symmetric=True, dynamic=not static))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    largest = 448.0 if kind == "fp8" else 127.0
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            scale = module.weight.detach().abs().amax(-1, keepdim=True).float() / largest
            module.weight_scale.data = scale.to(module.weight_scale.dtype)
        if hasattr(module, "input_scale"):
            module.input_scale.data.fill_(0.02)


def save_checkpoint(model, folder, kind: str) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.config import Sparse24BitMaskConfig
    sparsity = Sparse24BitMaskConfig(targets=["Linear"], ignore=["lm_head"])
    quantization = "pack-quantized" if kind in FOUR_BIT else QUANTIZED[kind][1] if kind != "bf16" else None
    compressor = ModelCompressor.from_pretrained_model(
        model, sparsity_config_or_format=sparsity, quantization_format=quantization)
    state = compressor.compress(model)
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    model.config.save_pretrained(str(folder))
    compressor.update_config(str(folder))


def checkpoint(tmp_path, kind: str, **overrides):
    model = tiny_llama(0, **overrides)
    prune_in_place(model)
    if kind != "bf16":
        quantize_weights(model, kind)
    save_checkpoint(model, tmp_path, kind)
    return tmp_path


def decompressed(folder, **overrides):
    """The checkpoint as transformers + compressed-tensors run it: the model given the
    checkpoint's quantization modules (activations quantized in its forward as the scheme
    says), then its weights decompressed to dense bf16."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    model = tiny_llama(1, **overrides)
    compressor = ModelCompressor.from_pretrained(str(folder))
    if compressor.quantization_config is not None and compressor.quantization_config.format == "pack-quantized":
        # 4-bit 2:4 weights are stored packed dense (no bitmask): compressed-tensors 0.14 writes them
        # so but its decompress would read the packed weights from the sparse step's output; its
        # quantization compressor alone unpacks them
        compressor.sparsity_compressor = None
    if compressor.quantization_config is not None:
        apply_quantization_config(model, compressor.quantization_config)
    stored = safetensors_torch.load_file(str(folder / "model.safetensors"))
    model.load_state_dict({k: v for k, v in stored.items() if k in model.state_dict()}, strict=False)
    compressor.decompress(str(folder), model)
    return model.to(torch.bfloat16)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


def test_sparse_only_checkpoint_loads_into_sparse24_layers_exactly(tmp_path):
    folder = checkpoint(tmp_path, "bf16")
    model = tiny_llama(2)  # other random weights: everything must come from the file
    names = sparsegen.load_compressed(model, folder, fuse=False).layers
    assert len(names) == 14 and all(isinstance(model.get_submodule(n), sparsegen.Sparse24Linear) for n in names)
    reference = decompressed(folder)
    for name in names:
        assert torch.equal(model.get_submodule(name).to_dense_weight(), reference.get_submodule(name).weight)
    ids = torch.randint(0, 311, (2, 19))
    assert torch.equal(logits(model, ids), logits(reference, ids))


@pytest.mark.parametrize("kind", ["fp8", "int8", "fp8-static"])
def test_quantized_checkpoint_loads_into_scaled_layers(tmp_path, kind):
    from compressed_tensors.compressors.sparse_compressors.sparse_24_bitmask import sparse24_bitmask_decompress
    folder = checkpoint(tmp_path, kind)
    model = tiny_llama(2)
    names = sparsegen.load_compressed(model, folder, fuse=False).layers  # every layer as the file has it
    reference = decompressed(folder)
    stored = safetensors_torch.load_file(str(folder / "model.safetensors"))
    for name in names:
        layer = model.get_submodule(name)
        assert isinstance(layer, sparsegen.ScaledSparse24Linear)
        assert (layer.input_scale is not None) == kind.endswith("-static")
        shape = (layer.out_features, layer.in_features)
        kept = semi24.decompress(layer.values, layer.metadata, shape)  # compressed-tensors' own unpacking:
        want_bytes = sparse24_bitmask_decompress(stored[f"{name}.compressed"], stored[f"{name}.bitmask"], shape)
        assert torch.equal(kept.view(torch.uint8), want_bytes.view(torch.uint8))
        want = reference.get_submodule(name).weight.float()
        assert torch.allclose(layer.to_dense_weight(), want, rtol=2 ** -7, atol=0)
    ids = torch.randint(0, 311, (4, 23))
    ours, dense = logits(model, ids), logits(reference, ids)
    assert (ours - dense).norm() / dense.norm() < (0.03 if kind == "int8" else 0.1)
    assert (ours.argmax(-1) == dense.argmax(-1)).double().mean() > 0.8


@pytest.mark.parametrize("kind", ["fp8", "int8", "bf16"])
def test_loaded_gated_mlps_are_fused_like_patched_ones(tmp_path, kind):
    """By default a loaded Llama's gate and up run as one 2:4 layer with the swiglu epilogue
    (each projection's stored values kept): the logits of the unfused model, within the
    rounding the fusion saves (an e4m3 step where the down projection requantizes)."""
    folder = checkpoint(tmp_path, kind)
    fused, unfused = tiny_llama(2), tiny_llama(2)
    sparsegen.load_compressed(fused, folder)
    sparsegen.load_compressed(unfused, folder, fuse=False)
    mlp, kind_of_layer = fused.model.layers[1].mlp, type(unfused.model.layers[1].mlp.gate_proj)
    assert type(mlp.gate_up) is kind_of_layer and mlp.gate_up.epilogue == "swiglu"
    gate, up = unfused.model.layers[1].mlp.gate_proj, unfused.model.layers[1].mlp.up_proj
    assert torch.equal(mlp.gate_up.to_dense_weight(),
                       epilogues.interleave_rows(gate.to_dense_weight(), up.to_dense_weight()))
    ids = torch.randint(0, 311, (2, 17))
    want = logits(unfused, ids)
    assert (logits(fused, ids) - want).norm() / want.norm() < (0.05 if kind == "fp8" else 0.02)


def four_bit_checkpoint(folder, kind: str, seed: int = 0):
    """A W4A16 2:4 checkpoint as llm-compressor writes one (2:4 pruned, then the weights
    quantized to 4 bits by compressed-tensors, scales as its min-max observer sets them:
    a group's largest magnitude / 7.5), "pack-quantized" with the sparse-24-bitmask config."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    model = tiny_llama(seed, intermediate_size=384)
    prune_in_place(model)
    strategy, group = FOUR_BIT[kind]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy=strategy, group_size=group, symmetric=True, dynamic=False))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.detach().float()
            w = w.reshape(w.shape[0], -1, group) if group else w.unsqueeze(1)
            module.weight_scale.data = (w.abs().amax(-1) / 7.5).clamp_min(1e-6).to(module.weight_scale.dtype)
    save_checkpoint(model, folder, kind)
    return folder


@pytest.mark.parametrize("kind", sorted(FOUR_BIT))
def test_four_bit_checkpoint_loads_into_int4_layers_as_compressed_tensors_decompresses_it(tmp_path, kind):
    folder = four_bit_checkpoint(tmp_path, kind)
    model = tiny_llama(2, intermediate_size=384)
    names = sparsegen.load_compressed(model, folder, fuse=False).layers
    assert len(names) == 14
    reference = decompressed(folder, intermediate_size=384)
    for name in names:
        layer = model.get_submodule(name)
        assert isinstance(layer, sparsegen.Int4Sparse24Linear)
        assert layer.group_size == (128 if kind == "w4a16" else layer.in_features)
        assert torch.equal(layer.to_dense_weight(), reference.get_submodule(name).weight)
    ids = torch.randint(0, 311, (3, 21))
    ours, want = logits(model, ids), logits(reference, ids)
    assert (ours - want).norm() / want.norm() < 1e-2
    fused = tiny_llama(2, intermediate_size=384)  # gate and up as one layer, the gated epilogue
    sparsegen.load_compressed(fused, folder)
    assert isinstance(fused.model.layers[0].mlp.gate_up, sparsegen.Int4Sparse24Linear)
    assert (logits(fused, ids) - want).norm() / want.norm() < 2e-2


def test_unpack_int4_is_compressed_tensors_packing():
    from compressed_tensors.compressors.quantized_compressors.pack_quantized import pack_to_int32
    from sparsegen.compressed import unpack_int4
    q = torch.randint(-8, 8, (37, 96), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_to_int32(q, 4), 96), q)


@pytest.mark.parametrize("change, message", [
    (lambda s, c: s.__setitem__("model.layers.0.mlp.up_proj.weight_packed",
                                s["model.layers.0.mlp.up_proj.weight_packed"] | 0x1111),
     "up_proj: Expected 4-bit values 2:4 .*Got [34] at row 0"),
    (lambda s, c: s.__setitem__("model.layers.0.mlp.up_proj.weight_scale",
                                -s["model.layers.0.mlp.up_proj.weight_scale"]), "finite scales above 0"),
    (lambda s, c: c["config_groups"]["group_0"]["weights"].update(group_size=64),
     "groups of a multiple of 128 columns"),
    (lambda s, c: c["config_groups"]["group_0"]["weights"].update(symmetric=False), "4-bit symmetric integer")])
def test_bad_four_bit_checkpoints_are_refused_before_the_model_changes(tmp_path, change, message):
    folder = four_bit_checkpoint(tmp_path, "w4a16")
    stored = safetensors_torch.load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    change(stored, config["quantization_config"])
    safetensors_torch.save_file(stored, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    model = tiny_llama(2, intermediate_size=384)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InputError, match=message):
        sparsegen.load_compressed(model, folder)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_bitmask_is_refused_before_the_model_changes(tmp_path):
    folder = checkpoint(tmp_path, "bf16")
    stored = safetensors_torch.load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj"
    stored[f"{name}.bitmask"][3, 2] |= 0xFF  # 4 kept in two groups
    safetensors_torch.save_file(stored, str(folder / "model.safetensors"))
    model = tiny_llama(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InputError, match=f"{name}: Expected a bitmask with 2 kept in every group of 4"):
        sparsegen.load_compressed(model, folder)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("part, value, message", [
    ("shape", torch.tensor([[320], [64]]), "Expected shape \\[320, 128\\]"),
    ("compressed", torch.zeros(320, 60, dtype=torch.bfloat16), "compressed values of shape \\(320, 64\\)"),
    ("bitmask", torch.zeros(320, 16, dtype=torch.int8), "a uint8 bitmask"),
])
def test_bad_layer_tensors_are_refused(tmp_path, part, value, message):
    folder = checkpoint(tmp_path, "bf16")
    stored = safetensors_torch.load_file(str(folder / "model.safetensors"))
    stored[f"model.layers.0.mlp.up_proj.{part}"] = value
    safetensors_torch.save_file(stored, str(folder / "model.safetensors"))
    with pytest.raises(InputError, match=message):
        sparsegen.load_compressed(tiny_llama(2), folder)


def test_other_formats_are_refused(tmp_path):
    folder = checkpoint(tmp_path, "bf16")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["sparsity_config"]["format"] = "sparse-bitmask"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="sparsity_config.format 'sparse-24-bitmask'.*Got 'sparse-bitmask'"):
        sparsegen.load_compressed(tiny_llama(2), folder)
    config["quantization_config"]["sparsity_config"]["format"] = "sparse-24-bitmask"
    config["quantization_config"]["format"] = "marlin-24"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="'pack-quantized' format .*deprecated 'marlin-24'.*Got 'marlin-24'"):
        sparsegen.load_compressed(tiny_llama(2), folder)
    with pytest.raises(InputError, match="a checkpoint directory with config.json"):
        sparsegen.load_compressed(tiny_llama(2), tmp_path / "missing")
    with torch.device("meta"):
        on_meta = nn.Linear(4, 4)
    with pytest.raises(InputError, match="Got the meta device"):
        sparsegen.load_compressed(on_meta, folder)
    with pytest.raises(InputError, match="Expected a torch.nn.Module"):
        sparsegen.load_compressed({"not": "a model"}, folder)


def test_unpack_bitmask_is_numpy_little_order():
    import numpy
    bits = torch.rand(5, 37) < 0.5
    packed = torch.from_numpy(numpy.packbits(bits.numpy(), axis=-1, bitorder="little"))
    assert torch.equal(unpack_bitmask(packed, 37), bits)
