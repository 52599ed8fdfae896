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
