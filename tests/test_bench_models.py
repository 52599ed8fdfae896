"""tools/bench_models.py on tiny transformers configs (CPU): the harness patches, times and
checks each model against its masked dense twin, and its report tabulates what it measured."""
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
import transformers  # noqa: F401 (the cases build transformers models)


def load_tool():
    path = Path(__file__).resolve().parents[1] / "tools" / "bench_models.py"
    spec = importlib.util.spec_from_file_location("bench_models", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_smoke_run_measures_checks_and_reports(tmp_path):
    tool = load_tool()
    out = tmp_path / "models.json"
    tool.main(["--smoke", "--cases", "bert16,llama_decode1", "--variants", "2:4,b64d0.5", "--json", str(out),
               "--markdown", str(tmp_path / "models.md")])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["case"].split(",")[0], r["variant"]) for r in rows} == {
        ("BERT-base", "2:4"), ("BERT-base", "b64d0.5"), ("Llama-shaped decode 1 seq", "2:4"),
        ("Llama-shaped decode 1 seq", "b64d0.5")}
    for row in rows:  # the sparse model computes what the dense model with its masked weights does
        assert "failed" not in row and row["ms"] > 0 and row["dense_ms"] > 0
        assert row["error"] < 1e-4
    table = (tmp_path / "models.md").read_text()
    assert "| BERT-base, batch 16 x 16 | eager |" in table


def test_family_decode_cases_patch_fused_projections_and_gelu_gates(tmp_path):
    """The generation benchmark's families as decode cases: Phi-3's fused qkv_proj and
    gate_up_proj and Gemma's tanh-GELU gates are patched and compute the masked dense model."""
    tool = load_tool()
    out = tmp_path / "families.json"
    tool.main(["--smoke", "--cases", "phi3_decode1,gemma_decode8", "--variants", "2:4,b64d0.5", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["case"].split(" decode")[0], r["variant"]) for r in rows} == {
        (family, variant) for family in ("Phi-3-medium-shaped (4 layers)", "Gemma-7B-shaped (4 layers)")
        for variant in ("2:4", "b64d0.5")}
    assert all("failed" not in row and row["error"] < 1e-4 for row in rows)


def test_training_case_checks_the_loss_after_steps_against_the_masked_dense_twin(tmp_path, monkeypatch):
    tool = load_tool()
    out = tmp_path / "train.json"
    tool.main(["--smoke", "--cases", "llama_train8k", "--variants", "b64d0.5,2:4-recipe", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {r["variant"] for r in rows} == {"b64d0.5", "2:4-recipe"}
    for row in rows:  # the loss after 3 AdamW steps is the twin's, within a small part of what it moved
        assert "failed" not in row and row["error"] < 0.05, row
    # A twin whose pruned weights learn (no masked gradients) takes other steps: the check sees it.
    monkeypatch.setattr(tool, "mask_gradients", lambda twin, model: None)
    tool.main(["--smoke", "--cases", "llama_train8k", "--variants", "b64d0.5", "--json", str(out)])
    assert json.loads(out.read_text())["rows"][0]["error"] > 0.05


def test_apart_runs_each_variant_in_a_process_of_its_own_and_gathers_the_rows(tmp_path):
    tool = load_tool()
    out = tmp_path / "apart.json"
    tool.main(["--smoke", "--apart", "--cases", "llama_decode1", "--variants", "dense,2:4,b64d0.5", "--json", str(out)])
    result = json.loads(out.read_text())
    assert "--apart" in result["meta"]["command"]
    assert sorted(r["variant"] for r in result["rows"]) == ["2:4", "b64d0.5"]
    assert all("failed" not in r and r["ms"] > 0 and r["error"] < 1e-4 for r in result["rows"])


def test_repeat_runs_each_variant_that_many_times_and_the_table_shows_every_run(tmp_path):
    tool = load_tool()
    out = tmp_path / "repeat.json"
    tool.main(["--smoke", "--apart", "--repeat", "2", "--cases", "llama_decode1", "--variants", "2:4",
               "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["2:4", "2:4"] and all(r["ms"] > 0 for r in rows)
    line = tool.model_table(rows)[2]
    speedups = [statistics.median(r["round_speedups"]) for r in rows]
    shown = " / ".join(f"{x:.2f}x" for x in speedups)
    assert f"| {sum(speedups) / 2:.2f}x median (runs: {shown})" in line, line


def test_a_failed_run_among_several_is_shown_as_one():
    tool = load_tool()
    rows = [dict(case="c", mode="eager", variant="2:4", failed="RuntimeError: x"),
            dict(case="c", mode="eager", variant="2:4", dense_ms=3.0, ms=2.0, error=1e-3)]
    assert tool.model_table(rows)[2] == "| c | eager | 3.000 | 1.50x median (runs: fails / 1.50x) |"
    odd = [dict(case="c", mode="eager", variant="2:4", dense_ms=3.0, ms=ms, error=1e-3) for ms in (1.0, 2.0, 4.0)]
    assert tool.model_table(odd)[2] == "| c | eager | 3.000 | 1.50x median (runs: 3.00x / 1.50x / 0.75x) |"
    assert tool.model_table(rows[:1])[2] == "| c | eager | - | fails |"


def test_a_cell_of_one_run_shows_its_speedup_alone():
    tool = load_tool()
    row = dict(case="c", mode="compile", variant="2:4", dense_ms=3.0, ms=2.0, error=1e-3)
    assert tool.model_table([row])[2] == "| c | compile | 3.000 | 1.50x |"


def test_without_options_drops_flags_and_options_with_their_values():
    tool = load_tool()
    argv = ["--apart", "--json", "a.json", "--cases=x", "--modes", "compile", "--variants", "2:4"]
    assert tool.without_options(argv, ("--apart",), ("--json", "--cases", "--variants")) == ["--modes", "compile"]


def test_pin_times_on_one_core_and_gives_every_core_back(tmp_path, monkeypatch):
    tool = load_tool()
    seen, before = [], os.sched_getaffinity(0)
    timed = tool.round_times
    monkeypatch.setattr(tool, "round_times", lambda *a, **k: seen.append(os.sched_getaffinity(0)) or timed(*a, **k))
    tool.main(["--smoke", "--pin", "--cases", "llama_decode1", "--variants", "2:4", "--json", str(tmp_path / "p.json")])
    assert seen and all(len(cores) == 1 and cores <= before for cores in seen), seen
    assert os.sched_getaffinity(0) == before
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert rows and all("failed" not in r and r["ms"] > 0 for r in rows)


def test_alone_gives_each_compiled_variant_a_dense_twin_compiled_again_after_a_reset(monkeypatch):
    """--alone: before each compiled (variant, mode), Dynamo forgets every graph and the dense
    twin's step of that mode is made again (so it compiles beside that variant alone); eager
    steps are kept. (The CPU run has no Inductor build to spare: the compile is a stand-in.)"""
    tool = load_tool()
    events = []
    monkeypatch.setattr(tool.torch._dynamo, "reset", lambda: events.append("reset"))
    monkeypatch.setattr(tool, "in_mode", lambda model, mode: events.append(f"step {mode}") or model)
    monkeypatch.setattr(tool, "round_times", lambda steps, device, reps, rounds: [[2.0, 1.0]] * rounds)
    model = nn.Linear(4, 4)
    case = tool.Case("c", "llama", lambda: model, lambda m: (lambda: m(torch.ones(1, 4))))
    dense = tool.DenseSteps(case)
    monkeypatch.setitem(tool.TIMING, "alone", True)
    for variant in ["2:4", "b64d0.5"]:
        for mode in ["eager", "compile"]:
            row = tool.measure_mode(case, variant, model, mode, [model(torch.ones(1, 4)).detach()], dense, torch.device("cpu"), 1)
            assert row["dense_ms"] == 2.0 and "failed" not in row, row
    # eager: the variant's step and dense's once; compile: a reset, then variant and dense steps made again
    assert events == ["step eager", "step eager", "reset", "step compile", "step compile",
                      "step eager", "reset", "step compile", "step compile"]


def test_rounds_take_the_steps_in_rotated_order_and_report_each_in_its_place(monkeypatch):
    """round_times starts round r with step r, so no step always follows a switch; every
    round's row still lists the steps' times in the order given."""
    tool = load_tool()
    calls = []
    def timed(step, device, reps):
        calls.append(step)
        return {"dense": 3.0, "a": 2.0, "b": 1.0}[step] + len(calls) / 1000
    monkeypatch.setattr(tool, "timed_ms", timed)
    times = tool.round_times(["dense", "a", "b"], torch.device("cpu"), 1, rounds=4)
    assert calls == ["dense", "a", "b", "a", "b", "dense", "b", "dense", "a", "dense", "a", "b"]
    assert [[round(t) for t in row] for row in times] == [[3, 2, 1]] * 4


def test_a_speedup_is_the_median_of_the_rounds_ratios_where_recorded():
    tool = load_tool()
    assert tool.speedup(dict(dense_ms=2.0, ms=1.0, round_speedups=[1.2, 0.5, 1.1])) == 1.1
    assert tool.speedup(dict(dense_ms=3.0, ms=2.0)) == 1.5
    assert tool.speedup(dict(dense_ms=3.0)) is None
    row = tool.timed_against_dense(lambda: None, lambda: None, torch.device("cpu"), 2)
    assert len(row["round_speedups"]) == tool.TIMING["rounds"] and row["ms"] > 0
