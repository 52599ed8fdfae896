"""Every structured file sparsegen reads is bounded and total (issue 59, item 3): JSON through
private_files.parse_json (size, nesting, number range), only regular files opened. Random and
adversarial contents give the documented outcome only: a value, or ValueError from the parser,
which a crossover table turns into "ignored, with a warning", a bundle manifest likewise, and a
checkpoint into an InputError naming the file. Never another exception, a hang or a crash."""
import json
import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsegen
from sparsegen import checkpoint_files, env
from sparsegen.errors import ConfigError, InputError, SpecError
from sparsegen.jit import bundle, private_files
from sparsegen.jit.spec import TileConfig
from sparsegen.launch import crossovers
from sparsegen.semi24 import scaled

HOSTILE = ['{"points": [{"n": 1e400}]}', '{"points": [{"n": ' + "9" * 401 + "}]}", "[" * 100_000 + "]" * 100_000,
           '{"points": NaN}', '{"points": [Infinity]}', "\udcff", '{"a": "' + "[" * 1000 + '"}', "", "{", "null"]
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=4), max_leaves=30)


@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode)
       | JSON_VALUES.map(lambda v: json.dumps(v, allow_nan=True).encode()))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_bytes_parse_to_a_value_or_a_value_error(raw):
    try:
        private_files.parse_json(raw)
    except ValueError:
        pass


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_json_is_a_value_error(text):
    if text in ("{", ""):
        with pytest.raises(ValueError):
            private_files.parse_json(text)
        return
    if text == "null" or text.startswith('{"a"'):
        private_files.parse_json(text)  # (valid, bounded: a value)
        return
    with pytest.raises(ValueError):
        private_files.parse_json(text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize("text", HOSTILE)
def test_a_hostile_crossover_table_is_ignored_with_a_warning(text, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(tmp_path))
    path = crossovers.user_table_path("NVIDIA H100 80GB HBM3")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    os.chmod(path.parent, 0o700)
    crossovers.reload()
    try:
        with pytest.warns(RuntimeWarning, match="ignoring the crossover table"):
            assert crossovers.table("NVIDIA H100 80GB HBM3") == ()
        assert not crossovers.dense_wins("NVIDIA H100 80GB HBM3", "sp24", 768, 768, 2048)
    finally:
        crossovers.reload()


@pytest.mark.parametrize("text", [t for t in HOSTILE if t != "null"])
def test_a_hostile_bundle_manifest_is_a_value_error(text, tmp_path):
    with pytest.raises(ValueError):
        bundle.parse(tmp_path, text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize("text", HOSTILE)
def test_a_hostile_checkpoint_json_is_an_input_error_naming_it(text, tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    if text.startswith('{"a"'):  # (brackets inside a string: a valid object)
        assert checkpoint_files.read_json(path) == json.loads(text)
        return
    with pytest.raises(InputError, match="config.json"):
        checkpoint_files.read_json(path)


def _returns_within(fn, seconds: float):
    """fn()'s exception (or None), failing the test if fn is still running after `seconds`."""
    outcome = {}

    def run():
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 (what it raised is the outcome looked at)
            outcome["error"] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the read blocked"
    return outcome.get("error")


@pytest.mark.parametrize("name", ["config.json", checkpoint_files.INDEX, "model.safetensors"])
def test_a_fifo_in_a_checkpoint_is_refused_unread(name, tmp_path):
    os.mkfifo(tmp_path / name)
    if name == "model.safetensors":
        error = _returns_within(lambda: checkpoint_files.read_tensors(tmp_path), 10)
    else:
        error = _returns_within(lambda: checkpoint_files.read_json(tmp_path / name), 10)
    assert isinstance(error, InputError), error


def test_a_json_file_over_the_cap_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_files, "MAX_JSON_BYTES", 1000)
    (tmp_path / "config.json").write_text(json.dumps({"pad": "x" * 2000}))
    with pytest.raises(InputError, match="limit"):
        checkpoint_files.read_json(tmp_path / "config.json")


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_one_byte_scales_are_finite_and_positive(bad):
    linear = torch.nn.Linear(64, 32)
    with pytest.raises(InputError, match="input_scale of finite scales above 0"):
        scaled.ScaledSparse24Linear.from_dense(linear, "e4m3", input_scale=bad)
    layer = scaled.ScaledSparse24Linear.from_dense(linear, "e4m3", input_scale=0.25)
    state = layer.state_dict()
    state["weight_scale"] = state["weight_scale"].clone().fill_(bad)
    if bad <= 0:  # (NaN and Inf load where the loader was told allow_nonfinite=True: test_compressed_strict)
        with pytest.raises(InputError, match="weight_scale of scales above 0"):
            layer.load_state_dict(state)
    assert float(layer.input_scale) == 0.25 and bool((layer.weight_scale > 0).all())


def test_a_tile_of_zero_warps_is_a_spec_error():
    with pytest.raises(SpecError, match="whole numbers >= 1"):
        TileConfig.from_tag("t64w0x1s4")
    with pytest.raises(SpecError):
        sparsegen.KernelSpec.from_name("sp24_dds_b16x32_bf16_nt_sm90a_tma_t64w0x1s4")


def test_persistent_waves_takes_ascii_digits_only(monkeypatch):
    monkeypatch.setenv("SPARSEGEN_PERSISTENT_WAVES", "\u00b2")
    with pytest.raises(ConfigError, match="SPARSEGEN_PERSISTENT_WAVES"):
        env.persistent_waves()


def test_a_one_byte_layer_builds_on_the_meta_device_and_checks_scales_on_load():
    with torch.device("meta"):
        layer = scaled.ScaledSparse24Linear.from_dense(torch.nn.Linear(64, 32), "e4m3")
    assert layer.weight_scale.is_meta


FILE_BYTES = (st.binary(max_size=400) | JSON_VALUES.map(lambda v: json.dumps({"points": [v], "weight_map": v,
                                                                                "format": v}).encode()))


@given(raw=FILE_BYTES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
def test_every_reader_gives_only_its_documented_outcome(raw, tmp_path_factory):
    """Random and structured-but-wrong contents for each file sparsegen reads: a crossover
    table gives its points or none (with a warning), a bundle manifest a Manifest or
    ValueError, a checkpoint's JSON a dict or InputError, a safetensors shard tensors or
    InputError. Nothing else escapes."""
    import warnings

    folder = tmp_path_factory.mktemp("inputs")
    (folder / "t.json").write_bytes(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert isinstance(crossovers.load(folder / "t.json"), tuple)
    try:
        bundle.parse(folder, raw)
    except ValueError:
        pass
    (folder / "config.json").write_bytes(raw)
    (folder / "model.safetensors").write_bytes(raw)
    for read in (lambda: checkpoint_files.read_json(folder / "config.json"),
                 lambda: checkpoint_files.read_tensors(folder)):
        try:
            read()
        except InputError:
            pass
