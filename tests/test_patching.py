"""sparsegen.patch and BlockSparseLinear.to_linear on CPU models."""
import copy
import re

import pytest
import torch
import transformers
from torch import nn

import sparsegen


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(64, 4, batch_first=True)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64, bias=False)

    def forward(self, x):
        x = x + self.attention(x, x, x, need_weights=False)[0]
        return x + self.down(torch.relu(self.up(x)))


def model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def test_patch_replaces_matching_linears_and_keeps_the_kept_blocks():
    net, reference = model(), model()
    names = sparsegen.patch(net, {r"\d+\.up": {"block": (32, 32), "density": 0.5},
                                  r"\d+\.down": {"block": (16, 64), "density": 0.25}})
    assert names == ["0.up", "0.down", "1.up", "1.down"]
    for name in names:
        layer, dense = net.get_submodule(name), reference.get_submodule(name)
        assert isinstance(layer, sparsegen.BlockSparseLinear)
        kept = layer.to_dense_weight()
        torch.testing.assert_close(kept[kept != 0], dense.weight[kept != 0])
    assert isinstance(net[0].attention.out_proj, nn.Linear)  # MultiheadAttention is left alone
    x = torch.randn(2, 5, 64)
    assert net(x).shape == (2, 5, 64)
    net(x).sum().backward()
    assert net[0].up.values.grad is not None


def test_a_block_ell_rule_keeps_the_largest_blocks_of_each_block_row():
    """Every layout's face that takes rules is reachable from patch: block-ELL keeps, in each
    block row, the per_row blocks of largest norm with their pretrained values."""
    from sparsegen.bell.nn import BlockEllLinear
    net, reference = model(), model()
    sparsegen.patch(net, {r"0\.up": {"sparsity": "block-ell", "block": (32, 32), "per_row": 1}})
    layer, dense = net[0].up, reference[0].up.weight.detach()
    assert isinstance(layer, BlockEllLinear)
    kept = layer.to_dense_weight().detach()
    norms = dense.reshape(8, 32, 2, 32).norm(dim=(1, 3))
    assert torch.equal((kept.reshape(8, 32, 2, 32).abs().sum(dim=(1, 3)) > 0), norms == norms.max(1, keepdim=True).values)
    torch.testing.assert_close(kept[kept != 0], dense[kept != 0])


def test_density_one_patch_is_exactly_the_dense_model():
    net, reference = model(), model()
    sparsegen.patch(net, {r".*\.(up|down)": {"block": (16, 16), "density": 1.0}})
    x = torch.randn(3, 4, 64)
    torch.testing.assert_close(net(x), reference(x), rtol=1e-5, atol=1e-5)


def test_patch_errors_change_nothing():
    net = model()
    with pytest.raises(sparsegen.InputError, match="no match for"):
        sparsegen.patch(net, {r"\d+\.up": {"block": (32, 32)}, "missing": {}})
    with pytest.raises(sparsegen.InputError, match=r"0\.up: Expected block sides each one of \(16, 32, 64, 128\)"):
        sparsegen.patch(net, {r"\d+\.up": {"block": (96, 32)}})
    with pytest.raises(sparsegen.InputError, match=r"0\.up: Expected in_features \(64\)"):
        sparsegen.patch(net, {r"\d+\.up": {"block": (32, 128)}})
    with pytest.raises(sparsegen.InputError, match="keys from"):
        sparsegen.patch(net, {r"\d+\.up": {"blocksize": 32}})
    assert all(type(m) is not sparsegen.BlockSparseLinear for m in net.modules())


def test_patching_twice_says_the_layers_are_already_sparse():
    net = model()
    sparsegen.patch(net, {r"\d+\.(up|down)": {"block": (32, 32), "density": 0.5}})
    with pytest.raises(sparsegen.InputError, match=r"already made: 0\.up, 0\.down, 1\.up \(4 in all\)"):
        sparsegen.patch(net, {r"\d+\.(up|down)": {"sparsity": "2:4"}})
    with pytest.raises(sparsegen.InputError, match="has no nn.Linear"):  # matching no sparse layer either
        sparsegen.patch(net, {r"\d+\.upp": {"sparsity": "2:4"}})


def test_random_layout_when_not_from_dense():
    net = model()
    sparsegen.patch(net, {r"0\.up": {"block": (32, 32), "density": 0.5}}, from_dense=False)
    assert net[0].up.density == 0.5 and net[0].up.bias is not None


def test_to_linear_round_trip():
    layer = sparsegen.linear(96, 64, block=(16, 32), density=0.4)
    dense = layer.to_linear()
    x = torch.randn(7, 96)
    torch.testing.assert_close(dense(x), layer(x))
    assert torch.equal(dense.weight == 0, layer.to_dense_weight() == 0)


def test_patch_a_transformers_model():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(config).eval()
    reference = copy.deepcopy(net)
    ids = torch.randint(0, 100, (2, 16))
    # GPT-2's MLP uses transformers' Conv1D (weight stored [in, out]), attention c_attn too.
    names = sparsegen.patch(net, {r"transformer\.h\.\d+\.mlp\.c_(fc|proj)": {"block": (32, 32), "density": 1.0}})
    assert names == [f"transformer.h.{i}.mlp.{n}" for i in range(2) for n in ("c_fc", "c_proj")]
    torch.testing.assert_close(net(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_patch_bert_from_config():
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=100)
    net = transformers.BertModel(config).eval()
    names = sparsegen.patch(net, {r"encoder\.layer\.\d+\.(intermediate|output)\.dense": {"block": (32, 32), "density": 0.5}})
    assert len(names) == 4
    out = net(torch.randint(0, 100, (2, 12))).last_hidden_state
    assert out.shape == (2, 12, 64) and not out.isnan().any()


def test_patch_gpt2_with_24_matches_the_pruned_dense_model():
    """2:4 on transformers' Conv1D (weight stored [in, out]): the patched model computes
    what the dense model does with its weights pruned 2:4 along each output row."""
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(config).eval()
    reference = copy.deepcopy(net)
    names = sparsegen.patch(net, {r"transformer\.h\.\d+\.mlp\.c_(fc|proj)": {"sparsity": "2:4"}})
    assert all(isinstance(net.get_submodule(n), sparsegen.Sparse24Linear) for n in names) and len(names) == 4
    with torch.no_grad():
        for name in names:
            conv = reference.get_submodule(name)  # Conv1D: y = x @ weight + bias, weight [in, out]
            conv.weight.copy_(sparsegen.to_sparse24(conv.weight.t().contiguous()).to_dense().t())
    ids = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(net(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rules", [
    {r"\d+\.up": {"block": (32, 32), "density": 0.5}, r"\d+\.down": {"block": (16, 32), "density": 0.25}},
    {r"\d+\.(up|down)": {"sparsity": "2:4"}},
    {r"\d+\.(up|down)": {"sparsity": "2:4", "training": {"mask_interval": 5}}},
    {r"\d+\.(up|down)": {"sparsity": "block-ell", "block": (32, 32), "per_row": 1}},
], ids=["block", "2:4", "2:4-recipe", "block-ell"])
def test_dense_copy_computes_what_the_patched_model_does(rules):
    """sparsegen.dense_copy: plain nn.Linear layers holding the weights the sparse layers'
    products use (the recipe's masked weight too); the patched model is left as it was."""
    net = model().double()
    sparsegen.patch(net, rules)
    twin = sparsegen.dense_copy(net)
    from sparsegen.bell.nn import BlockEllLinear
    sparse_kinds = (sparsegen.BlockSparseLinear, sparsegen.Sparse24Linear, sparsegen.Sparse24TrainingLinear,
                    BlockEllLinear)
    assert not any(isinstance(m, sparse_kinds) for m in twin.modules())
    assert sum(isinstance(m, sparse_kinds) for m in net.modules()) == 4
    x = torch.randn(3, 7, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), net(x))
    masked = twin[0].up.weight == 0  # the pruned weights are zeros in the copy
    assert 0.2 < masked.double().mean() < 0.8


@pytest.mark.parametrize("settings", [{"block": (32, 32), "density": 0.5}, {"sparsity": "2:4"},
                                      {"sparsity": "block-diagonal", "nblocks": 4}])
def test_a_model_that_reads_its_linears_weight_dtype_runs_patched(settings):
    """T5's MLP reads `wo.weight` (casting its input to the dtype where it is a tensor): a
    sparse layer's `weight` describes the dense weight - shape, dtype, device - and is no
    tensor, so reading its values or freezing it through it fails loudly; the patched model
    computes what its dense copy does, forward and backward."""
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=96)
    net = transformers.T5ForConditionalGeneration(config).eval()
    names = sparsegen.patch(net, {r"DenseReluDense\.(wi|wo)": settings})
    assert len(names) == 8
    wo = net.encoder.block[0].layer[1].DenseReluDense.wo
    assert (wo.weight.shape, wo.weight.dtype, wo.weight.device) == ((64, 128), torch.float32, wo.values.device)
    assert wo.weight.size(1) == 128 and not isinstance(wo.weight, torch.Tensor)
    with pytest.raises(AttributeError, match="to_dense_weight"):
        wo.weight.sum()
    with pytest.raises(sparsegen.InputError, match="requires_grad_"):
        wo.weight.requires_grad = False
    assert repr(copy.deepcopy(wo.weight)) == repr(wo.weight)
    ids = torch.randint(1, 96, (2, 12))
    twin = sparsegen.dense_copy(net)
    batch = dict(input_ids=ids, decoder_input_ids=ids, labels=ids)
    loss, twin_loss = net(**batch).loss, twin(**batch).loss
    torch.testing.assert_close(loss, twin_loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert wo.values.grad is not None and wo.values.grad.abs().sum() > 0


@pytest.mark.parametrize("weight_dtype, dtype", [("int8", torch.int8), ("e4m3", torch.float8_e4m3fn)])
def test_one_byte_layers_weight_names_their_dtype(weight_dtype, dtype):
    """A one-byte 2:4 layer's `weight` describes its values' dtype, and a T5 with such MLPs
    (the layer quantizes the 16-bit input itself) runs as its dense copy does."""
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=96)
    net = transformers.T5ForConditionalGeneration(config).eval().to(torch.bfloat16)
    sparsegen.patch(net, {r"DenseReluDense\.(wi|wo)": {"sparsity": "2:4", "weight_dtype": weight_dtype}})
    wo = net.decoder.block[1].layer[2].DenseReluDense.wo
    assert (wo.weight.shape, wo.weight.dtype) == ((64, 128), dtype)
    ids = torch.randint(1, 96, (2, 12))
    with torch.no_grad():
        logits = net(input_ids=ids, decoder_input_ids=ids).logits.float()
        want = sparsegen.dense_copy(net)(input_ids=ids, decoder_input_ids=ids).logits.float()
    assert (logits - want).norm() / want.norm() < (2e-2 if weight_dtype == "int8" else 6e-2)  # (x's e4m3 steps)


ARCHITECTURES = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96)), {r"mlp\.(gate|up|down)_proj": {"block": (16, 16), "density": 0.5},
                          r"self_attn\.o_proj": {"sparsity": "2:4"}}),
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0)),
        {r"mlp\.c_(fc|proj)": {"sparsity": "2:4"}, r"attn\.c_(attn|proj)": {"block": (16, 16), "density": 0.5}}),
    "bert": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=96)),
        {r"intermediate\.dense": {"sparsity": "2:4"}, r"output\.dense": {"sparsity": "block-diagonal", "nblocks": 2}}),
    # gate and up fused in one checkpoint projection, q/k/v too (GatedForm's fused form)
    "phi3": (lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        {r"mlp\.\w+_proj": {"sparsity": "2:4"}, r"self_attn\.qkv_proj": {"block": (16, 16), "density": 0.5}}),
    # a tanh-GELU gate and head_dim apart from hidden / heads
    "gemma": (lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, hidden_activation="gelu_pytorch_tanh", vocab_size=96, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)), {r"mlp\.\w+_proj": {"block": (16, 16), "density": 0.5}}),
    # fc1 / activation_fn in the decoder layer itself
    "opt": (lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=96,
        word_embed_proj_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        {r"fc1|fc2": {"sparsity": "2:4"}}),
}
# What patch fuses in each: (GatedMLPs and their epilogue, activations taken into epilogues)
FUSED = {"llama": (2, "swiglu", 0), "gpt2": (0, None, 2), "bert": (0, None, 2), "phi3": (2, "swiglu", 0),
         "gemma": (2, "geglu_tanh", 0), "opt": (0, None, 2)}


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_patch_fuses_every_mlp_form_and_computes_the_unpatched_model(architecture):
    """Gated MLPs of either form (gate and up apart, or one gate_up projection) and of every
    gate activation become GatedMLPs; an MLP's activation after its first projection runs in
    that layer's epilogue. At density 1 (every block kept) the patched model is the unpatched
    one, so a fusion that swapped gate and up, or dropped an activation, fails here."""
    make, rules = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    model = make().double().eval()
    unpatched = copy.deepcopy(model)
    whole = {pattern: {"block": (16, 16), "density": 1.0} for pattern in rules}
    sparsegen.patch(model, whole)
    gated = [m for m in model.modules() if isinstance(m, sparsegen.GatedMLP)]
    taken = [m for m in model.modules() if type(m).__name__ == "FusedActivation"]
    count, epilogue, activations = FUSED[architecture]
    assert (len(gated), len(taken)) == (count, activations)
    assert all(m.gate_up.epilogue == epilogue for m in gated)
    ids = torch.randint(3, 96, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, unpatched(input_ids=ids).logits)


def test_a_timm_style_mlp_takes_its_gelu():
    """timm's Mlp (fc1, act, fc2; ViT-L's MLP there) fuses nn.GELU into fc1's epilogue."""
    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))
    net = nn.Sequential(Mlp(), Mlp()).double()
    sparsegen.patch(net, {r"fc1|fc2": {"block": (16, 16), "density": 0.5}})
    assert net[0].fc1.epilogue == "gelu" and type(net[0].act).__name__ == "FusedActivation"
    x = torch.randn(3, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(net(x), sparsegen.dense_copy(net)(x))


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_dense_copy_is_the_unpatched_models_structure_and_exports(architecture, tmp_path):
    """dense_copy puts patch's fusions apart (a GatedMLP back to the model's MLP, an activation
    taken into an epilogue back to its module) and GPT-2's Conv1D layers back to Conv1D: its
    state_dict has the unpatched model's names and shapes, so save_pretrained and transformers'
    own from_pretrained give a model with the sparse one's logits."""
    make, rules = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    model, unpatched = make().eval(), make()
    sparsegen.patch(model, rules)
    twin = sparsegen.dense_copy(model)
    assert ({k: v.shape for k, v in twin.state_dict().items()}
            == {k: v.shape for k, v in unpatched.state_dict().items()})
    assert {type(m).__name__ for m in twin.modules()} == {type(m).__name__ for m in unpatched.modules()}
    twin.save_pretrained(tmp_path)
    exported = type(unpatched).from_pretrained(tmp_path).eval()
    ids = torch.randint(1, 96, (2, 11))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for copy_ in (twin, exported):
            torch.testing.assert_close(copy_(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


META_RULES = [{"block": (16, 16), "density": 0.5}, {"sparsity": "2:4"}, {"sparsity": "2:4", "weight_dtype": "int8"},
              {"sparsity": "2:4", "training": {"mask_interval": 3}}, {"sparsity": "block-ell", "block": (16, 16), "per_row": 2},
              {"sparsity": "block-diagonal", "nblocks": 4}]


@pytest.mark.parametrize("settings", META_RULES, ids=lambda s: s.get("sparsity", "block") + s.get("weight_dtype", ""))
def test_a_model_built_on_the_meta_device_patches_and_loads_a_checkpoint(settings):
    """The large-model pattern: build on the meta device, patch with from_dense=False (no
    weights to prune there; from_dense=True says so), to_empty - where a forward is refused,
    the index buffers being uninitialized memory - then load a patched model's state_dict:
    the same logits."""
    make, _ = ARCHITECTURES["llama"]
    rules = {r"mlp\.(gate|up|down)_proj": settings}
    torch.manual_seed(0)
    source = make().eval()
    sparsegen.patch(source, rules)
    with torch.device("meta"):
        model = make()
    with pytest.raises(sparsegen.InputError, match="from_dense=False for a model built on the meta device"):
        sparsegen.patch(model, rules)
    sparsegen.patch(model, rules, from_dense=False)
    model.to_empty(device="cpu").eval()
    model.model.rotary_emb = type(source.model.rotary_emb)(source.config)  # (the one buffer no state_dict holds)
    ids = torch.randint(1, 96, (2, 7))
    if settings.get("sparsity") != "block-diagonal":  # (its layout is its shape: no index to leave unwritten)
        with pytest.raises(sparsegen.InputError, match="built on the meta device to get its layout"):
            model(input_ids=ids)  # (to_empty's bytes are no layout: nothing runs before a load)
    model.load_state_dict(source.state_dict())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, source(input_ids=ids).logits)


@pytest.mark.parametrize("architecture", ["gpt2", "bert", "gemma"])
def test_the_saving_recipe_round_trips_tied_models(architecture, tmp_path):
    """docs/recipes.md's save_model / load_model on models whose head shares the embedding's
    tensor: from the file and from a save_pretrained folder, the same logits, the head tied."""
    from safetensors.torch import load_model, save_model

    make, rules = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    model = make().eval()
    sparsegen.patch(model, rules)
    save_model(model, str(tmp_path / "sparse.safetensors"))
    model.save_pretrained(tmp_path / "folder")
    ids = torch.randint(3, 96, (2, 9))
    for path in (tmp_path / "sparse.safetensors", tmp_path / "folder" / "model.safetensors"):
        again = make().eval()
        sparsegen.patch(again, rules, from_dense=False)
        load_model(again, str(path))
        head, embedding = again.get_output_embeddings().weight, again.get_input_embeddings().weight
        assert head.data_ptr() == embedding.data_ptr()
        with torch.no_grad():
            assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_pattern_widened_past_its_role_warns_and_strict_refuses():
    """BERT's r"(intermediate|output)\\.dense" also finds attention.output.dense: a warning
    names both roles and an anchored pattern; strict=True refuses before anything changes."""
    make, _ = ARCHITECTURES["bert"]
    model = make()
    with pytest.warns(UserWarning, match=r"matches 'output.dense' in 2 roles: .*attention\.output\.dense.*"
                                         r"layer\\\\.\\\\d\+\\\\.output\\\\.dense"):
        sparsegen.patch(model, {r"(intermediate|output)\.dense": {"sparsity": "2:4"}})
    model = make()
    with pytest.raises(sparsegen.InputError, match="one role"):
        sparsegen.patch(model, {r"(intermediate|output)\.dense": {"sparsity": "2:4"}}, strict=True)
    assert not any(type(m).__module__.startswith("sparsegen.") for m in model.modules())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (patterns of one role each: no warning)
        sparsegen.patch(model, {r"layer\.\d+\.(intermediate|output)\.dense": {"sparsity": "2:4"}}, strict=True)
        sparsegen.patch(ARCHITECTURES["llama"][0](), {r"(self_attn|mlp)\.\w+_proj": {"sparsity": "2:4"}}, strict=True)


def test_a_state_dict_of_the_mlp_unfused_names_the_fusion():
    """A checkpoint saved with gate and up apart (fuse=False) loaded into a fused model: an
    InputError that says so and how to match, not torch's list of keys."""
    make, rules = ARCHITECTURES["llama"]
    torch.manual_seed(0)
    apart = make()
    sparsegen.patch(apart, rules, fuse=False)
    fused = make()
    sparsegen.patch(fused, rules, from_dense=False)
    with pytest.raises(sparsegen.InputError, match=r"mlp\.gate_up's tensors .*fuse=False"):
        fused.load_state_dict(apart.state_dict())
    again = make()
    sparsegen.patch(again, rules, from_dense=False, fuse=False)
    again.load_state_dict(apart.state_dict())


@pytest.mark.parametrize("architecture", ["llama", "phi3", "opt"])
def test_a_loaded_models_sparse_layers_fuse_as_patch_fuses(architecture):
    """patching.fuse_loaded (load_compressed's fusion) on a model whose linears are already
    2:4 layers: gated MLPs of either form (Phi-3's one gate_up_proj split in its halves)
    become GatedMLPs and fc1's activation goes into its epilogue, computing what it did."""
    from sparsegen import patching

    make, _ = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    model = make().double().eval()
    loaded = {name: sparsegen.Sparse24Linear.from_dense(m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and re.search(r"mlp\.\w+_proj$|fc[12]$", name)}
    for name, layer in loaded.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    ids = torch.randint(3, 96, (2, 9))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    fused = patching.fuse_loaded(model, loaded)
    gated = [m for m in model.modules() if isinstance(m, sparsegen.GatedMLP)]
    taken = [m for m in model.modules() if type(m).__name__ == "FusedActivation"]
    assert (len(gated), len(taken), len(fused)) == {"llama": (2, 0, 2), "phi3": (2, 0, 2), "opt": (0, 2, 0)}[architecture]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before)
