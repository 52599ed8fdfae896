"""Where a training step of the demo GPT goes: step times and a torch.profiler table for the
dense and the block-sparse-FFN model. GPU: PYTHONPATH=. python tools/profile_train.py
[--compare-init | --models dense,2:4-train]: --compare-init times the d = 0.5 model built
both ways (train_demo --init pruned and fresh) in one process, same batch; --models profiles
those train_demo models instead of dense, 0.5 and 0.25."""
from __future__ import annotations

import faulthandler
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import train_demo  # noqa: E402


def step(model, opt, x, y):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def profile(args, density, x, y) -> None:
    model = train_demo.build(args, density)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    for i in range(3):  # the first steps compile kernels: timed one by one
        start = time.perf_counter()
        step(model, opt, x, y)
        torch.cuda.synchronize()
        print(f"{train_demo.label(density)} step {i}: {(time.perf_counter() - start) * 1e3:.1f} ms", flush=True)
    start = time.perf_counter()
    for _ in range(20):
        step(model, opt, x, y)
    torch.cuda.synchronize()
    print(f"{train_demo.label(density)}: {(time.perf_counter() - start) / 20 * 1e3:.2f} ms/step", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(model, opt, x, y)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    compare_init = "--compare-init" in argv
    kinds = ([train_demo.MODELS[name] for name in argv[argv.index("--models") + 1].split(",")]
             if "--models" in argv else [0.5, None, 0.25])
    args = train_demo.parse_args([])
    start = time.perf_counter()
    data = train_demo.corpus(args.corpus_mb << 20)
    print(f"corpus: {data.numel() / 1e6:.1f} MB in {time.perf_counter() - start:.2f} s")
    gen, start = torch.Generator().manual_seed(0), time.perf_counter()
    stream = train_demo.batches(data, args.batch, args.context, gen)
    x, y = (t.cuda() for t in [next(stream) for _ in range(100)][-1])
    print(f"100 batches: {time.perf_counter() - start:.3f} s", flush=True)
    faulthandler.dump_traceback_later(25, repeat=True)  # where a slow step spends its time
    if compare_init:
        for init in ("pruned", "fresh"):
            print(f"--init {init}")
            profile(train_demo.parse_args(["--init", init]), 0.5, x, y)
        return
    for kind in kinds:
        profile(args, kind, x, y)


if __name__ == "__main__":
    main()
