"""`sparsegen tune`: measure where the sparse kernels beat cuBLAS on this GPU.

For each layout, weight shape and token count of a grid, the sparse layer's forward and
cuBLAS on its dense weight are timed side by side as CUDA graphs (GPU time: the host's cost
is the same either way). The speedups become this GPU's crossover table (crossovers.py),
written to the cache directory, where every later process finds it. Measuring some layouts
only (`--layout`) replaces their points and keeps the other layouts' from the table in use.
"""
from __future__ import annotations

import datetime
import os
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from .launch import crossovers, dense_path, runtime
from .errors import SpecError, expect
from .jit import private_files, registry, trust

# (out_features, in_features): attention and MLP projections of BERT-base, Llama-7B-like and
# Llama-1B-like models, and square layers from 768 to 8192.
SHAPES = [(768, 768), (3072, 768), (768, 3072), (2048, 2048), (8192, 2048), (2048, 8192),
          (4096, 4096), (11008, 4096), (4096, 11008), (8192, 8192)]
TOKENS = [1, 16, 128, 512, 2048, 8192]
# Each tuned layout's points, as its face declares them (registry.Tuning): (key, block,
# density), e.g. ("sp24", (0, 0), 1.0), ("bsr", (64, 64), 0.5), ("bdiag", (0, 0), 1 / nblocks).
TUNINGS = {face.tuning.key: face.tuning for face in registry.faces() if face.tuning is not None}
LAYOUTS = [(key, block, density) for key, tuning in TUNINGS.items() for block, density in tuning.points]
NAMES = tuple(TUNINGS)
QUICK = dict(shapes=SHAPES[::3], tokens=TOKENS[1::2],
             layouts=[next(row for row in LAYOUTS if row[0] == name) for name in NAMES])  # one row of each


def graph_ms(call, reps: int = 20) -> float:
    """GPU time of one call: `reps` calls captured as one CUDA graph, best of 3 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream: its split-K workspace
        for _ in range(reps):
            call()
    times = []
    for _ in range(3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / reps)
    return min(times)


@torch.no_grad()
def measure(layout: str, n: int, k: int, m: int, block=(0, 0), density: float = 1.0) -> crossovers.Point:
    """One point: the sparse layer (its kernels, never the dense path) against cuBLAS."""
    layer = TUNINGS[layout].layer(n, k, block, density, device="cuda", dtype=torch.bfloat16)
    weight, bias = layer.to_dense_weight(), layer.bias
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    with dense_path.disabled():
        sparse = graph_ms(lambda: layer(x))
    dense = graph_ms(lambda: F.linear(x, weight, bias))
    block = TUNINGS[layout].tile(layer, block)  # (the tile its calls look up)
    return crossovers.Point(layout, n, k, m, dense / sparse, tuple(block), density)


def fits(layout: str, n: int, k: int, block, density: float) -> bool:
    return TUNINGS[layout].fits(n, k, block, density)


def run(shapes=SHAPES, tokens=TOKENS, layouts=LAYOUTS, out: Path | None = None, log=print) -> Path:
    """Measure the grid, write the table (default: this GPU's file in the cache directory)."""
    name = runtime.device_name(torch.cuda.current_device())
    measured = {layout for layout, _, _ in layouts}
    points = [p for p in crossovers.table(name) if p.layout not in measured]  # the others', kept
    for layout, block, density in layouts:
        for n, k in shapes:
            if not fits(layout, n, k, block, density):
                continue
            for m in tokens:
                points.append(measure(layout, n, k, m, block, density))
                log(json.dumps(crossovers.as_json(points[-1])))
    path = out or crossovers.user_table_path(name)
    write_table(path, table_text(name, [crossovers.as_json(p) for p in points]), in_cache=out is None)
    crossovers.reload()
    return path


def write_table(path: Path, text: str, in_cache: bool) -> None:
    """The table written as cache entries are (a new private file renamed into place, its mode
    0600 whatever the umask: the reader trusts it as it trusts an entry)."""
    if in_cache:
        trust.make_dirs(path.parent)  # 0700, like every folder of the cache
    else:  # (a path of the user's: no folder above it that another user could swap, new ones 0700)
        trust.make_parents(path)
    private_files.replace_file(path.parent, path.name, text.encode(), trust.PRIVATE_FILE_MODE)


def check_out(path: Path) -> None:
    """--out names a file sparsegen may write: no folder above it another user could swap
    (trust.check_ancestors), not a folder itself, and the nearest existing folder writable."""
    trust.check_ancestors(path)
    expect(not path.is_dir(), "--out naming a file, not a folder", str(path), SpecError)
    probe = trust.nearest_existing(path)
    expect(os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK), "--out in a folder you can write",
           f"{path} (nearest existing folder {probe})", SpecError)


def table_text(gpu_name: str, points: list[dict]) -> str:
    """The table file: its header, then one point per line (diffs stay readable)."""
    header = dict(gpu=gpu_name, torch=torch.__version__, date=datetime.date.today().isoformat())
    rows = ",\n".join(json.dumps(p) for p in points)
    return json.dumps(header)[:-1] + ', "points": [\n' + rows + "\n]}\n"


def summary(points) -> str:
    """Per layout, the share of measured cells where the sparse kernel loses."""
    lines = []
    for layout, block, density in dict.fromkeys((p.layout, p.block, p.density) for p in points):
        mine = [p for p in points if (p.layout, p.block, p.density) == (layout, block, density)]
        losing = sum(p.speedup < crossovers.LOSES_BELOW for p in mine)
        label = layout if tuple(block) == (0, 0) and density == 1 else f"{layout} b{block[0]}x{block[1]} d{density:g}"
        lines.append(f"{label}: dense path in {losing} of {len(mine)} cells")
    return "\n".join(lines)


def main(quick: bool = False, out: Path | None = None, only: list[str] | None = None) -> int:
    """`only`: the layouts to measure (NAMES), the others' points kept."""
    expect(not only or set(only) <= set(NAMES), f"layouts among {NAMES}", repr(only))
    if out is not None:  # (before minutes of measuring, not after)
        check_out(Path(out))
    if not torch.cuda.is_available():
        print("sparsegen tune: needs a CUDA GPU (the packaged H100/H200 tables apply elsewhere)", file=sys.stderr)
        return 2
    grid = dict(QUICK if quick else {})
    grid["layouts"] = [row for row in grid.get("layouts", LAYOUTS) if not only or row[0] in only]
    path = run(**grid, out=out)
    print(summary(crossovers.load(path)))
    print(f"sparsegen tune: wrote {path}")
    return 0
