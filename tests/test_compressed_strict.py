"""load_compressed all or nothing: every incomplete, inconsistent or broken checkpoint is
refused with an InputError before the model changes (its state and module types are
checked after each refusal); strict=False loads what matches and reports the rest."""
import json

import pytest
import safetensors.torch as safetensors_torch
import torch

import sparsegen
from sparsegen.errors import InputError
from test_compressed import checkpoint, logits, tiny_llama

LAYER = "model.layers.1.mlp.down_proj"


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]


def assert_unchanged(model, before):
    state, types = before
    assert [type(m) for m in model.modules()] == types
    now = model.state_dict()
    assert now.keys() == state.keys() and all(torch.equal(state[k], v) for k, v in now.items())


def refused(folder, match, **kwargs):
    """The load of `folder` into a fresh model raises InputError matching `match`; the model is unchanged."""
    model = tiny_llama(2, **kwargs.pop("config", {}))
    before = snapshot(model)
    with pytest.raises(InputError, match=match):
        sparsegen.load_compressed(model, folder, **kwargs)
    assert_unchanged(model, before)


def edit(folder, change, file="model.safetensors"):
    stored = safetensors_torch.load_file(str(folder / file))
    change(stored)
    safetensors_torch.save_file(stored, str(folder / file))
    return stored


def drop(*prefixes):
    def change(stored):
        for key in [k for k in stored if k.startswith(prefixes)]:
            del stored[key]
    return change


@pytest.fixture
def bf16(tmp_path):
    return checkpoint(tmp_path, "bf16")


def test_a_missing_layer_or_embedding_is_refused_and_strict_false_reports_it(bf16):
    edit(bf16, drop(LAYER + ".", "model.embed_tokens."))
    refused(bf16, f"Expected every entry of the model's state_dict in the checkpoint.*Got none for "
                  f"model.embed_tokens.weight, {LAYER}.weight")
    model = tiny_llama(2)
    result = sparsegen.load_compressed(model, bf16, strict=False)
    assert result.missing_keys == ["model.embed_tokens.weight", f"{LAYER}.weight"] and result.unexpected_keys == []
    assert type(model.get_submodule(LAYER)) is torch.nn.Linear
    assert all(isinstance(model.get_submodule(n), (sparsegen.Sparse24Linear,)) for n in result.layers)


def test_an_extra_tensor_is_refused_and_strict_false_leaves_it_out(bf16):
    edit(bf16, lambda stored: stored.update({"model.extra.weight": torch.ones(3), f"{LAYER}.bias": torch.ones(128)}))
    refused(bf16, f"Expected every tensor of the checkpoint to be one of the model's.*model.extra.weight, {LAYER}.bias")
    result = sparsegen.load_compressed(tiny_llama(2), bf16, strict=False)
    assert result.unexpected_keys == ["model.extra.weight", f"{LAYER}.bias"] and result.missing_keys == []


def test_the_shard_index_is_followed(bf16):
    stored = safetensors_torch.load_file(str(bf16 / "model.safetensors"))
    (bf16 / "model.safetensors").unlink()
    first = {k: v for k, v in stored.items() if k.startswith("model.layers.0.")}
    second = {k: v for k, v in stored.items() if k not in first}
    safetensors_torch.save_file(first, str(bf16 / "model-00001-of-00002.safetensors"))
    safetensors_torch.save_file(second, str(bf16 / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    (bf16 / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # A stray file outside the index, holding a wrong embedding: never read.
    safetensors_torch.save_file({"model.embed_tokens.weight": torch.zeros(311, 128, dtype=torch.bfloat16)},
                                str(bf16 / "stray.safetensors"))
    model = tiny_llama(2)
    sparsegen.load_compressed(model, bf16)
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"])
    (bf16 / "model-00001-of-00002.safetensors").unlink()
    refused(bf16, "Expected the shard 'model-00001-of-00002.safetensors' that model.safetensors.index.json names")
    safetensors_torch.save_file(first, str(bf16 / "model-00001-of-00002.safetensors"))
    del weight_map["model.norm.weight"]
    (bf16 / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(bf16, "Expected model-00002-of-00002.safetensors to hold the tensors .* Got also .*model.norm.weight")
    (bf16 / "model.safetensors.index.json").write_text("[1, 2]")
    refused(bf16, "Expected .*model.safetensors.index.json to hold a JSON object. Got list")


def test_a_tensor_in_two_files_without_an_index_is_refused(bf16):
    safetensors_torch.save_file({"model.norm.weight": torch.zeros(128, dtype=torch.bfloat16)},
                                str(bf16 / "zz-extra.safetensors"))
    refused(bf16, "Expected each tensor in one file.*'model.norm.weight' in both model.safetensors and zz-extra")


@pytest.mark.parametrize("key, value, match", [
    ("model.embed_tokens.weight", torch.ones(311, 128, dtype=torch.int64),
     "model.embed_tokens.weight of dtype torch.bfloat16 .*Got torch.int64"),
    ("model.norm.weight", torch.ones(128, dtype=torch.float8_e4m3fn), "model.norm.weight of dtype torch.bfloat16"),
    (f"{LAYER}.compressed", torch.randn(128, 160), f"{LAYER}: Expected compressed values of dtype torch.bfloat16"),
    ("model.norm.weight", torch.ones(1, dtype=torch.bfloat16), "model.norm.weight of shape \\(128,\\)"),
])
def test_dtypes_and_shapes_are_checked_against_the_model(bf16, key, value, match):
    edit(bf16, lambda stored: stored.update({key: value}))
    refused(bf16, match)


@pytest.mark.parametrize("shape, dtype", [((1,), torch.bfloat16), ((7,), torch.bfloat16),
                                          ((128,), torch.float8_e4m3fn)])
def test_a_bias_of_another_shape_or_a_one_byte_bias_is_refused(tmp_path, shape, dtype):
    folder = checkpoint(tmp_path, "bf16", attention_bias=True)
    name = "model.layers.0.self_attn.o_proj"
    edit(folder, lambda stored: stored.update({f"{name}.bias": torch.ones(shape).to(dtype)}))
    refused(folder, f"{name}: Expected a floating bias of 16 or 32 bits and shape \\(128,\\)",
            config=dict(attention_bias=True))


@pytest.mark.parametrize("kind, key", [("bf16", f"{LAYER}.compressed"), ("fp8", f"{LAYER}.weight_scale"),
                                       ("bf16", "model.norm.weight")])
def test_non_finite_values_are_refused_unless_allowed(tmp_path, kind, key):
    folder = checkpoint(tmp_path, kind)
    stored = edit(folder, lambda stored: stored[key].view(-1)[5:7].copy_(torch.tensor([float("nan"), float("inf")])))
    refused(folder, "Expected finite values in .*allow_nonfinite=True.* Got 2 NaN or infinite")
    model = tiny_llama(2)
    sparsegen.load_compressed(model, folder, allow_nonfinite=True, fuse=False)
    assert stored[key].isnan().any()


@pytest.mark.parametrize("text, match", [("{not json", "config.json to hold JSON. Got JSONDecodeError"),
                                         ("[1, 2]", "config.json to hold a JSON object. Got list"),
                                         ('{"quantization_config": [1]}', "quantization_config as a JSON object")])
def test_a_broken_config_is_an_input_error_naming_the_file(bf16, text, match):
    (bf16 / "config.json").write_text(text)
    refused(bf16, match)


@pytest.mark.parametrize("damage", ["truncated", "not safetensors"])
def test_a_broken_safetensors_file_is_an_input_error_naming_it(bf16, damage):
    path = bf16 / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100] if damage == "truncated" else b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    refused(bf16, f"Expected {path} to be a whole safetensors file. Got SafetensorError")


def test_one_byte_values_without_their_scale_are_refused(tmp_path):
    folder = checkpoint(tmp_path, "fp8")
    edit(folder, drop(f"{LAYER}.weight_scale"))
    refused(folder, f"{LAYER}: Expected {LAYER}.weight_scale \\(one-byte values are stored with their scales\\)")


def test_a_sparse_format_over_dense_weights_is_refused(bf16):
    model = tiny_llama(0)
    safetensors_torch.save_file(dict(model.state_dict()), str(bf16 / "model.safetensors"))
    refused(bf16, "Expected 2:4 layers .*bitmask tensors.* Got none")


def test_fused_names_are_the_layers_the_model_has(bf16):
    model = tiny_llama(2)
    result = sparsegen.load_compressed(model, bf16)
    assert "model.layers.0.mlp.gate_up" in result.layers and not any("gate_proj" in n for n in result.layers)
    assert all(isinstance(model.get_submodule(n), sparsegen.Sparse24Linear) for n in result.layers)
    assert len(result.layers) == 12
    ids = torch.randint(0, 311, (1, 7))
    assert torch.isfinite(logits(model, ids)).all()


def test_tied_embeddings_are_covered_by_either_name(bf16):
    """A model whose lm_head is its embedding (tie_word_embeddings): a file without lm_head.weight is whole."""
    edit(bf16, drop("lm_head."))
    model = tiny_llama(2, tie_word_embeddings=True)
    result = sparsegen.load_compressed(model, bf16)
    assert result.missing_keys == [] and result.unexpected_keys == []
    stored = safetensors_torch.load_file(str(bf16 / "model.safetensors"))
    assert torch.equal(model.lm_head.weight, stored["model.embed_tokens.weight"])


def parameters_on_meta(model):
    """The model as accelerate's init_empty_weights() builds it: parameters without memory,
    buffers (rotary frequencies) allocated."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    return model


def test_a_model_with_its_parameters_on_meta_loads_without_the_dense_model(tmp_path):
    """What a sharded model is built from: nothing dense allocated, every tensor the file's."""
    folder = checkpoint(tmp_path, "bf16")
    plain, empty = tiny_llama(2), parameters_on_meta(tiny_llama(3))
    sparsegen.load_compressed(plain, folder)
    result = sparsegen.load_compressed(empty, folder, device="cpu")
    assert not [n for n, t in [*empty.named_parameters(), *empty.named_buffers()] if t.is_meta]
    assert [type(m) for m in empty.modules()] == [type(m) for m in plain.modules()] and result.layers
    ids = torch.randint(0, 311, (2, 9))
    torch.testing.assert_close(logits(empty, ids), logits(plain, ids), rtol=0, atol=0)


def test_a_meta_tensor_the_file_does_not_hold_is_refused_by_name(tmp_path):
    folder = checkpoint(tmp_path, "bf16")
    with torch.device("meta"):  # (buffers too: the rotary frequencies, which no checkpoint holds)
        model = tiny_llama(2)
    before = [type(m) for m in model.modules()]
    with pytest.raises(InputError, match="rotary_emb.inv_freq"):
        sparsegen.load_compressed(model, folder, device="cpu")
    assert [type(m) for m in model.modules()] == before
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(InputError, match="device= for one on the meta device"):
        sparsegen.load_compressed(parameters_on_meta(torch.nn.Linear(4, 4)), folder)


def test_a_device_other_than_the_models_is_refused(tmp_path):
    folder = checkpoint(tmp_path, "bf16")
    refused(folder, r"device= where the model's allocated tensors are \(cpu\)", device="meta")
