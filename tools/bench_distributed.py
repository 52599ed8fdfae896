"""Training steps of a sparse Llama on several GPUs against its dense twin: FSDP2 (fully_shard
per decoder layer, bf16 parameters, fp32 gradient reduction) and DDP, eager and compiled
(FSDP2: each decoder layer compiled after sharding; DDP: the wrapped model), with the same
variant on one GPU (each rank alone, no communication) for the share of its speedup kept.

GPU: torchrun --nproc_per_node=2 tools/bench_distributed.py [--engines one,fsdp2,ddp]
     [--modes eager,compile] [--variants dense,b64d0.25,2:4t-mlp] [--steps 20] [--json FILE]
Rank 0 prints and records; the model is the issue's (hidden 2048, MLP 5632, 4 layers, GQA 32/4)
on 4 x 1024 tokens per rank, fused AdamW."""
import argparse
import contextlib
import gc
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import bench_models  # tools/ is on sys.path when run as a script
import ranks
from bench_record import Table, write

ENGINES, MODES = ("one", "fsdp2", "ddp", "ddp-once"), ("eager", "compile")


def config():
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=32,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)


def model_for(variant: str, engine: str, mode: str, device) -> torch.nn.Module:
    """The variant's model as the engine runs it (the same on every rank: seeded)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = bench_models.patched(LlamaForCausalLM(config()), "llama", variant).to(device, torch.bfloat16).train()
    if engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    if engine.startswith("ddp"):  # ddp-once: sparsegen.parallel.data_parallel (buffers synced once, not per forward)
        from torch.nn.parallel import DistributedDataParallel
        from sparsegen.parallel import data_parallel
        wrap = data_parallel if engine == "ddp-once" else DistributedDataParallel
        model = wrap(model, device_ids=[device.index])
        return torch.compile(model) if mode == "compile" else model
    if mode == "compile":
        for layer in model.model.layers:
            layer.compile()
    return model


class Steps:
    """A model's training steps (forward, backward, fused AdamW) on the rank's batch."""

    def __init__(self, model, ids, engine: str):
        self.model, self.ids, self.engine = model, ids, engine
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)

    def run(self, steps: int) -> list[float]:
        """ms of each of `steps` steps (CUDA events; ranks start each step together)."""
        times = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if self.engine != "one":
                dist.barrier()
            start.record()
            self.model(input_ids=self.ids, labels=self.ids).loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return times


def interleaved(variants: list[str], engine: str, mode: str, ids, device, steps: int) -> list[dict]:
    """Each round's {variant: its steps' ms}, the variants' models held together and timed in
    turns (rounds of 2 steps each after 3 warm-up steps, round r starting with variant r): a
    drift of the machine's speed during the run reaches every variant alike."""
    runs = {variant: Steps(model_for(variant, engine, mode, device), ids, engine) for variant in variants}
    for run in runs.values():
        run.run(3)
    rounds = []
    for r in range(-(-steps // 2)):
        with collector_paused():
            rounds.append({variant: runs[variant].run(2) for variant in bench_models.in_turn(variants, r)})
    if dist.get_rank() == 0:
        print(f"{engine} {mode} rounds: {spread(rounds, variants)}", flush=True)
    return rounds


def table_row(engine: str, mode: str, rounds: list[dict], variants: list[str]) -> list:
    """engine, mode, dense ms, then per sparse variant its speedup (the median over rounds of
    the round's dense ms over the variant's) and the middle half of the rounds' speedups."""
    ms, speedups = medians_and_speedups(rounds, variants)
    sparse = [v for v in variants if v != "dense"]
    return [engine, mode, ms["dense"], *[cell for v in sparse for cell in (speedups[v], middle_half(rounds, v))]]


@contextlib.contextmanager
def collector_paused():
    """Python's cycle collector off for a round and run in full between rounds, as timeit keeps
    it out: a collection lands in whichever step crosses its threshold, and one round's ratio
    rests on 2 steps of each variant."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def medians_and_speedups(rounds: list[dict], variants: list[str]) -> tuple[dict, dict]:
    """Each variant's median ms over every round, and the median over rounds of the round's
    dense median over the variant's ("dense" among the variants)."""
    ms = {v: statistics.median(t for times in rounds for t in times[v]) for v in variants}
    return ms, {v: statistics.median(round_speedups(rounds, v)) for v in variants}


def round_speedups(rounds: list[dict], variant: str) -> list[float]:
    """Each round's dense median over the variant's median, in round order."""
    return [statistics.median(times["dense"]) / statistics.median(times[variant]) for times in rounds]


def middle_half(rounds: list[dict], variant: str) -> str:
    """The rounds' speedups from the lower quartile to the upper ('1.02-1.10'): the median's
    company, the cell's own noise beside it."""
    speedups = round_speedups(rounds, variant)
    if len(speedups) < 2:  # (--steps 2 or fewer: one round, no quartiles)
        return "-"
    low, _, high = statistics.quantiles(speedups, n=4)
    return f"{low:.2f}-{high:.2f}"


def spread(rounds: list[dict], variants: list[str]) -> str:
    """The rounds' speedups of each sparse variant, lowest to highest: how far one cell can move."""
    return "; ".join(f"{v} " + " ".join(f"{x:.2f}" for x in sorted(round_speedups(rounds, v)))
                     for v in variants if v != "dense")


def profile(engine: str, mode: str, variant: str, ids, device, rank: int, trace: Path | None) -> None:
    """torch.profiler over 3 steps after the warm-up, and dynamo's counters since the start;
    each rank's timeline as a gzipped Chrome trace under `trace` if given."""
    from torch._dynamo.utils import counters

    from sparsegen.launch import calls, plans

    run = Steps(model_for(variant, engine, mode, device), ids, engine)
    run.run(3)
    builds, build_outside = [], calls.outside_graphs.run  # index tensors a layer derived again (per_layout)
    calls.outside_graphs.run = lambda build, *rest: builds.append(build) or build_outside(build, *rest)
    made, allocating = [], plans.allocating  # launch plans made (every plan cache makes one under it)
    plans.allocating = lambda what: made.append(what) or allocating(what)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run.run(3)
    calls.outside_graphs.run, plans.allocating = build_outside, allocating
    if trace:
        trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace / f"{engine}_{mode}_{variant.replace(':', '')}_r{rank}.json.gz"))
    print(f"rank {rank}: {len(builds)} derived index tensors built again and {len(made)} launch plans made in 3 steps",
          flush=True)
    if rank == 0:
        print(f"==== {engine} {mode} {variant}: 3 steps", flush=True)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
        print("recompiles / graph breaks:", dict(counters["recompiles"]), dict(counters["graph_break"]), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--variants", default="dense,b64d0.25,2:4t-mlp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", help="ENGINE:MODE:VARIANT[,...]: after the table, where its step's time goes "
                        "(GPU kernels, host operators, recompiles and graph breaks) on rank 0")
    parser.add_argument("--trace", type=Path, help="with --profile: each rank's Chrome trace of the profiled steps here")
    args = parser.parse_args()
    rank, world, device = ranks.joined()
    torch._dynamo.config.cache_size_limit = 64
    ids = bench_models.token_ids(32000, (4, 1024), "cpu").add(rank).remainder(32000).to(device)  # rank's own batch
    variants = args.variants.split(",")
    table = Table("Training", f"Llama-1B-shaped (4 layers) training step on {world} GPUs, 4 x 1024 tokens per GPU",
                  [("engine", ""), ("mode", ""), ("dense ms", ".1f")]
                  + [column for v in variants if v != "dense" for column in ((v, "x"), (f"{v} rounds' middle half", ""))],
                  "tools/bench_distributed.py under torchrun: median of the steps after 3 warm-ups (forward, backward, "
                  "fused AdamW), CUDA events on rank 0, the variants' models timed in turns, 2 steps each, round r starting with "
                  "variant r, Python's cycle collector run between rounds and paused within them; 'one' is each GPU training the same model alone. Speedups are the median over rounds of the dense "
                  "twin's round time over the variant's, under the same engine and mode; beside each, the rounds' speedups "
                  "from the lower quartile to the upper.")
    for engine in args.engines.split(","):
        for mode in args.modes.split(","):
            timed = ["dense", *[v for v in variants if v != "dense"]]
            rounds = interleaved(timed, engine, mode, ids, device, args.steps)
            gc.collect()
            torch.cuda.empty_cache()
            if rank == 0:  # recorded row by row: a run stopped at its time limit keeps what it measured
                table.add(*table_row(engine, mode, rounds, timed))
                write(args.json, "bench_distributed.py", sys.argv[1:], [table],
                      launcher=f"PYTHONPATH=. torchrun --nproc_per_node={world}")
    for spec in args.profile.split(",") if args.profile else []:
        profile(*spec.split(":", 2), ids, device, rank, args.trace)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
