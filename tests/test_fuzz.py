"""Bad-input fuzz of the public API (hypothesis): whatever a user passes, sparsegen either
computes the right thing or raises a SparsegenError / ValueError / TypeError that says
"Expected ... Got ..." - never an IndexError, a KeyError, a hang or a wrong result.

Small example budgets keep CI fast; `--hypothesis-seed` replays a failure.
"""
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import sparsegen
from sparsegen.jit import cache
from sparsegen import cli, env
from sparsegen.bsr.specs import forward_spec

FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ALLOWED = (sparsegen.SparsegenError, ValueError, TypeError)

sizes = st.one_of(st.integers(-4, 130), st.sampled_from([0, 16, 32, 64, 96, 128]), st.floats(allow_nan=True),
                  st.text(max_size=3), st.none())
blocks = st.one_of(st.tuples(sizes, sizes), st.integers(-2, 70), st.lists(st.integers(0, 64), max_size=3),
                   st.sampled_from([(16, 16), (32, 32), (16, 32), (64, 64)]), st.text(max_size=4))
densities = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.25, 0.5, 1.0]),
                      st.integers(-1, 2), st.text(max_size=2))
dtypes = st.sampled_from([None, torch.float32, torch.float64, torch.float16, torch.int64, torch.bool, "float32"])
methods = st.one_of(st.sampled_from(["magnitude", "mvue", "transposable", "MAGNITUDE", ""]), st.integers(), st.none())


def assert_explained(error: BaseException) -> None:
    assert isinstance(error, ALLOWED), f"{type(error).__name__}: {error}"
    assert re.search(r"Expected .+\. Got ", str(error), re.S), f"{type(error).__name__} without Expected/Got: {error}"


def outcome(call):
    """call()'s result, or None after checking that its error explains itself."""
    try:
        return call()
    except ALLOWED as error:
        assert_explained(error)
        return None


def assert_computes_its_weight(layer, batch: int = 3) -> None:
    """A layer that was built computes x W^T + b for its own (sparse) W, in float64."""
    x = torch.randn(batch, layer.in_features, dtype=torch.float32)
    weight = layer.to_dense_weight().double()
    expected = x.double() @ weight.T + (0 if layer.bias is None else layer.bias.double())
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-4, atol=1e-4)


@FUZZ
@given(sizes, sizes, blocks, densities, st.booleans(), dtypes, st.sampled_from(["block", "2:4", "4:8", 3]))
def test_linear(in_features, out_features, block, density, bias, dtype, sparsity):
    blocks_of = {} if sparsity == "2:4" else dict(block=block, density=density)  # (2:4 refuses them)
    layer = outcome(lambda: sparsegen.linear(in_features, out_features, bias=bias, dtype=dtype, sparsity=sparsity,
                                             **blocks_of))
    if layer is not None and layer.values.dtype == torch.float32:
        assert_computes_its_weight(layer)


@FUZZ
@given(st.sampled_from([16, 32, 48, 64, 100]), st.sampled_from([16, 32, 64, 96]), blocks, densities, methods,
       st.sampled_from(["none", "right", "shape", "values", "not a tensor"]))
def test_from_dense(in_features, out_features, block, density, method, mask_kind):
    dense = nn.Linear(in_features, out_features)
    mask = {"none": None, "not a tensor": [[True]], "shape": torch.ones(3, 5, dtype=torch.bool),
            "values": torch.ones(out_features, in_features, dtype=torch.bool),
            "right": torch.tensor([True, True, False, False]).repeat(out_features, in_features // 4 + 1)[:, :in_features]}[mask_kind]
    for build in (lambda: sparsegen.BlockSparseLinear.from_dense(dense, block=block, density=density),
                  lambda: sparsegen.Sparse24Linear.from_dense(dense, method=method, mask=mask)):
        layer = outcome(build)
        if layer is not None:
            assert_computes_its_weight(layer)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.act = nn.Linear(64, 128), nn.Linear(128, 64), nn.GELU()

    def forward(self, x):
        return self.down(self.act(self.up(x)))


settings_values = st.one_of(st.integers(-2, 100), st.floats(allow_nan=True), st.text(max_size=4), blocks,
                            st.none(), st.booleans(), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
rule_settings = st.one_of(
    st.dictionaries(st.sampled_from(["block", "density", "sparsity", "method", "layout", "training", "bogus"]),
                    settings_values, max_size=3),
    st.sampled_from([{"sparsity": "2:4"}, {"block": (16, 16), "density": 0.5}]), st.integers(), st.none())
patterns = st.one_of(st.sampled_from(["up", "down", ".*", "(", "up|down", "[", "*"]), st.text(max_size=5), st.integers())


@FUZZ
@given(st.dictionaries(patterns, rule_settings, max_size=3))
def test_patch_rules(rules):
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(2, 64)
    before = model(x).detach()
    dense = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    replaced = outcome(lambda: sparsegen.patch(model, rules))
    if replaced is None:  # refused: the model is untouched
        torch.testing.assert_close(model(x), before)
        assert all(isinstance(getattr(model, n), nn.Linear) for n in dense)
        return
    reference = sparsegen.dense_copy(model) if replaced else model
    torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-4)


@FUZZ
@given(st.tuples(st.integers(0, 70), st.integers(0, 130)) | st.tuples(st.integers(1, 4)) | st.just((2, 3, 32)),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.bool]), methods,
       st.sampled_from([None, "wrong shape", "too many"]))
def test_to_sparse24(shape, dtype, method, mask_kind):
    tensor = (torch.randn(shape) * 8).to(dtype)
    mask = None if mask_kind is None else (torch.ones(3, 3, dtype=torch.bool) if mask_kind == "wrong shape"
                                           else torch.ones(shape, dtype=torch.bool))
    sparse = outcome(lambda: sparsegen.to_sparse24(tensor, method=method if method is not None else "magnitude",
                                                   mask=mask))
    if sparse is not None:
        dense = sparse.to_dense()
        kept = dense != 0
        assert bool((kept.reshape(shape[0], -1, 4).sum(-1) <= 2).all())
        assert torch.equal(dense[kept], tensor[kept])  # kept values are the tensor's own


def crafted(t: torch.Tensor, kind: str):
    return {"same": t.clone(), "zeros": torch.zeros_like(t), "float": t.float(), "big": t.to(torch.int64) * 10 ** 6,
            "short": t.flatten()[: max(t.numel() - 1, 0)], "bool": t.bool(), "scalar": torch.tensor(3),
            "ones": torch.full_like(t, -1)}[kind]


entry_kinds = st.sampled_from(["same", "zeros", "float", "big", "short", "bool", "scalar", "ones"])


@FUZZ
@given(st.sampled_from(["block", "2:4", "2:4-train"]), st.dictionaries(st.integers(0, 7), entry_kinds, max_size=3))
def test_load_state_dict(kind, changes):
    """Every key present, values crafted: loads and computes its (then valid) weight, or is
    refused before anything is copied. (A missing key is torch's strict check.)"""
    torch.manual_seed(0)
    make = {"block": lambda: sparsegen.linear(64, 32, block=(16, 16)), "2:4": lambda: sparsegen.Sparse24Linear(64, 32),
            "2:4-train": lambda: sparsegen.Sparse24TrainingLinear(64, 32)}[kind]
    layer, source = make(), make()
    state = source.state_dict()
    names = sorted(state)
    for index, change in changes.items():
        name = names[index % len(names)]
        state[name] = crafted(state[name], change)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    if outcome(lambda: layer.load_state_dict(state)) is None:
        assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())  # untouched
    elif kind != "2:4-train":
        assert_computes_its_weight(layer)


cli_words = st.sampled_from(["precompile", "show", "cache", "info", "clear", "--list", "--arch", "sm_80", "sm_91",
                             "90", "--dtype", "bf16", "fp64", "--block", "32", "0", "32x", "--jobs", "-j", "-3",
                             "x", "bsr_dds", "bsr_dds_b32x32_bf16_nt_sm80_mma_t128w4x1s4", "--bundle", "--help"])


@FUZZ
@given(argv=st.lists(cli_words | st.text(max_size=6), max_size=6))
def test_cli_arguments(argv, capsys, tmp_path):
    if "precompile" in argv and "--bundle" not in argv:
        argv = argv + ["--bundle", str(tmp_path)]  # a used folder: refused before any compile
        (tmp_path / "used").touch()
    try:
        code = cli.main(argv)
    except SystemExit as exit:  # argparse: --help (0) or a usage error (2)
        code = exit.code
    err = capsys.readouterr().err
    assert code in (0, 1, 2), code
    assert "Traceback" not in err
    if code == 1:
        assert "Expected" in err and "Got" in err, err


# Paths stay inside the test's folder: relative ones (the run happens there) and "~" (HOME
# is there); root could otherwise make a cache anywhere. /dev/null: a file where a folder belongs.
env_values = st.one_of(st.sampled_from(["", "0", "1", "true", "no", "maybe", "~", ".", "/dev/null", "a:b", "2",
                                        "~/x:/dev/null"]),
                       st.text(st.characters(blacklist_characters="\0/", blacklist_categories=["Cs"]), max_size=8))
VARIABLES = ["SPARSEGEN_CACHE_DIR", "SPARSEGEN_TEAM_CACHE_DIR", "SPARSEGEN_DUMP_DIR", "SPARSEGEN_NO_DISK_CACHE",
             "SPARSEGEN_COMPRESS_KERNEL", "SPARSEGEN_DENSE_FALLBACK", "SPARSEGEN_KERNEL_BUNDLE"]
SPEC = forward_spec((16, 16), "bf16", 80)


@settings(FUZZ, max_examples=40)
@given(values=st.dictionaries(st.sampled_from(VARIABLES), env_values, min_size=1, max_size=3))
def test_environment_variables(values, monkeypatch, tmp_path):
    with monkeypatch.context() as patched:
        patched.chdir(tmp_path)
        patched.setenv("HOME", str(tmp_path))
        for name, value in values.items():
            patched.setenv(name, value)
        cache.clear_memory()
        built = outcome(lambda: cache.build(SPEC))
        assert built is None or len(built.cubin) > 1000
        layer = outcome(lambda: sparsegen.linear(64, 32, block=(16, 16)))
        if layer is not None:
            assert_computes_its_weight(layer)
    cache.clear_memory()
    assert os.environ.get("SPARSEGEN_TEAM_CACHE_DIR") is None and env.cache_dir().name == "sparsegen-cache"
