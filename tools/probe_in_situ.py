"""Host time of a product call where a compiled decode step makes it: the step timed as it
is, and with every call of one kind turned into a no-op - Inductor's extern mm/addmm (cuBLAS)
or sparsegen's launchers; the difference over the calls per step is one call's cost in
place, between Inductor's other work, which a burst of one call (probe_launch.py) does not
see. A step with no-ops computes garbage: only its time counts. Rounds time the two in turn.
GPU: PYTHONPATH=. python tools/probe_in_situ.py [--case llama_decode1] [--rounds 9] [variant ...]
--census N: instead, sparsegen's Python functions a step calls and how often (cProfile's
exact call counts over N steps of each variant, taken in turn): a plan made, a TMA descriptor
encoded or a full path taken per step is work a burst never repeats. With --everything: every
function and builtin, by its own host time per step (profiled), to compare a variant's step
with its dense twin's.
(--smoke: bench_models' tiny models on the CPU, to try the tool.)"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
from pathlib import Path

import torch
from torch._inductor.select_algorithm import extern_kernels

import sparsegen
import bench_models  # tools/ is on sys.path when run as a script

KINDS = {"cuBLAS (extern mm, addmm)": lambda name: name in ("mm", "addmm"),
         "sparsegen launchers": lambda name: name.startswith("sparsegen_")}


def names_of(kind: str) -> list[str]:
    return [name for name in dir(extern_kernels) if KINDS[kind](name)]


@contextlib.contextmanager
def replaced(names: list[str], make):
    """extern_kernels.<name> = make(name, original) for each name, until the block ends (a
    compiled graph looks them up at each call)."""
    originals = {name: getattr(extern_kernels, name) for name in names}
    try:
        for name, original in originals.items():
            setattr(extern_kernels, name, make(name, original))
        yield
    finally:
        for name, original in originals.items():
            setattr(extern_kernels, name, original)


def calls_per_step(step, names: list[str]) -> int:
    counts = []

    def counting(name, original):
        def call(*args, **kwargs):
            counts.append(name)
            return original(*args, **kwargs)
        return call
    with replaced(names, counting):
        getattr(step, "reset", lambda: None)()
        step()
    return len(counts)


def without(step, names: list[str]):
    """The step with those calls skipped (as cheap a Python call as each can be)."""
    def skipped(*args, **kwargs):
        return None

    def run():
        with replaced(names, lambda name, original: skipped):
            step()
    run.reset = getattr(step, "reset", lambda: None)
    return run


def probe(case, variant: str, device, reps: int, rounds: int) -> list[dict]:
    """The rows of one variant; its steps run in the grad mode they were warmed up in (the
    grad mode is in every graph's guards: another one compiles other graphs)."""
    with torch.set_grad_enabled(case.training):
        return _probe(bench_models.variant_step(case, variant, "compile"), variant, device, reps, rounds)


def _probe(step, variant: str, device, reps: int, rounds: int) -> list[dict]:
    rows = []
    for kind in KINDS:
        names = names_of(kind)
        calls = calls_per_step(step, names)
        if not calls:
            continue
        times = bench_models.round_times([step, without(step, names)], device, reps, rounds)
        whole, bare = (statistics.median(column) for column in zip(*times))
        per_call = statistics.median((a - b) / calls for a, b in times) * 1e3
        rows.append(dict(variant=variant, kind=kind, calls=calls, ms=whole, without_ms=bare, us_per_call=per_call))
    return rows


def census(steps: dict, count: int, everything: bool = False) -> dict:
    """{name: [(calls per step, host us per step spent in it, "module:line(function)")]} of
    sparsegen's functions (`everything`: of every function and builtin, Inductor's wrapper
    and torch's included), the most costly first, over `count` calls of each of `steps`
    ({name: step}) taken in turn, one profiler each: the host's speed drifts within a process
    (Triton's launches cost 8.1, 6.0 and 4.0 us in three variants profiled one after another on
    the H100 machine), and steps taken in turn meet the same drift."""
    profilers = {name: cProfile.Profile() for name in steps}
    for _ in range(count):  # (in the caller's grad mode: that of the warm-up)
        for name, step in steps.items():
            getattr(step, "reset", lambda: None)()
            profilers[name].enable()
            step()
            profilers[name].disable()
    return {name: _rows(profiler, count, everything) for name, profiler in profilers.items()}


PACKAGE = Path(sparsegen.__file__).resolve().parent


def in_package(file: str) -> bool:
    """Whether a profiled function's file is sparsegen's own module, by where the imported
    package lies (not by a folder's name: a checkout is itself called sparsegen after
    `git clone`, and its tests and tools would count)."""
    try:
        return Path(file).resolve().is_relative_to(PACKAGE)
    except (OSError, ValueError):
        return False


def _rows(profiler: cProfile.Profile, count: int, everything: bool) -> list[tuple[float, float, str]]:
    counted = pstats.Stats(profiler).stats  # {(file, line, function): (primitive calls, calls, own s, ...)}
    rows = [(calls / count, own / count * 1e6, f"{Path(file).parent.name}/{Path(file).name}:{line}({function})")
            for (file, line, function), (_, calls, own, *_) in counted.items() if everything or in_package(file)]
    return sorted(rows, key=lambda row: (row[1], row[0]) if everything else row, reverse=True)


def print_census(case, variants: list[str], count: int, everything: bool) -> None:
    """The census of the variants' compiled steps, built together (no Dynamo reset between)."""
    with torch.set_grad_enabled(case.training):
        steps = {variant: bench_models.variant_step(case, variant, "compile") for variant in variants}
        tables = census(steps, count, everything)
    for variant, rows in tables.items():
        print(f"\n{variant}: {'every function' if everything else 'sparsegen functions'} a step calls: calls per "
              f"step, host us of its own per step (profiled), over {count} steps taken in turn with the other "
              f"variants'; total {sum(r[1] for r in rows):.0f} us")
        for calls, us, where in rows[:40] if everything else rows:
            print(f"  {calls:8.2f}  {us:9.1f}  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="llama_decode1")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--census", type=int, default=0, help="list the calls over this many steps instead")
    parser.add_argument("--everything", action="store_true", help="the census of every function, not sparsegen's")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("variants", nargs="*", default=["dense", "b128d0.25", "2:4"])
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    case, = bench_models.cases([args.case], device, args.smoke)
    if args.census:
        print_census(case, args.variants, args.census, args.everything)
        return
    print(f"{args.case} under torch.compile: a step as it is and without each kind of call; rounds: {args.rounds}")
    print("| variant | kind | calls per step | step ms | without them ms | us per call in place |\n"
          "|---|---|---|---|---|---|")
    for variant in args.variants:
        for row in probe(case, variant, device, args.reps, args.rounds):
            print(f"| {row['variant']} | {row['kind']} | {row['calls']} | {row['ms']:.3f} | {row['without_ms']:.3f} | "
                  f"{row['us_per_call']:.1f} |", flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
