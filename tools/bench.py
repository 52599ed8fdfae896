"""Side-by-side benchmark: sparsegen block-sparse forward vs dense cuBLAS vs PyTorch BSR.

Run on a GPU:  PYTHONPATH=. python tools/bench.py [--quick] [--json out/bench.json]
Every ratio is dense_time / method_time measured in the same process (above 1 = faster);
tools/benchmarks_md.py renders the recorded tables into BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import sparsegen  # noqa: E402
from bench_record import Table, write  # noqa: E402
from sparsegen.bsr import ops as bsr_ops  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 4096, 11008), (8192, 11008, 4096), (16384, 1024, 4096),
          (2048, 8192, 8192)]
BLOCKS = [16, 32, 64, 128]
DENSITIES = [0.1, 0.25, 0.5]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def median_ms(fn) -> float:
    from triton.testing import do_bench  # only the GPU modes need triton

    return do_bench(fn, warmup=20, rep=80, return_mode="median")


def interleaved(*timers, rounds: int = 3) -> list:
    """Each timer's median over `rounds` rounds that take them in turn: the GPU's clocks
    drift during a run by more than the margins being measured. A timer that returns None
    (a peer that refused the shape) gives None."""
    results = [[timer() for timer in timers] for _ in range(rounds)]
    return [None if None in column else statistics.median(column) for column in zip(*results)]


def target_speedup(block: int, density: float) -> float:
    """Issue #2's bar: 0.6/d at blocks 64 and 128, 0.45/d at 32, 0.3/d at 16."""
    return {16: 0.3, 32: 0.45}.get(block, 0.6) / density


def torch_bsr_ms(weight: torch.Tensor, x: torch.Tensor, block: int) -> float | None:
    from torch.sparse._triton_ops import bsr_dense_mm

    w_bsr = weight.to_sparse_bsr((block, block))
    xt = x.t().contiguous()  # bsr_dense_mm computes W X^T; X^T is prepared outside the timing
    try:
        return median_ms(lambda: bsr_dense_mm(w_bsr, xt))
    except Exception as error:  # the peer refuses some configurations; record that, go on
        print(f"  torch BSR failed: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
        return None


def bench_case(m, k, n, block, density, dtype, x):
    layer = sparsegen.linear(k, n, block=(block, block), density=density, bias=False,
                             device="cuda", dtype=dtype)
    with torch.no_grad():
        sg_ms = median_ms(lambda: layer(x))
        peer_ms = torch_bsr_ms(layer.to_dense_weight(), x, block)
    return dict(m=m, k=k, n=n, block=block, density=round(layer.density, 4),
                sparsegen_ms=sg_ms, torch_bsr_ms=peer_ms,
                target=target_speedup(block, density) if m >= 4096 else None,
                useful_tflops=2 * m * n * k * layer.density / sg_ms / 1e9)


FORWARD_COLUMNS = [("dtype", ""), ("M, K, N", ""), ("block", ""), ("density", ".3f"), ("dense ms", ".3f"),
                   ("sparsegen ms", ".3f"), ("sparsegen", "x"), ("torch BSR", "x"), ("target", "x"), ("met", ""),
                   ("useful TFLOP/s", ".0f")]


def bench_forward(table: Table, dtype_names, shapes, blocks, densities) -> list[dict]:
    """Dense is re-timed before every sparse case and each shape's rows use the median of
    those timings: the GPU's clock drifts by several percent over a run."""
    rows = []
    for name in dtype_names:
        dtype = DTYPES[name]
        for m, k, n in shapes:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype)
            dense = lambda: median_ms(lambda: F.linear(x, w))
            shape_rows, dense_times = [], []
            for block in blocks:
                for density in densities:
                    dense_times.append(dense())
                    shape_rows.append(bench_case(m, k, n, block, density, dtype, x))
            rows += [finish_row(name, row, statistics.median(dense_times)) for row in shape_rows]
            for r in rows[-len(shape_rows):]:
                table.add(*forward_cells(r))
    return rows


def finish_row(dtype_name: str, row: dict, dense_ms: float) -> dict:
    peer = row["torch_bsr_ms"]
    return dict(dtype=dtype_name, **row, dense_ms=dense_ms, speedup=dense_ms / row["sparsegen_ms"],
                bsr_speedup=dense_ms / peer if peer else None)


def forward_cells(r: dict) -> list:
    ok = None if r["target"] is None else ("yes" if r["speedup"] >= r["target"] else "NO")
    return [r["dtype"], f"{r['m']}, {r['k']}, {r['n']}", r["block"], r["density"], r["dense_ms"], r["sparsegen_ms"],
            r["speedup"], r["bsr_speedup"], r["target"], ok, r["useful_tflops"]]


def forward_notes(rows: list[dict]) -> list[str]:
    met = [r for r in rows if r["target"] is not None]
    peer = [r for r in rows if r["bsr_speedup"]]
    return [f"targets (issue #2, M >= 4096) met: {sum(r['speedup'] >= r['target'] for r in met)}/{len(met)}",
            f"faster than torch BSR: {sum(r['speedup'] > r['bsr_speedup'] for r in peer)}/{len(peer)} "
            f"(torch BSR failed on {len(rows) - len(peer)})"]


def tiny_layer_and_input():
    """A forward whose GPU work is negligible: what remains is host time."""
    layer = sparsegen.linear(256, 256, block=(32, 32), density=0.5, device="cuda", dtype=torch.bfloat16)
    return layer, torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)


def host_overhead_us() -> float:
    """Per-call host time of a forward whose kernel is already loaded."""
    layer, x = tiny_layer_and_input()
    with torch.no_grad():
        for _ in range(50):
            layer(x)
        torch.cuda.synchronize()
        calls, start = 2000, time.perf_counter()
        for _ in range(calls):
            layer(x)
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


NEW_PROCESS_SNIPPET = """
import time, torch
torch.zeros(1, device='cuda'); torch.cuda.synchronize()
t0 = time.perf_counter()
from sparsegen.jit import cache
from sparsegen.launch import runtime
from sparsegen.bsr import specs as spec
t1 = time.perf_counter()
s = spec.forward_spec((64, 64), 'bf16', runtime.device_arch(torch.device('cuda')))
cache.build(s); t2 = time.perf_counter()
runtime.kernel(s, 0); t3 = time.perf_counter()
print((t3 - t1) * 1e3, (t2 - t1) * 1e3, (t1 - t0) * 1e3)
"""


def cached_kernel_ready_ms() -> str:
    """A new process (torch and CUDA already up), disk cache warm: from asking for a kernel
    to a launchable one (of which: finding the CUBIN on disk), and `import sparsegen` before it."""
    run = lambda: subprocess.run([sys.executable, "-c", NEW_PROCESS_SNIPPET], check=True,
                                 capture_output=True, text=True).stdout.split()
    run()  # makes sure the disk entry exists
    ready, disk, imported = sorted([float(v) for v in run()] for _ in range(3))[1]  # median of 3
    return f"{ready:.1f} (finding the CUBIN on disk: {disk:.1f}; import sparsegen before it: {imported:.1f})"


def weight_memory_ratio(density: float, block: int = 64, n: int = 11008, k: int = 4096) -> float:
    layer = sparsegen.linear(k, n, block=(block, block), density=density, bias=False,
                             device="cuda", dtype=torch.bfloat16)
    sparse_bytes = sum(t.numel() * t.element_size() for t in
                       (layer.values, layer.row_offsets, layer.col_indices, layer.layout))
    return sparse_bytes / (n * k * 2)


def tune(dtype_name: str, shape, block: int, density: float, tiles, instr) -> None:
    """Time tile configurations of one case (for choosing spec.default_tile)."""
    m, k, n = shape
    dtype = DTYPES[dtype_name]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    dense_ms = median_ms(lambda: F.linear(x, w))
    layer = sparsegen.linear(k, n, block=(block, block), density=density, bias=False,
                             device="cuda", dtype=dtype)
    for tile in tiles:
        try:
            ms = median_ms(lambda: bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices,
                                               None, layer.block, n, tile=tile, instr=instr))
        except sparsegen.SparsegenError as error:
            print(f"tune {dtype_name} {shape} b{block} d{density} {tile.tag}: {error}")
            continue
        tag = tile.tag if tile else "default"
        print(f"tune {dtype_name} {shape} b{block} d{density} {instr or 'default'} {tag}: {ms:.3f} ms "
              f"speedup {dense_ms / ms:.2f} (target {target_speedup(block, density):.2f})", flush=True)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, dtype in zip(axes, DTYPES):
        for block in BLOCKS:
            sel = [r for r in rows if r["dtype"] == dtype and r["block"] == block
                   and (r["m"], r["k"], r["n"]) == (8192, 4096, 11008)]
            if sel:
                ax.plot([r["density"] for r in sel], [r["speedup"] for r in sel], "o-", label=f"block {block}")
        d = [0.1, 0.25, 0.5]
        ax.plot(d, [1 / v for v in d], "k:", label="ideal 1/d")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(title=f"{dtype}, M,K,N = 8192,4096,11008", xlabel="density", ylabel="speedup over dense")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bench_training(shape=(8192, 4096, 11008), blocks=(64, 128), densities=(0.25, 0.5)) -> Table:
    """Forward+backward of one linear, and its two backward products alone (issue #3). Each
    row times dense and ours in alternation (interleaved): dense alone drifted by 15%
    between runs, more than the margins measured. Per-useful-FLOP ratios: cuBLAS's own
    product time times the density, over ours (issue #3's 60% bar)."""
    m, k, n = shape
    table = Table("Training", f"One block-sparse linear, forward + backward, {shape}, bf16", [
        ("layer", ""), ("density", ""), ("dense fwd+bwd ms", ".3f"), ("fwd+bwd ms", ".3f"), ("fwd+bwd", "x"),
        ("dX ms", ".3f"), ("dW ms", ".3f"), ("dX vs cuBLAS per useful FLOP", "%"),
        ("dW vs cuBLAS per useful FLOP", "%")])
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dense = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    for block in blocks:
        for density in densities:
            layer = sparsegen.linear(k, n, block=(block, block), density=density, bias=False,
                                     device="cuda", dtype=torch.bfloat16)
            dx, dw = backward_parts(layer, x.detach(), dy)
            times = interleaved(lambda: median_ms(lambda: dense(x).backward(dy)),
                                lambda: median_ms(lambda: layer(x).backward(dy)),
                                lambda: median_ms(lambda: dy @ dense.weight), lambda: median_ms(dx),
                                lambda: median_ms(lambda: dy.t() @ x), lambda: median_ms(dw))
            dense_ms, both, dense_dx, dx, dense_dw, dw = times
            d = layer.density
            table.add(f"b{block}", density, dense_ms, both, dense_ms / both, dx, dw, dense_dx * d / dx,
                      dense_dw * d / dw)
    return table


def backward_parts(layer, x, dy):
    """Callables for dX and dW as the layer's backward runs them (bsr_ops.input_grad: on sm_90
    the swap kernel reading the stored blocks transposed, else a transposed copy of the
    values and the forward kernel on W^T; bsr_ops.weight_grad)."""
    _, _, flat, t_rows, t_cols, t_flat, t_perm = layer._index()
    (bm, bk), values = layer.block, layer.values.detach()
    dx = lambda: bsr_ops.input_grad(dy, values, t_perm, t_rows, t_cols, t_flat, (bk, bm), x.shape[1])  # noqa: E731
    return dx, lambda: bsr_ops.weight_grad(dy, x, flat, layer.block)


SDD_TILES = {128: ["t64w8x1s4", "t48w8x1s5", "t32w8x1s8", "t32w2x2s4"],
             64: ["t64w8x1s4", "t64w8x1s5", "t48w8x1s6", "t64w16x1s3", "t48w16x1s4", "t32w16x1s6", "t32w2x2s4"]}


def tune_sdd(shape=(8192, 4096, 11008), densities=(0.25, 0.5)) -> None:
    """Tile configurations of the weight-gradient kernel (warps_n 1: the wgmma one),
    interleaved with cuBLAS's dense dW: per useful FLOP, the issue's measure."""
    from sparsegen.launch import runtime
    from sparsegen.bsr.specs import sdd_spec
    from sparsegen.jit.spec import TileConfig

    m, k, n = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for (block, tags), density in itertools.product(SDD_TILES.items(), densities):
        layer = sparsegen.linear(k, n, block=(block, block), density=density, bias=False, device="cuda",
                                 dtype=torch.bfloat16)
        flat, out = layer.flat_index, torch.empty_like(layer.values)
        tiles = [TileConfig.from_tag(tag) for tag in tags]
        kernels = [runtime.kernel(sdd_spec(layer.block, "bf16", 90, t, "tma" if t.warps_n == 1 else "mma"), 0)
                   for t in tiles]
        launches = [lambda kern=kern: bsr_ops.sdd_into(out, dy, x, flat, layer.block, kern) for kern in kernels]
        dense, *times = interleaved(lambda: median_ms(lambda: dy.t() @ x), *[lambda f=f: median_ms(f) for f in launches])
        for tag, ms in zip(tags, times):
            print(f"sdd b{block} d{density} {tag}: {ms:.3f} ms, {dense * layer.density / ms:.0%} of cuBLAS "
                  f"per useful FLOP (dense dW {dense:.3f} ms)", flush=True)


def compile_times() -> Table:
    """Cold NVRTC compile of every default kernel, one at a time (no GPU needed)."""
    import os
    import tempfile

    from sparsegen.jit import cache, spec

    os.environ["SPARSEGEN_CACHE_DIR"] = tempfile.mkdtemp()
    table = Table("Compile and overheads", "Cold NVRTC compile of the default kernels, one at a time",
                  [("arch", ""), ("kernels", ""), ("CPU cores", ""), ("median s", ".2f"), ("max s", ".2f"),
                   ("total s", ".0f")])
    for arch in (80, 90):
        seconds = []
        for s in spec.default_specs(arch):
            start = time.perf_counter()
            assert cache.build(s).compiled
            seconds.append(time.perf_counter() - start)
        table.add(f"sm_{arch}", len(seconds), os.cpu_count(), statistics.median(seconds), max(seconds), sum(seconds))
    return table


def overheads() -> Table:
    table = Table("Compile and overheads", "Host overhead, kernel load and weight memory (block-sparse)",
                  [("what", ""), ("value", "")])
    table.add("host time per forward call of a 256x256 layer, 8 tokens (us)", f"{host_overhead_us():.1f}")
    table.add("cached kernel ready in a new process (ms)", cached_kernel_ready_ms())
    for d in DENSITIES:
        table.add(f"weight memory / dense at density {d} (block 64, 11008x4096)", f"{weight_memory_ratio(d):.4f}")
    return table


def bench_layout(key: str, shapes=((8192, 4096, 11008), (4096, 4096, 4096), (16, 4096, 11008)),
                 compiled: bool = False) -> Table:
    """Any tuned layout by its face (registry.Tuning: the points `sparsegen tune` measures),
    forward and forward + backward against a dense nn.Linear of the same weight, bf16: a new
    layout is benchmarked with no edit here (--layout NAME). `compiled`: both under
    torch.compile (the kit's gradients then as they run, not also as they were)."""
    from sparsegen import tune

    if key not in tune.TUNINGS:
        raise SystemExit(f"bench.py: Expected --layout among {tune.NAMES}. Got {key!r}.")
    tuning = tune.TUNINGS[key]
    mode = ", both under torch.compile" if compiled else ""
    table = Table("Block-sparse layers", f"The {key} layout (its face's tuning points) against dense, bf16{mode}",
                  [("M, K, N", ""), ("block", ""), ("density", ".3g"), ("dense ms", ".3f"), ("sparse ms", ".3f"),
                   ("speedup", "x"), ("train dense ms", ".3f"), ("train sparse ms", ".3f"), ("train speedup", "x"),
                   ("train, dense dX and dW ms", ".3f"), ("sampled kernels' gain", "x")])
    for (m, k, n), (block, density) in itertools.product(shapes, tuning.points):
        if not tuning.fits(n, k, block, density):
            continue
        layer = tuning.layer(n, k, block, density, device="cuda", dtype=torch.bfloat16)
        dense = layer.to_linear().requires_grad_()
        if compiled:  # (each row its own graphs: static shapes, no recompile limit reached across rows)
            torch._dynamo.reset()
            dense, layer = torch.compile(dense, dynamic=False), torch.compile(layer, dynamic=False)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            forward = interleaved(*(lambda f=f: median_ms(lambda: f(x)) for f in (dense, layer)))
        runs = [lambda f=f: median_ms(lambda: f(x).backward(dy)) for f in (dense, layer)]
        product = None if compiled else getattr(layer, "PRODUCT", None)
        if getattr(product, "sampled_weight_grad", None) is not None:  # the kit's gradients: also as they were
            runs.append(lambda: with_dense_weight_grad(product, lambda: median_ms(lambda: layer(x).backward(dy))))
        train = interleaved(*runs) + [None] * (3 - len(runs))
        table.add(f"{m}, {k}, {n}", f"{block[0]}x{block[1]}", getattr(layer, "density", density),
                  *forward, forward[0] / forward[1], *train[:2], train[0] / train[1], train[2],
                  train[2] / train[1] if train[2] else None)
    return table


def with_dense_weight_grad(product, timed):
    """timed() with the kit's gradients taken as before its sampled kernels: dW as the dense
    dY^T X (cuBLAS) and a gather of the stored blocks; dX (where the kit's kernel runs it) as
    dY times a dense W scattered from the blocks."""
    def dense_then_gathered(dy2, x2, positions, block):
        full = dy2.t() @ x2
        blocks = full.reshape(full.shape[0] // block[0], block[0], -1, block[1]).transpose(1, 2)
        return blocks.reshape(-1, *block)[positions]

    def dense_input_grad(dy, values, perm, row_offsets, col_indices, flat_index, block_t, in_features):
        (bk, bm), out = block_t, dy.shape[-1]
        grid = values.new_zeros((in_features // bk) * (out // bm), bk, bm)
        grid[flat_index] = values[perm].transpose(1, 2)
        weight_t = grid.reshape(in_features // bk, out // bm, bk, bm).transpose(1, 2).reshape(in_features, out)
        return (dy.reshape(-1, out) @ weight_t.t()).reshape(*dy.shape[:-1], in_features)
    kept = product.sampled_weight_grad, product.sampled_input_grad
    product.sampled_weight_grad = dense_then_gathered if kept[0] is not None else None
    product.sampled_input_grad = dense_input_grad if kept[1] is not None else None
    try:
        return timed()
    finally:
        product.sampled_weight_grad, product.sampled_input_grad = kept


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape, bf16 only")
    parser.add_argument("--plot", type=Path, help="write the speedup plot (PNG) here")
    parser.add_argument("--json", type=Path, help="record the tables here (tools/benchmarks_md.py renders them)")
    parser.add_argument("--tune", action="store_true", help="time tile configurations instead")
    parser.add_argument("--overheads", action="store_true", help="only host overheads and memory")
    parser.add_argument("--compile", action="store_true", help="cold compile times (no GPU needed)")
    parser.add_argument("--train", action="store_true", help="forward+backward timings only")
    parser.add_argument("--bell", action="store_true", help="the block-ELL layout against block-CSR and dense")
    parser.add_argument("--bdiag", action="store_true", help="the block-diagonal layout against dense and torch.bmm")
    parser.add_argument("--acc", action="store_true", help="fp16 accumulators against f32 on the mma.sync kernel")
    parser.add_argument("--compiled", action="store_true", help="--layout's layers and dense under torch.compile")
    parser.add_argument("--layout", help="any tuned layout by its registry key (sp24, bsr, bell, bdiag, or a new one's)")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.tune:
        return run_tuning()
    modes = [(args.bell, bench_bell), (args.bdiag, bench_bdiag), (args.acc, bench_acc), (args.compile, compile_times),
             (args.train, bench_training), (args.overheads, overheads)]
    modes.append((args.layout, lambda: bench_layout(args.layout, compiled=args.compiled)))
    tables = [make() for wanted, make in modes if wanted] or forward_tables(args)
    write(args.json, "bench.py", argv, tables)


def forward_tables(args) -> list[Table]:
    """The block-sparse forward over shapes, blocks and densities, then the overheads."""
    dtypes, shapes = (["bf16"], SHAPES[1:2]) if args.quick else (list(DTYPES), SHAPES)
    table = Table("Block-sparse layers", "Block-sparse forward against cuBLAS and PyTorch's BSR (Triton)",
                  FORWARD_COLUMNS, "Speedup: dense F.linear time over the method's, side by side in one process. "
                  "Per block, its densities (1-3) side by side; ms, targets and TFLOP/s per cell are in the "
                  "recorded JSON (tools/results/).").pivot("density", ["sparsegen", "torch BSR"])
    rows = bench_forward(table, dtypes, shapes, BLOCKS, DENSITIES)
    table.notes = forward_notes(rows)
    if args.plot:
        plot(rows, args.plot)
    return [table, overheads()]


def bench_bell(shapes=((8192, 4096, 11008), (4096, 4096, 4096), (16, 4096, 11008)), blocks=(32, 64),
               densities=(0.125, 0.25, 0.5)) -> Table:
    """The block-ELL layout (sparsegen.bell) against block-CSR holding the very same blocks,
    and dense cuBLAS, bf16, in one process: what a fixed count of blocks per row buys."""
    from sparsegen.bell.nn import BlockEllLinear

    table = Table("Block-sparse layers", "Block-ELL (the worked layout) against block-CSR holding the same blocks, bf16",
                  [("M, K, N", ""), ("block", ""), ("density", ".3f"), ("dense ms", ".3f"), ("block-CSR ms", ".3f"),
                   ("block-ELL ms", ".3f"), ("CSR", "x"), ("ELL", "x"), ("ELL - CSR max diff", ".3g")])
    for (m, k, n), block, density in itertools.product(shapes, blocks, densities):
        ell = BlockEllLinear(k, n, (block, block), density=density, bias=False, device="cuda", dtype=torch.bfloat16)
        csr = sparsegen.BlockSparseLinear.from_dense(ell.to_linear(), (block, block), layout=ell_mask(ell))
        x, w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), ell.to_dense_weight().detach()
        with torch.no_grad():
            diff = (ell(x).float() - csr(x).float()).abs().max().item()
            dense_ms, csr_ms, ell_ms = interleaved(*(lambda f=f: median_ms(f) for f in (
                lambda: F.linear(x, w), lambda: csr(x), lambda: ell(x))))
        table.add(f"{m}, {k}, {n}", block, ell.density, dense_ms, csr_ms, ell_ms, dense_ms / csr_ms, dense_ms / ell_ms,
                  diff)
    return table


def bench_bdiag(shapes=((8192, 4096, 4096), (8192, 4096, 11008), (16, 4096, 4096)), nblocks=(2, 4, 8)) -> Table:
    """The block-diagonal layout (sparsegen.bdiag, through the layout kit) against a dense
    nn.Linear of the same (zero-filled) weight and torch.bmm of its diagonal blocks, bf16:
    the forward, and forward + backward (x and the weights both need gradients)."""
    from sparsegen.bdiag.nn import BlockDiagonalLinear
    from sparsegen.bdiag.ops import batched_product

    table = Table("Block-sparse layers", "Block-diagonal (the kit's second layout) against dense and torch.bmm, bf16",
                  [("M, K, N", ""), ("nblocks", ""), ("dense ms", ".3f"), ("bmm ms", ".3f"), ("bdiag ms", ".3f"),
                   ("vs dense", "x"), ("vs bmm", "x"), ("train dense ms", ".3f"), ("train bmm ms", ".3f"),
                   ("train bdiag ms", ".3f"), ("train vs dense", "x"), ("train vs bmm", "x")])
    for (m, k, n), count in itertools.product(shapes, nblocks):
        layer = BlockDiagonalLinear(k, n, count, bias=False, device="cuda", dtype=torch.bfloat16)
        dense = layer.to_linear().requires_grad_()
        blocks = layer.blocks().detach().clone().requires_grad_()
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        products = (dense, lambda x: batched_product(x, blocks), layer)
        with torch.no_grad():
            forward = interleaved(*(lambda f=f: median_ms(lambda: f(x)) for f in products))
        train = interleaved(*(lambda f=f: median_ms(lambda: f(x).backward(dy)) for f in products))
        table.add(f"{m}, {k}, {n}", count, *forward, forward[0] / forward[2], forward[1] / forward[2], *train,
                  train[0] / train[2], train[1] / train[2])
    return table


def bench_acc(shapes=((8192, 4096, 11008), (16, 4096, 11008)), blocks=(32, 64), densities=(0.25, 0.5)) -> Table:
    """The accumulator as a spec parameter: the mma.sync kernel with f32 and with fp16
    accumulators (acc="f16"), fp16 operands, beside the default kernel and dense cuBLAS;
    error: each output's relative error against float64."""
    table = Table("Block-sparse layers", "Accumulator as a spec parameter: the mma.sync kernel, f32 and fp16 "
                  "accumulators, fp16 operands", [
                      ("M, K, N", ""), ("block", ""), ("density", ".2f"), ("dense ms", ".3f"), ("default kernel ms", ".3f"),
                      ("mma f32 ms", ".3f"), ("mma f16 ms", ".3f"), ("f16 over f32", "x"), ("error f32", ".1e"),
                      ("error f16", ".1e")], "error: relative to a float64 product of the same operands")
    for (m, k, n), block, density in itertools.product(shapes, blocks, densities):
        layer = sparsegen.BlockSparseLinear(k, n, (block, block), density=density, bias=False, device="cuda",
                                            dtype=torch.float16)
        x, w = torch.randn(m, k, device="cuda", dtype=torch.float16), layer.to_dense_weight().detach()
        args = (x, layer.values, layer.row_offsets, layer.col_indices, None, layer.block, n)
        with torch.no_grad():
            f32, f16 = (lambda acc=acc: bsr_ops.bsr_dds(*args, instr="mma", acc=acc) for acc in ("f32", "f16"))
            exact = F.linear(x.double(), w.double())
            errs = [((f().double() - exact).norm() / exact.norm()).item() for f in (f32, f16)]
            times = interleaved(*(lambda f=f: median_ms(f) for f in (lambda: F.linear(x, w), lambda: layer(x), f32, f16)))
        table.add(f"{m}, {k}, {n}", block, layer.density, *times, times[2] / times[3], *errs)
    return table


def ell_mask(layer) -> torch.Tensor:
    """A block-ELL layer's blocks as a block-CSR layout mask."""
    mask = torch.zeros(layer.out_features // layer.block[0], layer.in_features // layer.block[1], dtype=torch.bool)
    mask[torch.arange(mask.shape[0])[:, None], layer.cols.cpu().long()] = True
    return mask


def run_tuning() -> None:
    """Each family's best tile per block size, on the shapes and densities that miss targets;
    then the weight-gradient kernel's tiles."""
    from sparsegen.jit.spec import TileConfig as T

    variants = {128: [("swap", T(256, 8, 1, 4)), ("tma", T(256, 8, 1, 4)), ("pingpong", T(128, 8, 1, 6))],
                64: [("swap", T(256, 8, 1, 4)), ("swap", T(256, 8, 1, 5)), ("pingpong", T(256, 8, 1, 5)),
                     ("tma", T(256, 8, 1, 4))]}
    for shape, density in [((8192, 4096, 11008), 0.25), ((8192, 4096, 11008), 0.1),
                           ((16384, 1024, 4096), 0.25)]:
        for block, choices in variants.items():
            for instr, tile in choices:
                tune("bf16", shape, block, density, [tile], instr)
    tune_sdd()

if __name__ == "__main__":
    main()
