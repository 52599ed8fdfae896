"""BENCHMARKS.md is generated: the recorded runs in tools/results/ render to exactly the
committed file, and a recorded table renders its raw values with its columns' formats."""
import json
import random
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
import bench_record  # noqa: E402
import benchmarks_md  # noqa: E402


def test_committed_document_is_what_the_recorded_runs_render():
    runs = benchmarks_md.load()
    assert runs, "no recorded runs in tools/results"
    assert benchmarks_md.DOCUMENT.read_text() == benchmarks_md.render(runs), \
        "BENCHMARKS.md was edited by hand or tools/results changed: run python tools/benchmarks_md.py"


def test_every_recorded_run_names_its_gpu_date_commit_and_command():
    for run in benchmarks_md.load():  # (and every run a table gathers rows of)
        for meta in [run["meta"]] + [m for table in run.get("tables", []) for m in table.get("runs", [])]:
            assert all(meta.get(key) for key in ("gpu", "date", "commit", "command", "torch")), meta
            assert meta["command"].startswith(("PYTHONPATH=. python tools/", "PYTHONPATH=. torchrun --nproc_per_node="))
            assert "tools/" in meta["command"]


def recorded(tmp_path, table, monkeypatch) -> dict:
    monkeypatch.setenv("SPARSEGEN_COMMIT", "abc1234")
    path = tmp_path / "20_run.json"
    bench_record.write(path, "bench.py", ["--acc"], [table])
    return json.loads(path.read_text())


def test_a_recorded_table_renders_its_values_with_its_formats(tmp_path, monkeypatch):
    ms, ratio, share = random.uniform(0.1, 9), random.uniform(0.5, 3), random.uniform(0, 1)
    table = bench_record.Table("Block-sparse layers", "A table", [("case", ""), ("ms", ".3f"), ("speed", "x"),
                                                                  ("share", "%"), ("peer", "x")], "what it shows")
    table.add("odd case", ms, ratio, share, None)
    table.notes = ["a note"]
    text = benchmarks_md.render([recorded(tmp_path, table, monkeypatch)])
    assert "## Block-sparse layers" in text and "### A table" in text and "what it shows" in text
    assert f"| odd case | {ms:.3f} | {ratio:.2f}x | {share:.1%} | - |" in text
    assert "commit abc1234" in text and "`PYTHONPATH=. python tools/bench.py --acc`" in text
    assert "- a note" in text
    assert "## 2:4 semi-structured" not in text  # a section without runs is left out


def test_a_table_of_several_runs_names_each(tmp_path, monkeypatch):
    table = bench_record.Table("Compile and overheads", "Gathered", [("v", "")])
    table.add(1)
    run = recorded(tmp_path, table, monkeypatch)
    other = dict(run["meta"], commit="def5678", command="PYTHONPATH=. python tools/bench.py --other")
    run["tables"][0]["runs"] = [run["meta"], other]
    text = benchmarks_md.render([run])
    assert "Measured:\n\n- " in text and "commit abc1234" in text and "commit def5678" in text
    assert "`PYTHONPATH=. python tools/bench.py --other`" in text


def test_a_table_recorded_again_replaces_the_older_run(tmp_path, monkeypatch):
    tables = [bench_record.Table("Compile and overheads", "Measured twice", [("v", "")]) for _ in range(2)]
    tables[0].add(111)
    tables[1].add(222)
    old, new = (recorded(tmp_path, t, monkeypatch) for t in tables)
    old["meta"]["date"], new["meta"]["date"] = "2026-11-01", "2026-11-02"
    for runs in ([old, new], [new, old]):  # (the later date wins, whichever file comes first)
        text = benchmarks_md.render(runs)
        assert text.count("### Measured twice") == 1 and "| 222 |" in text and "| 111 |" not in text


def test_sections_come_in_the_documents_order(tmp_path, monkeypatch):
    tables = [bench_record.Table(section, section, [("v", "")]) for section in reversed(bench_record.SECTIONS[1:])]
    runs = [recorded(tmp_path, t, monkeypatch) for t in tables]
    text = benchmarks_md.render(runs)
    positions = [text.index(f"## {section}") for section in bench_record.SECTIONS[1:]]
    assert positions == sorted(positions)


def test_a_table_refuses_a_row_of_the_wrong_width_and_an_unknown_section():
    table = bench_record.Table("Training", "t", [("a", ""), ("b", ".1f")])
    with pytest.raises(AssertionError):
        table.add(1.0)
    with pytest.raises(AssertionError):
        bench_record.Table("Benchmarks I made up", "t", [("a", "")])


def test_a_pivoted_table_puts_each_points_rows_side_by_side_and_keeps_steady_columns_once():
    """A sweep recorded with Table.pivot: one line per (dtype, block), each row's density and
    speedup in order; a column steady within every point (dense ms) kept once, one that
    varies and is not shown (ms) left to the JSON."""
    table = bench_record.Table("Block-sparse layers", "sweep", [("dtype", ""), ("block", ""), ("density", ".2f"),
                                                                 ("dense ms", ".1f"), ("ms", ".1f"), ("x", "x")])
    table.pivot("density", ["x"])
    rng = random.Random(7)
    expected = []
    for dtype, block, dense in (("bf16", 64, 2.0), ("fp16", 128, 3.0)):
        line = [dtype, str(block), f"{dense:.1f}"]
        for density in (0.1, 0.25, 0.5):
            measured, speedup = density + rng.uniform(-0.004, 0.004), rng.uniform(0.5, 4)
            table.add(dtype, block, measured, dense, rng.uniform(0.1, 1), speedup)
            line += [f"{measured:.2f}", f"{speedup:.2f}x"]
        expected.append("| " + " | ".join(line) + " |")
    lines = bench_record.table_lines(table.as_dict())
    assert lines[0] == "| dtype | block | dense ms | density 1 | x 1 | density 2 | x 2 | density 3 | x 3 |"
    assert lines[2:] == expected


def test_a_cell_shows_only_its_latest_commits_runs():
    """A (case, variant, mode) measured again at a later commit replaces the older figure; two
    runs of one commit stay side by side; a run whose every cell was measured again is gone."""
    def run(commit, date, *cells):
        rows = [dict(case=case, variant=variant, mode="compile", speedup=s) for case, variant, s in cells]
        return dict(meta=dict(commit=commit, date=date), rows=rows)
    old = run("aaa", "2026-11-26", ("llama", "2:4", 0.9), ("bert", "2:4", 1.1))
    repeat = run("aaa", "2026-11-26", ("bert", "2:4", 1.2))
    new = run("bbb", "2026-11-27", ("llama", "2:4", 1.3))
    newest = run("ccc", "2026-11-28", ("gpt2", "2:4", 1.0))
    gone = run("ddd", "2026-11-25", ("gpt2", "2:4", 0.5))
    kept = benchmarks_md.current_rows([gone, old, repeat, new, newest])
    assert [(r["meta"]["commit"], [row["speedup"] for row in r["rows"]]) for r in kept] == [
        ("aaa", [1.1]), ("aaa", [1.2]), ("bbb", [1.3]), ("ccc", [1.0])]


def test_generate_runs_merge_cell_by_cell_the_latest_run_winning():
    """A generate() variant measured again replaces its older cell; variants only the older run
    measured stay; the table lists both runs and says how its cells were chosen."""
    def run(commit, *cells):
        meta = dict(tool="bench_generate.py", gpu="G", date="2026-11-28", commit=commit, torch="t",
                    command=f"PYTHONPATH=. python tools/bench_generate.py --{commit}")
        raw = [dict(model="M", mode="eager", prompt=128, batch=1, new=64, variant=variant, tokens_per_s=tps,
                    speedup=speedup, dense_copies_mb=0.0) for variant, tps, speedup in cells]
        return dict(meta=meta, tables=[], raw=raw)
    old = run("aaa", ("dense", 100.0, 1.0), ("2:4", 110.0, 1.1), ("b64d0.5", 95.0, 0.95))
    new = run("bbb", ("dense", 120.0, 1.0), ("2:4", 150.0, 1.25))
    (meta, table), = benchmarks_md.generate_tables([old, new])
    assert [m["commit"] for m in table["runs"]] == ["bbb", "aaa"] and meta["commit"] == "aaa"
    columns = [name for name, _ in table["columns"]]
    row = dict(zip(columns, table["rows"][0]))
    assert (row["dense tok/s"], row["2:4"], row["b64d0.5"]) == (120.0, 1.25, 0.95)
    assert "latest run" in table["notes"][0]
