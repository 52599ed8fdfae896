"""Train a small GPT on the Python standard library's own sources (no download), with a
dense FFN, block-sparse FFNs at densities 0.5 and 0.25 and a 2:4 FFN (sparsegen.patch), same steps and seed; print and plot
loss curves and step times. GPU: PYTHONPATH=. python tools/train_demo.py --out out/
[--benchmarks BENCHMARKS.md] [--models dense,0.5,0.25,2:4,2:4-train] [--no-graph]
On the GPU each training step is replayed as one CUDA graph (--no-graph: launched eagerly).
CPU smoke run: python tools/train_demo.py --steps 3 --layers 1 --d-model 64 --device cpu"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import sparsegen


def corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the stdlib's .py files, in a fixed order: byte-level tokens (vocab 256)."""
    data, root = bytearray(), Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if len(data) >= max_bytes:
            break
        try:
            data += path.read_bytes()
        except OSError:
            continue
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.ln1, self.ln2 = heads, nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.ffn(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, context: int):
        super().__init__()
        self.embed, self.position = nn.Embedding(256, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(self.ln(self.blocks(x)))


def batches(data: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=generator)
        window = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


# --models names: the FFN rules sparsegen.patch applies (None: dense).
MODELS = {"dense": None, "0.5": 0.5, "0.25": 0.25, "2:4": "2:4", "2:4-train": "2:4-train"}


def ffn_rule(kind, block: int) -> dict:
    if kind == "2:4":  # fixed magnitude mask, the kept values trained
        return {"sparsity": "2:4"}
    if kind == "2:4-train":  # the 2by4-pretrain recipe: dense weights, transposable mask refreshed
        return {"sparsity": "2:4", "training": {"mask_interval": 100}}
    return {"block": (block, block), "density": kind}


def build(args, kind) -> nn.Module:
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.d_model, args.heads, args.context)
    if kind is not None:
        # "pruned": the dense model's initial weights, pruned (block norm / 2:4 magnitude);
        # "fresh": the sparse layers' own initialization (bounds from the kept fan-in).
        sparsegen.patch(model, {r"blocks\.\d+\.ffn\.(0|2)": ffn_rule(kind, args.block)},
                        from_dense=args.init == "pruned")
    return model.to(args.device)


def evaluate(model, data, args) -> float:
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad(), torch.autocast(args.device, dtype=torch.bfloat16):
        losses = [F.cross_entropy(model(x.to(args.device)).float().flatten(0, 1), y.to(args.device).flatten()).item()
                  for _, (x, y) in zip(range(args.eval_batches), batches(data, args.batch, args.context, gen))]
    return statistics.mean(losses)


def lr_factor(step: int, total: int) -> float:
    """Linear warmup over the first 1/12 of the steps, then cosine decay to zero."""
    warmup = max(1, total // 12)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def make_optimizer(model, args) -> torch.optim.Optimizer:
    """Fused AdamW (one launch per update). On CUDA the learning rate is a device tensor and
    the optimizer `capturable`, so a captured step reads the rate that set_lr writes."""
    if args.device != "cuda":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    return torch.optim.AdamW(model.parameters(), lr=torch.tensor(args.lr, device=args.device), weight_decay=0.1,
                             fused=True, capturable=True)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # in place: a captured step holds this tensor
        else:
            group["lr"] = lr


class TrainStep:
    """One training step - forward, backward, gradient clipping, AdamW - on fixed input
    buffers. With `graph` (CUDA), the first WARMUP steps run eagerly, the next is captured
    into a CUDA graph, and every later step replays it: dense and sparse models alike then
    run without the host's per-launch cost, so the step time is the GPU's work."""

    WARMUP = 3

    def __init__(self, model, opt, args, graph: bool):
        self.model, self.opt, self.device = model, opt, args.device
        self.use_graph, self.graph, self.eager_steps = graph and args.device == "cuda", None, 0
        self.x = torch.zeros(args.batch, args.context, dtype=torch.long, device=args.device)
        self.y = torch.zeros_like(self.x)

    def run(self) -> torch.Tensor:
        # no autocast cache: a captured step must cast the fp32 weights again on every replay
        with torch.autocast(self.device, dtype=torch.bfloat16, cache_enabled=False):
            loss = F.cross_entropy(self.model(self.x).float().flatten(0, 1), self.y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss

    def __call__(self, x, y) -> torch.Tensor:
        self.x.copy_(x)
        self.y.copy_(y)
        if self.use_graph and self.eager_steps >= self.WARMUP:
            if self.graph is None:
                self.capture()
            self.graph.replay()
            return self.loss
        self.eager_steps += 1
        self.opt.zero_grad(set_to_none=True)
        if not self.use_graph:
            return self.run()
        side = torch.cuda.Stream()  # warm-up steps on a side stream, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = self.run()
        torch.cuda.current_stream().wait_stream(side)
        return loss

    def capture(self) -> None:
        """Gradients set to None first, so the captured backward allocates them in the graph's pool."""
        self.opt.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self.run()


def train(args, kind, train_data, val_data, model: nn.Module | None = None) -> dict:
    """Train `model` (default: build(args, kind)) in place; its curve, step time and final loss."""
    model = model if model is not None else build(args, kind)
    opt = make_optimizer(model, args)
    # The 2by4 recipe's mask refresh is scheduled on the device (Sparse24TrainingLinear.step):
    # its steps replay as a graph like the others'.
    step_fn = TrainStep(model, opt, args, graph=args.graph)
    gen, curve, times = torch.Generator().manual_seed(args.seed), [], []
    for step, (x, y) in zip(range(args.steps), batches(train_data, args.batch, args.context, gen)):
        start = time.perf_counter()
        # Linear warmup then cosine decay, and clipped gradients: without them the dense model
        # stalled at a loss of 2.4 at d_model 1024 (the sparse ones did not), which made the
        # comparison meaningless.
        set_lr(opt, args.lr * lr_factor(step, args.steps))
        loss = step_fn(x, y)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if step % args.log_every == 0 or step == args.steps - 1:
            curve.append((step, loss.item(), evaluate(model, val_data, args)))
            print(f"{label(kind)} step {step}: train {curve[-1][1]:.3f} val {curve[-1][2]:.3f} "
                  f"step {1e3 * statistics.median(times[-20:]):.1f} ms", flush=True)
    return dict(label=label(kind), curve=curve, step_ms=1e3 * statistics.median(times[len(times) // 4:]),
                val_loss=curve[-1][2], graphed=step_fn.use_graph)


def label(kind) -> str:
    names = {None: "dense", "2:4": "2:4 FFN", "2:4-train": "2:4 FFN (2by4 recipe)"}
    return names.get(kind, f"block-sparse FFN d={kind}")


def report(results: list[dict], args, out: Path) -> None:
    dense = results[0]
    lines = ["| model | final val loss | vs dense | step ms | speed vs dense | step as a CUDA graph |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['label']} | {r['val_loss']:.4f} | {100 * (r['val_loss'] / dense['val_loss'] - 1):+.1f}% | "
                     f"{r['step_ms']:.1f} | {dense['step_ms'] / r['step_ms']:.2f}x | {'yes' if r['graphed'] else 'no'} |")
    print("\n".join(lines))
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_demo.md").write_text("\n".join(lines) + "\n")
    if args.benchmarks:
        write_into(args.benchmarks, lines)
    (out / "train_demo.json").write_text(json.dumps(dict(args=vars(args), results=results), indent=1, default=str))
    plot(results, out / "train_demo.png")


SEED_COLUMNS = [("model", ""), ("final val loss per seed", ""), ("mean vs dense", "+.2%"),
                ("worst seed vs dense", "+.2%"), ("step ms", ".1f"), ("speed vs dense", "x")]


def seed_rows(runs: dict[int, list[dict]]) -> list[list]:
    """One row a model: its final validation loss at each seed, the mean and the worst of
    its gaps to dense's at the same seed, and its median step time against dense's."""
    rows = []
    dense_step = statistics.median(results[0]["step_ms"] for results in runs.values())
    for index, name in enumerate(r["label"] for r in next(iter(runs.values()))):
        losses = [results[index]["val_loss"] for results in runs.values()]
        gaps = [results[index]["val_loss"] / results[0]["val_loss"] - 1 for results in runs.values()]
        step = statistics.median(results[index]["step_ms"] for results in runs.values())
        rows.append([name, " / ".join(f"{loss:.4f}" for loss in losses), statistics.mean(gaps),
                     max(gaps, key=abs), step, dense_step / step])
    return rows


def report_seeds(runs: dict[int, list[dict]], args, argv: list[str]) -> None:
    """The table (printed, and under --json as a BENCHMARKS.md table) and the raw curves."""
    from bench_record import Table, write

    table = Table("Training", f"Quality: tools/train_demo.py, final validation loss over seeds "
                  f"{', '.join(map(str, runs))}, {args.steps} steps", SEED_COLUMNS,
                  "Each model against dense at the same seed; step time as a CUDA graph unless --no-graph.")
    for row in seed_rows(runs):
        table.add(*row)
    write(args.json, "train_demo.py", argv, [table])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_demo_seeds.json").write_text(json.dumps({str(seed): results for seed, results in runs.items()},
                                                               indent=1, default=str))


MARKS = ("<!-- train_demo.py results: start -->", "<!-- train_demo.py results: end -->")


def write_into(path: Path, lines: list[str]) -> None:
    """Replace the table between MARKS in `path` (BENCHMARKS.md), or append it with them."""
    text = path.read_text() if path.exists() else ""
    block = f"{MARKS[0]}\n" + "\n".join(lines) + f"\n{MARKS[1]}"
    if MARKS[0] in text and MARKS[1] in text:
        head, rest = text.split(MARKS[0], 1)
        text = head + block + rest.split(MARKS[1], 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps, _, val = zip(*r["curve"])
        left.plot(steps, val, label=r["label"])
    left.set(xlabel="step", ylabel="validation loss", title="GPT on stdlib sources")
    left.legend()
    right.bar([r["label"].replace("block-sparse FFN ", "") for r in results], [r["step_ms"] for r in results])
    right.set(ylabel="median step time (ms)", title="training step time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("steps", 600), ("layers", 6), ("d-model", 1024), ("heads", 16), ("context", 256),
                          ("batch", 32), ("block", 64), ("seed", 0), ("log-every", 100), ("eval-batches", 8),
                          ("corpus-mb", 16)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("out"))
    p.add_argument("--models", default="dense,0.5,0.25,2:4",
                   help=f"comma-separated, dense first, from {', '.join(MODELS)}")
    p.add_argument("--benchmarks", type=Path, help="also write the table into this file (BENCHMARKS.md)")
    p.add_argument("--init", choices=("pruned", "fresh"), default="fresh",
                   help="sparse FFNs start from the dense init pruned, or from their own init")
    p.add_argument("--json", type=Path, help="--seeds: also record the table here (tools/results/, for BENCHMARKS.md)")
    p.add_argument("--seeds", help="comma-separated seeds: train every model at each and report "
                   "each model's final loss against dense's at the same seed (overrides --seed)")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: replay each training step as one CUDA graph (--no-graph: eager launches)")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    data = corpus(args.corpus_mb << 20)
    split = int(0.95 * data.numel())
    kinds = [MODELS[name] for name in args.models.split(",")]
    if not args.seeds:
        report([train(args, kind, data[:split], data[split:]) for kind in kinds], args, args.out)
        return
    runs = {}
    for seed in map(int, args.seeds.split(",")):
        args.seed = seed
        runs[seed] = [train(args, kind, data[:split], data[split:]) for kind in kinds]
    report_seeds(runs, args, sys.argv[1:])


if __name__ == "__main__":
    main()
