"""What every benchmark tool records: its tables as raw numbers with a format per column,
and where they were measured (GPU, date, commit, command), one JSON file per run.
tools/benchmarks_md.py renders BENCHMARKS.md from those files; nothing is typed in by hand.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

# BENCHMARKS.md's sections, in order: what users judge first comes first.
SECTIONS = ("Whole models", "Block-sparse layers", "2:4 semi-structured", "Training", "Compile and overheads", "Reliability")


def commit() -> str:
    """The tree measured: SPARSEGEN_COMMIT (tools/gpu_run.sh passes it: the device's copy has
    no .git), else git's HEAD, else 'unknown'."""
    if os.environ.get("SPARSEGEN_COMMIT"):
        return os.environ["SPARSEGEN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def meta(tool: str, argv: list[str], launcher: str = "PYTHONPATH=. python") -> dict:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else f"no GPU, {os.cpu_count()} CPU cores"
    return dict(tool=tool, gpu=gpu, date=str(datetime.date.today()), torch=torch.__version__, commit=commit(),
                command=" ".join([launcher, f"tools/{tool}", *argv]))


def cell_text(value, fmt: str) -> str:
    """fmt: a format spec for numbers ('.3f'), 'x' (a ratio, 1.23x), '%' (1.2%) or '' (as it is)."""
    if value is None:
        return "-"
    if fmt == "x":
        return f"{value:.2f}x"
    if fmt == "%":
        return f"{value:.1%}"
    return format(value, fmt) if fmt else str(value)


def row_text(columns, cells) -> str:
    return "| " + " | ".join(cell_text(v, fmt) for v, (_, fmt) in zip(cells, columns)) + " |"


def table_lines(table: dict) -> list[str]:
    """A recorded table as markdown: header, rows, then its notes (a table recorded with
    `across` shown pivoted: see pivoted)."""
    columns, rows = table["columns"], table["rows"]
    if table.get("across"):
        columns, rows = pivoted(columns, rows, table["across"], table["shown"])
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += [row_text(columns, cells) for cells in rows]
    return lines + ([""] + [f"- {note}" for note in table["notes"]] if table["notes"] else [])


def pivoted(columns: list, rows: list, across: str, shown: list[str]) -> tuple[list, list]:
    """One line per point of the columns before `across` (a sweep's dtype, shape and block),
    with `across` and the `shown` columns side by side for each of the point's rows in order
    (its k-th density: the value measured varies a little with the block grid, so it is
    shown, not matched). Columns that stay the same within every point are kept once; the
    others are left to the recorded JSON. A sweep of a hundred rows reads as a third."""
    names = [name for name, _ in columns]
    split = names.index(across)
    groups: dict[tuple, list] = {}
    for cells in rows:
        groups.setdefault(tuple(cells[:split]), []).append(cells)
    slots = max(len(group) for group in groups.values())
    steady = [at for at in range(split + 1, len(names)) if names[at] not in shown and _same_in(groups, at)]
    wide = [split] + [names.index(name) for name in shown]
    out_columns = columns[:split] + [columns[at] for at in steady]
    out_columns += [(f"{names[at]} {slot + 1}", columns[at][1]) for slot in range(slots) for at in wide]
    out_rows = [[*key, *[group[0][at] for at in steady],
                 *[group[slot][at] if slot < len(group) else None for slot in range(slots) for at in wide]]
                for key, group in groups.items()]
    return out_columns, out_rows


def _same_in(groups: dict, at: int) -> bool:
    """Whether column `at` holds one value within each group of rows."""
    return all(len({repr(cells[at]) for cells in group}) == 1 for group in groups.values())


class Table:
    """One table of a run: rows of raw values, printed as they come (a run stopped at its time
    limit has shown what it measured)."""

    def __init__(self, section: str, title: str, columns: list[tuple[str, str]], about: str = ""):
        assert section in SECTIONS, section
        self.section, self.title, self.columns, self.about = section, title, columns, about
        self.rows: list[list] = []
        self.notes: list[str] = []
        self.across, self.shown = None, []  # shown pivoted (table_lines) where set

    def pivot(self, across: str, shown: list[str]) -> "Table":
        """Render one line per point before column `across`, the `shown` columns side by side
        for each of its values (the JSON keeps every column of every row)."""
        names = [name for name, _ in self.columns]
        assert across in names and all(name in names for name in shown), (across, shown)
        self.across, self.shown = across, list(shown)
        return self

    def add(self, *cells) -> None:
        assert len(cells) == len(self.columns), (self.title, cells)
        self.rows.append(list(cells))
        print(row_text(self.columns, cells), flush=True)

    def as_dict(self) -> dict:
        pivot = dict(across=self.across, shown=self.shown) if self.across else {}
        return dict(section=self.section, title=self.title, about=self.about, columns=self.columns,
                    rows=self.rows, notes=self.notes, **pivot)


def write(path: Path | None, tool: str, argv: list[str], tables: list[Table],
          launcher: str = "PYTHONPATH=. python") -> None:
    """Record `tables` at `path` with what ran them (`launcher`: how the tool was started)."""
    if path is not None:
        path.write_text(json.dumps(dict(meta=meta(tool, argv, launcher), tables=[t.as_dict() for t in tables]),
                                   indent=1))
