"""tools/bench_generate.py and tools/families.py on tiny configs (CPU): every family builds and
generates, each variant's speedup and error are recorded, and the recorded run renders into
BENCHMARKS.md's tables."""
import copy
import importlib.util
import json
import sys
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load(name: str):
    sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_smoke_run_records_every_variant_and_renders(tmp_path):
    tool = load("bench_generate")
    out = tmp_path / "generate.json"
    tool.main(["--smoke", "--families", "gemma,phi3", "--variants", "dense,dense-merged,2:4,int8-dense,int8-2:4",
               "--json", str(out)])
    run = json.loads(out.read_text())
    rows = run["raw"]
    assert {(r["family"], r["variant"]) for r in rows} == {
        (f, v) for f in ("gemma", "phi3") for v in ("dense", "dense-merged", "2:4", "int8-dense", "int8-2:4")}
    assert all(r["speedup"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["logits_error"] < 2e-2 for r in rows if r["variant"] == "2:4")  # (the CPU reference: float32)
    assert all("speedup_vs_byte_dense" in r for r in rows if r["variant"] == "int8-2:4")
    table = run["tables"][0]
    assert [name for name, _ in table["columns"]][-1] == "int8-2:4 / int8-dense" and len(table["rows"]) == 2
    bench_md = load("benchmarks_md")
    assert "model.generate() tokens/s" in bench_md.render([run])


def test_merged_gated_mlps_compute_the_models_own():
    families = load("families")
    model = families.build(families.FAMILIES["gemma"], 2, "cpu", torch.float64, smoke=True)
    merged = families.merge_gated_mlps(copy.deepcopy(model))
    assert all(not hasattr(layer.mlp, "gate_proj") for layer in merged.model.layers)
    ids = torch.randint(3, 1000, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, model(ids).logits)


def test_cold_cells_are_the_median_process_of_dense_and_of_each_variant(monkeypatch):
    """Fresh processes differ by up to ~0.1 s: dense and each variant are timed alike (the median
    of --cold-rounds processes), not dense's best against a variant's one try."""
    tool = load("bench_generate")
    times = {"dense": iter([9.0, 0.30, 0.50, 0.40] + [0.3] * 9), "2:4": iter([0.70, 0.55, 0.90] + [0.6] * 9)}

    def cold_seconds(family, variant, tokens, layers, **how):
        return next(times[variant]), 0.1, 5
    monkeypatch.setattr(tool, "cold_seconds", cold_seconds)
    saved = []
    args = tool.argparse.Namespace(families=[tool.FAMILIES["llama"]], cold_calls="prefill", cold_rounds=3,
                                   cold=["2:4"], cold_kernels="k", cold_trace=False, layers=2)
    tool.cold_rows(args, saved.extend)
    row = saved[0]
    assert (row["dense_first_s"], row["first_s"], row["x_dense"]) == (0.4, 0.7, 1.75)  # (9.0: the page-cache warm-up)
    assert tool.median_run([(3.0, "a"), (1.0, "b"), (2.0, "c"), (4.0, "d")]) == (2.0, "c")


def test_the_cold_script_is_python_with_each_of_its_views():
    tool = load("bench_generate")
    for profile, trace in ((False, False), (True, False), (False, True)):
        compile(tool.COLD_SCRIPT.format(tools=str(TOOLS), family="phi3", variant="2:4", tokens=1, layers=2,
                                        profile=profile, trace=trace), "cold", "exec")


def test_cold_warmed_only_times_each_variant_once_a_round_with_background_builds(monkeypatch):
    """--cold-warmed-only: no second set of processes without background builds (SPARSEGEN_WARM=0)."""
    tool = load("bench_generate")
    calls = []

    def cold_seconds(family, variant, tokens, layers, warm=True, **how):
        calls.append((variant, warm))
        return 0.5, 0.1, 3
    monkeypatch.setattr(tool, "cold_seconds", cold_seconds)
    saved = []
    args = tool.argparse.Namespace(families=[tool.FAMILIES["llama"]], cold_calls="prefill", cold_rounds=3,
                                   cold=["2:4"], cold_kernels=None, cold_warmed_only=True, cold_trace=False, layers=2)
    tool.cold_rows(args, saved.extend)
    assert calls.count(("2:4", True)) == 3 and ("2:4", False) not in calls
    assert "unwarmed_s" not in saved[0]
    args.cold_warmed_only, calls[:] = False, []
    tool.cold_rows(args, saved.extend)
    assert calls.count(("2:4", False)) == 3 and saved[-1]["unwarmed_s"] == 0.5
