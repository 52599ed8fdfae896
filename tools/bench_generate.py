"""model.generate() tokens/s, dense against sparsegen: the figure users quote for decode.

GPU:  PYTHONPATH=. python tools/bench_generate.py --json out/generate.json
      [--families llama,qwen2,mistral,gemma,phi3] [--variants dense,dense-merged,2:4,...]
      [--batches 1,8,32] [--prompts 128,2048] [--new 128] [--modes eager,static] [--layers 4]
      python tools/bench_generate.py --profile gemma:2:4,gemma:dense-merged [--batches 32]
      python tools/bench_generate.py --cold 2:4,fp8-2:4 [--families gemma]
CPU smoke run (tiny configs, eager): python tools/bench_generate.py --smoke

Greedy generation of exactly --new tokens (min_new_tokens) from random prompts, each model
built from its family's config (tools/families.py) and patched with the README's suffix
patterns. Modes: eager (transformers' dynamic cache), static (cache_implementation="static":
transformers compiles the decode step with mode="reduce-overhead" itself, as its docs
recommend; the first call's time, recompiles included, is recorded as warm-up). Every model of
a family is timed in rounds that take them in turn; a variant's speedup is the median over
rounds of the best dense model's time (as transformers builds it, or with gate/up merged) over
its own, and for one-byte variants also over the dense one-byte model's (torch._scaled_mm /
_int_mm, tools/quantized_dense.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import sparsegen  # noqa: E402
from bench_record import Table, meta as run_meta, table_lines  # noqa: E402
from families import FAMILIES, PATTERNS, build, merge_gated_mlps  # noqa: E402
from quantized_dense import quantize_linears  # noqa: E402

# variant -> (which projections, patch settings); None: a dense baseline
VARIANTS = {
    "dense": None,
    "dense-merged": None,
    "2:4": ("all", {"sparsity": "2:4"}),
    "b64d0.5": ("mlp", {"block": (64, 64), "density": 0.5}),
    "b128d0.25": ("mlp", {"block": (128, 128), "density": 0.25}),
    "fp8-dense": ("all", "e4m3"),
    "fp8-2:4": ("all", {"sparsity": "2:4", "weight_dtype": "e4m3"}),
    "int8-dense": ("all", "int8"),
    "int8-2:4": ("all", {"sparsity": "2:4", "weight_dtype": "int8"}),
    # 4-bit kept values, 16-bit activations (W4A16, group 128: Int4Sparse24Linear, issue 62)
    "int4-2:4": ("all", {"sparsity": "2:4", "weight_dtype": "int4"}),
}
DENSE = ("dense", "dense-merged")
BYTE_DENSE = {"fp8-2:4": "fp8-dense", "int8-2:4": "int8-dense"}
MODES = ("eager", "static")


def variant_model(family, variant: str, layers: int, device, smoke: bool) -> nn.Module:
    model = build(family, layers, device, torch.bfloat16 if device.type == "cuda" else torch.float32, smoke)
    if variant == "dense-merged":
        return merge_gated_mlps(model)
    if VARIANTS[variant] is None:
        return model
    which, settings = VARIANTS[variant]
    if isinstance(settings, str):
        return quantize_linears(model, r".*" + PATTERNS[which], settings)
    sparsegen.patch(model, {PATTERNS[which]: settings})
    return model


def prompt_ids(batch: int, tokens: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(batch * 100003 + tokens)
    return torch.randint(3, 32000, (batch, tokens), generator=generator).to(device)


def generate(model: nn.Module, ids: torch.Tensor, new: int, mode: str) -> torch.Tensor:
    extra = {"cache_implementation": "static"} if mode == "static" else {}
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0, **extra)


def timed_s(fn) -> float:
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    begin = time.perf_counter()
    fn()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return time.perf_counter() - begin


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def warm_up(models: dict, ids, new: int, mode: str) -> dict:
    """Per variant: the first call's seconds (compiles, CUDA graph records) and the graphs
    Dynamo made in it; then a second call, untimed (later calls of a static cache replay)."""
    first = {}
    for name, model in models.items():
        graphs = dynamo_graphs()
        seconds = timed_s(lambda: generate(model, ids, new, mode))
        first[name] = dict(warmup_s=round(seconds, 2), graphs=dynamo_graphs() - graphs)
        generate(model, ids, new, mode)
    return first


def round_times(models: dict, ids, new: int, mode: str, rounds: int) -> dict:
    """{variant: [(total seconds, first-token seconds) per round]}, the models taken in turn,
    round r starting with the r-th (none is always first after a switch)."""
    names, times = list(models), {name: [] for name in models}
    for r in range(rounds):
        gc.collect()
        gc.disable()  # (a collection inside one model's call would be charged to it alone)
        try:
            for name in names[r % len(names):] + names[:r % len(names)]:
                first = timed_s(lambda: generate(models[name], ids, 1, mode))
                total = timed_s(lambda: generate(models[name], ids, new, mode))
                times[name].append((total, first))
        finally:
            gc.enable()
    return times


def cell_rows(times: dict, first: dict, base: dict) -> list[dict]:
    rows = []
    dense_names = [name for name in DENSE if name in times]
    rounds = len(next(iter(times.values())))
    best_dense = [min(times[d][r][0] for d in dense_names) for r in range(rounds)] if dense_names else None
    for name, samples in times.items():
        totals = [t for t, _ in samples]
        row = dict(base, variant=name, tokens_per_s=round(base["batch"] * base["new"] / statistics.median(totals), 1),
                   tpot_ms=round(statistics.median((t - f) / max(base["new"] - 1, 1) for t, f in samples) * 1e3, 3),
                   ttft_ms=round(statistics.median(f for _, f in samples) * 1e3, 3), **first.get(name, {}))
        if best_dense:
            row["speedup"] = round(statistics.median(b / t for b, t in zip(best_dense, totals)), 3)
            row["round_speedups"] = sorted(round(b / t, 3) for b, t in zip(best_dense, totals))
        if BYTE_DENSE.get(name) in times:
            own = [t for t, _ in times[BYTE_DENSE[name]]]
            row["speedup_vs_byte_dense"] = round(statistics.median(o / t for o, t in zip(own, totals)), 3)
        rows.append(row)
    return rows


def dense_copies_mb() -> float:
    """Megabytes of dense weight copies sparsegen's layers keep (the dense path, where a GPU's
    crossover table sends a call to cuBLAS): 0 where every call runs the sparse kernels."""
    from sparsegen.launch import dense_path

    return round(dense_path.held_bytes() / 2**20, 1)


def logits_error(model: nn.Module, reference: nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        out, ref = model(ids).logits.double(), reference(ids).logits.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def errors(family, models: dict, layers: int, device, smoke: bool) -> dict:
    """Each sparse model's prompt logits against the dense model with its (masked) weights;
    one-byte 2:4 against the 16-bit 2:4 model they quantize."""
    ids, found = prompt_ids(2, 32, device), {}
    for name, model in models.items():
        if VARIANTS[name] is None or isinstance(VARIANTS[name][1], str):
            continue
        if "weight_dtype" in VARIANTS[name][1]:
            reference = sparsegen.dense_copy(variant_model(family, "2:4", layers, device, smoke))
        else:
            reference = sparsegen.dense_copy(model)
        found[name] = logits_error(model, reference, ids)
        del reference
    return found


def run_family(family, args, device, save) -> None:
    models = {v: variant_model(family, v, args.layers, device, args.smoke) for v in args.variants}
    errs = errors(family, models, args.layers, device, args.smoke)
    for mode in args.modes:
        for prompt in args.prompts:
            for batch in args.batches:
                ids = prompt_ids(batch, prompt, device)
                base = dict(family=family.name, model=f"{family.label} ({args.layers} layers)", mode=mode,
                            prompt=prompt, batch=batch, new=args.new)
                held_mb = dense_copies_mb()
                try:
                    first = warm_up(models, ids, args.new, mode)
                    rows = cell_rows(round_times(models, ids, args.new, mode, args.rounds), first, base)
                except Exception as error:  # a cell that fails is recorded, and the run goes on
                    rows = [dict(base, error_text=f"{type(error).__name__}: {str(error)[:300]}")]
                for row in rows:
                    row["logits_error"] = errs.get(row.get("variant"))
                    row["dense_copies_mb"] = held_mb
                    print(json.dumps(row), flush=True)
                save(rows)
    models.clear()
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None


# ---- profile: where an eager decode step's time goes -----------------------------------------

def profile(family, variant: str, args, device, steps: int = 16) -> str:
    """torch.profiler over `steps` eager decode tokens: host and GPU time by op, and launches
    per token (kernels the GPU ran over the tokens)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    model = variant_model(family, variant, args.layers, device, args.smoke)
    ids = prompt_ids(args.batches[0], args.prompts[0], device)
    generate(model, ids, 4, "eager")
    base = timed_s(lambda: generate(model, ids, 1, "eager"))
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        total = timed_s(lambda: generate(model, ids, steps + 1, "eager"))
    events = prof.key_averages()
    kernels = sum(e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    head = (f"## {family.name} {variant}: batch {ids.shape[0]}, prompt {ids.shape[1]}: "
            f"{(total - base) / steps * 1e3:.2f} ms a token under the profiler, "
            f"{kernels / (steps + 1):.1f} GPU kernels a token (prefill included)\n")
    return head + events.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60) + \
        events.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60) + \
        python_profile(lambda: generate(model, ids, steps + 1, "eager"))


def python_profile(fn, top: int = 30, order: str = "tottime") -> str:
    """cProfile's view of the same tokens: the host's Python time by function (tottime)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(fn)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip())[-6000:]


# ---- cold: patch + first forward with an empty kernel cache ---------------------------------

COLD_SCRIPT = """
import sys, time, torch
sys.path.insert(0, {tools!r})
import sparsegen, bench_generate as bg
from sparsegen.jit import compiler
from sparsegen.jit import cache
compiled, nvrtc_compile, waits, build = [], compiler.compile_cubin, [], cache.build
def counted(source, name, *rest):  # the kernels NVRTC compiled while the clock ran, and when
    start = time.perf_counter()
    try:
        return nvrtc_compile(source, name, *rest)
    finally:
        compiled.append((name, start, time.perf_counter()))
def waited(spec):  # where the caller's thread waited for a kernel, and how long
    start = time.perf_counter()
    try:
        return build(spec)
    finally:
        waits.append((spec.name, start, time.perf_counter()))
compiler.compile_cubin, cache.build = counted, waited
family, variant, tokens = bg.FAMILIES[{family!r}], {variant!r}, {tokens}
model = bg.build(family, {layers}, torch.device("cuda"), torch.bfloat16)
ids = bg.prompt_ids(1, tokens, "cuda") if tokens > 1 else bg.prompt_ids(32, 1, "cuda")
torch.cuda.synchronize()


def patch():
    if variant != "dense":
        which, settings = bg.VARIANTS[variant]
        sparsegen.patch(model, {{bg.PATTERNS[which]: settings}})
    torch.cuda.synchronize()


marks = []  # (the trace's view of the forward: when each decoder layer and the head began)
if {trace}:
    for name, module in model.named_modules():
        if name == "lm_head" or name.rpartition(".")[0].endswith("layers"):
            module.register_forward_pre_hook(
                lambda m, args, name=name: marks.append((name + " begins", time.perf_counter())))
    def caught_up(m, args):  # (the trace alone: whether the GPU is behind the host when the head begins)
        torch.cuda.synchronize()
        marks.append(("the GPU caught up", time.perf_counter()))
    model.lm_head.register_forward_pre_hook(caught_up)
    model.lm_head.register_forward_hook(lambda m, args, out: marks.append(("lm_head ends", time.perf_counter())))


def forward():
    with torch.no_grad():
        model(ids)
    torch.cuda.synchronize()


memory = [torch.cuda.memory_stats()] if {trace} else []  # (the trace's: cudaMallocs in patch, in the forward)
begin = time.perf_counter()
if {profile}:  # where the cold call's time goes, by function (the clock then runs slower)
    print(bg.python_profile(patch, 25, "cumulative"))
    print(bg.python_profile(forward, 40, "cumulative"))
else:
    patch()
patched = time.perf_counter()
memory += [torch.cuda.memory_stats()] if {trace} else []
forward()
print("SECONDS", time.perf_counter() - begin, patched - begin, len(compiled))
if {trace}:  # the timeline: each NVRTC compile and each wait of the caller over 1 ms, from the clock's start
    for kind, events in (("compile", compiled), ("wait", waits)):
        for name, start, end in sorted(events, key=lambda e: e[1]):
            if end - start > 1e-3:
                print(f"TRACE {{kind:8s}} {{start - begin:7.3f}} -> {{end - begin:7.3f}} s  {{name}}")
    for name, at in marks:
        print(f"TRACE forward  {{at - begin:7.3f}} s  {{name}}")
    print(f"TRACE patch ends {{patched - begin:.3f}} s")
    # (each new segment of PyTorch's caching allocator is a cudaMalloc: what new tensors cost)
    memory.append(torch.cuda.memory_stats())
    for part, (was, now) in (("patch", memory[:2]), ("forward", memory[1:])):
        segments = now.get("segment.all.allocated", 0) - was.get("segment.all.allocated", 0)
        grown = (now.get("reserved_bytes.all.current", 0) - was.get("reserved_bytes.all.current", 0)) / 2**20
        print(f"TRACE {{part}}: {{segments}} cudaMallocs, reserved memory {{grown:+.0f}} MB")
"""


def cold_seconds(family: str, variant: str, tokens: int, layers: int, warm: bool = True,
                 profile: bool = False, kernels: str | None = None, trace: bool = False) -> tuple[float, float, int]:
    """(patch + first forward, patch alone, kernels NVRTC compiled meanwhile) in a fresh process
    with an empty kernel cache (dense: the first forward alone), the model built and CUDA
    started before the clock; warm=False: without patch's background builds (SPARSEGEN_WARM=0);
    kernels: a folder on the path holding the sparsegen_kernels package (else none is used);
    profile: cProfile's view of patch and of the first forward printed too (the seconds then
    include its cost); trace: the timeline of NVRTC compiles and of the waits for kernels printed."""
    with tempfile.TemporaryDirectory() as cache:
        script = COLD_SCRIPT.format(tools=str(Path(__file__).parent), family=family, variant=variant,
                                    tokens=tokens, layers=layers, profile=profile, trace=trace)
        env = dict(os.environ, SPARSEGEN_CACHE_DIR=cache, SPARSEGEN_WARM="1" if warm else "0",
                   SPARSEGEN_SHIPPED_KERNELS="1" if kernels else "0")
        if kernels:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (kernels, env.get("PYTHONPATH")) if p)
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SECONDS")]
    if profile or trace:
        print(f"## cold {family} {variant} {tokens} tokens\n{done.stdout}", flush=True)
    if not lines:
        raise RuntimeError(f"cold run of {variant} failed: {done.stderr[-2000:]}")
    seconds, patch_s, compiled = lines[-1].split()[1:]
    return float(seconds), float(patch_s), int(compiled)


def byte_compiled() -> None:
    """sparsegen's modules byte-compiled, as installing its wheel with pip leaves them: a cold
    process of a source tree where none was written (PYTHONDONTWRITEBYTECODE, a read-only
    folder) compiles each module patch imports from source - ~50 ms of a cold prefill in a
    profile on the GPU machine, which no installed copy pays."""
    import compileall

    compileall.compile_dir(str(Path(sparsegen.__file__).parent), quiet=1)


def cold_rows(args, save) -> None:
    """Each family's cold rows, saved as they come (a run stopped at its time limit keeps them)."""
    for family in args.families:
        # A first process reads torch's libraries into the page cache: the machine's first CUDA
        # program paid ~1 s more (sdpa's kernels loaded from disk), whichever variant it ran.
        cold_seconds(family.name, "dense", 1, args.layers)
        for tokens, label in ((2048, "prefill 1 x 2048"), (1, "decode 32 (one token each)")):
            if label.split()[0] not in args.cold_calls:
                continue

            def timed(variant: str, **how) -> tuple:
                # (fresh processes differ by up to ~0.1 s: dense and each variant alike, the median process)
                return median_run([cold_seconds(family.name, variant, tokens, args.layers, **how)
                                   for _ in range(args.cold_rounds)])
            dense = timed("dense", trace=args.cold_trace)[0]
            for variant in args.cold:
                # (without background builds: only where there is no kernels package to compare with)
                unwarmed = not (args.cold_kernels or args.cold_warmed_only)
                more = dict(unwarmed_s=timed(variant, warm=False)[0]) if unwarmed else {}
                rows = [_cold_row(family, label, variant, dense, timed(variant, trace=args.cold_trace), **more)]
                if args.cold_kernels:
                    rows.append(_cold_row(family, label, f"{variant}, kernels installed", dense,
                                          timed(variant, kernels=args.cold_kernels)))
                print("\n".join(map(json.dumps, rows)), flush=True)
                save(rows)


def median_run(runs: list[tuple]) -> tuple:
    """The run (seconds, ...) whose seconds are the median (the lower middle one of an even count)."""
    return sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2]


def _cold_row(family, label: str, variant: str, dense_s: float, measured: tuple, **more) -> dict:
    seconds, patch_s, compiled = measured
    return dict(family=family.name, model=family.label, call=label, variant=variant, dense_first_s=round(dense_s, 3),
                first_s=round(seconds, 3), patch_s=round(patch_s, 3), x_dense=round(seconds / dense_s, 2),
                compiled=compiled, **{k: round(v, 3) for k, v in more.items()})


# ---- report ---------------------------------------------------------------------------------

def report(rows: list[dict]) -> list[str]:
    """The run's tables as BENCHMARKS.md shows them (bench_record.table_lines of tables_of)."""
    return [line for table in tables_of(rows) for line in ["", f"### {table.title}", ""] + table_lines(table.as_dict())]


GENERATE_ABOUT = ("model.generate(), greedy, exactly `new` tokens from random prompts (tools/bench_generate.py): "
                  "each variant's speedup is the median over rounds of the best dense model's time (as transformers "
                  "builds it, or with gate/up merged into one nn.Linear) over its own, the models timed in turn; "
                  "one-byte 2:4 also against the same quantization on PyTorch's dense one-byte product. Eager: "
                  "transformers' dynamic cache; static: cache_implementation='static', which transformers compiles "
                  "with mode='reduce-overhead' itself.")


def tables_of(rows: list[dict]) -> list[Table]:
    """The run's rows as BENCHMARKS.md's tables: generate() speedups, then cold first calls."""
    made = [_generate_table(rows)] if any("tokens_per_s" in r for r in rows) else []
    return made + ([_cold_table(rows)] if any("first_s" in r for r in rows) else [])


def _generate_table(rows: list[dict]) -> Table:
    variants = [v for v in dict.fromkeys(r["variant"] for r in rows if "tokens_per_s" in r)]
    bytes_ = [v for v in variants if v in BYTE_DENSE]
    modes = " and ".join(dict.fromkeys(r["mode"] for r in rows if "tokens_per_s" in r))
    table = Table("Whole models", f"model.generate() tokens/s, {modes}: speedup over the best dense model",
                  [("model", ""), ("mode", ""), ("prompt", ""), ("batch", ""), ("new", ""), ("dense tok/s", ".1f")]
                  + [(v, "x") for v in variants] + [(f"{v} / {BYTE_DENSE[v]}", "x") for v in bytes_],
                  about=GENERATE_ABOUT)
    cells: dict = {}
    for r in rows:
        if "tokens_per_s" in r:
            cells.setdefault((r["model"], r["mode"], r["prompt"], r["batch"], r["new"]), {})[r["variant"]] = r
    for key, by in cells.items():
        table.rows.append([*key, by.get("dense", {}).get("tokens_per_s"), *[by.get(v, {}).get("speedup") for v in variants],
                           *[by.get(v, {}).get("speedup_vs_byte_dense") for v in bytes_]])
    held = max((r.get("dense_copies_mb") or 0) for r in rows)
    table.notes.append(f"Dense weight copies held by sparse layers during the run: {held:g} MB.")
    for (model, mode, prompt, batch, new), by in cells.items():
        if mode == "static":  # what a compiled generate() costs before it runs at speed
            first = ", ".join(f"{v} {r['warmup_s']:g} s ({r['graphs']} graph)" for v, r in by.items() if "warmup_s" in r)
            table.notes.append(f"{model}, batch {batch}, prompt {prompt}: the first generate() call (Dynamo, "
                               f"Inductor, CUDA graph records) took {first}; the first model compiled in a "
                               "process pays its one-time compile costs.")
    return table


def _cold_table(rows: list[dict]) -> Table:
    rows = [r for r in rows if "first_s" in r]
    unwarmed = any(r.get("unwarmed_s") is not None for r in rows)  # (a column only where measured)
    table = Table("Compile and overheads", "Cold first call: patch + first forward from an empty kernel cache",
                  [("model", ""), ("call", ""), ("variant", ""), ("dense first forward s", ".3f"),
                   ("patch + first forward s", ".3f"), ("of which patch s", ".3f"), ("times dense's", ".2f"),
                   ("kernels compiled", "")] + [("without background builds s", ".3f")] * unwarmed,
                  about="A fresh process each (tools/bench_generate.py --cold): the model built on the GPU and CUDA "
                        "started before the clock, sparsegen byte-compiled as pip installs it (runs from 2026-11-29 "
                        "on); dense: its first forward alone; each cell the median of --cold-rounds "
                        "processes (runs before 2026-11-29: dense the faster of two, a variant one process). "
                        "'kernels installed': with the sparsegen_kernels package (tools/build_kernels.py; "
                        "--cold-kernels) on the path; "
                        "'kernels compiled': by NVRTC before the first forward returned.")
    for r in rows:
        table.rows.append([r["model"], r["call"], r["variant"], r["dense_first_s"], r["first_s"], r.get("patch_s"),
                           r["x_dense"], r.get("compiled")] + [r.get("unwarmed_s")] * unwarmed)
    return table


def _raw_rows(run: dict) -> list[dict]:
    return run.get("raw", run.get("rows", []))


def recorded(meta: dict, rows: list[dict]) -> dict:
    """What --json writes: the tables BENCHMARKS.md shows and every raw row (`raw`)."""
    return dict(meta=meta, tables=[t.as_dict() for t in tables_of(rows)], raw=rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompts", default="128,2048")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--modes", default="eager,static")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", help="family:variant,... profiled eagerly instead of timed")
    parser.add_argument("--cold", help="variants whose patch + first forward is timed from an empty cache")
    parser.add_argument("--cold-kernels", metavar="DIR", help="with --cold: each variant timed again with the "
                        "sparsegen_kernels package in DIR (e.g. pip install --target DIR its wheel)")
    parser.add_argument("--cold-profile", action="store_true",
                        help="with --cold: cProfile's view of each cold prefill instead of timings")
    parser.add_argument("--cold-rounds", type=int, default=3,
                        help="with --cold: fresh processes per cell, dense and each variant alike (the median counts)")
    parser.add_argument("--cold-calls", default="prefill,decode", help="with --cold: which first calls to time")
    parser.add_argument("--cold-warmed-only", action="store_true",
                        help="with --cold: no timing without background builds (SPARSEGEN_WARM=0)")
    parser.add_argument("--cold-trace", action="store_true",
                        help="with --cold: each sparse variant's timeline of NVRTC compiles and waits printed")
    parser.add_argument("--smoke", action="store_true", help="tiny configs on the CPU")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--report", type=Path, nargs="+", help="tabulate these result files instead")
    args = parser.parse_args(argv)
    if args.report:
        print("\n".join(report([r for path in args.report for r in _raw_rows(json.loads(path.read_text()))])))
        return
    args.families = [FAMILIES[name] for name in args.families.split(",")]
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.prompts = [int(p) for p in args.prompts.split(",")]
    args.modes = args.modes.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.layers, args.new, args.rounds, args.modes = 2, 4, 1, ["eager"]
        args.batches, args.prompts = [2], [8]
    run(args, device, argv)


def run(args, device, argv) -> None:
    rows: list[dict] = []

    def save(new_rows: list[dict]) -> None:
        rows.extend(new_rows)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(recorded(run_meta("bench_generate.py", argv if argv is not None
                                                              else sys.argv[1:]), rows), indent=1))
    if args.cold:
        args.cold = args.cold.split(",")
        byte_compiled()
        if args.cold_profile:
            for family in args.families:
                for variant in ["dense"] + args.cold:
                    cold_seconds(family.name, variant, 2048, args.layers, profile=True, kernels=args.cold_kernels)
            return
        cold_rows(args, save)
        return
    if args.profile:
        for item in args.profile.split(","):
            family, _, variant = item.partition(":")
            print(profile(FAMILIES[family], variant, args, device), flush=True)
        return
    for family in args.families:
        run_family(family, args, device, save)
    print("\n".join(report(rows)))


if __name__ == "__main__":
    main()
