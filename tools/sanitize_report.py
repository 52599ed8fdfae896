"""The sanitize step's record (tools/gpu_run.sh sanitize): one row per compute-sanitizer tool
- tests run and passed, kernels checked (by family), errors reported - from the step's logs,
as a results table for BENCHMARKS.md's reliability section.

    python tools/sanitize_report.py LOG_DIR [--json tools/results/60_sanitize.json]

LOG_DIR holds sanitize_TOOL.log (compute-sanitizer's output around pytest's) and
sanitize_TOOL_kernels.txt (the kernels the session loaded: tests/conftest.py's kernel log).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_record import Table, write  # noqa: E402
from sparsegen.jit.spec import INSTRS  # noqa: E402

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")


def family(kernel: str) -> str:
    """'bsr_dds wgmma bf16' from bsr_dds_b32x32_bf16_nt_sm90a_wgmma_t128w8x1s4: the op, the
    instruction and the dtype."""
    tokens = kernel.split("_")
    instr = next((t for t in tokens[2:] if t in INSTRS), "")
    return f"{tokens[0]}_{tokens[1]} {instr} {tokens[3]}"


def tool_row(folder: Path, tool: str) -> list | None:
    log = folder / f"sanitize_{tool}.log"
    if not log.is_file():
        return None
    text = log.read_text(errors="replace")
    summaries = re.findall(r"^=*\s*(\d+ (?:passed|failed).* in [\d.]+s.*)$", text, re.MULTILINE)  # pytest's last line
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|error)s?\b", summaries[-1] if summaries else "")}
    summary = re.findall(r"(?:ERROR SUMMARY: |RACECHECK SUMMARY: \d+ hazards displayed \()(\d+) error", text)
    kernels_file = folder / f"sanitize_{tool}_kernels.txt"
    kernels = kernels_file.read_text().split() if kernels_file.is_file() else []
    families = sorted({family(k) for k in kernels})
    finished = bool(summaries)
    return [tool, counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0), len(kernels),
            ", ".join(families), int(summary[-1]) if summary else None, "yes" if finished else "NO (time limit)"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tools", nargs="+", default=TOOLS, choices=TOOLS, help="the rows to report")
    args = parser.parse_args(argv)
    table = Table("Reliability", "compute-sanitizer over the GPU tests (tools/gpu_run.sh sanitize)", [
        ("tool", ""), ("tests passed", ""), ("tests failed", ""), ("kernels checked", ""), ("kernel families", ""),
        ("errors reported", ""), ("finished", "")],
        "Tests from tools/sanitize_tests.txt (SPARSEGEN_TEST_SAMPLE cases of each), sparsegen's kernels only "
        "(--kernel-name kns=_sm<arch>; every kernel where that filter misses the planted read), PyTorch's "
        "caching allocator off (each tensor its own allocation). Kernels checked: those the tests loaded.")
    for tool in args.tools:
        row = tool_row(args.logs, tool)
        if row is not None:
            table.add(*row)
    planted = args.logs / "sanitize.log"
    table.notes = [line for line in planted.read_text().splitlines() if line.startswith(("planted", "sample"))] \
        if planted.is_file() else []
    write(args.json, "sanitize_report.py", sys.argv[1:] if argv is None else argv, [table])
    return 0


if __name__ == "__main__":
    sys.exit(main())
