"""2:4 semi-structured benchmark: sparsegen's mma.sp kernel vs dense cuBLAS vs PyTorch's
to_sparse_semi_structured (cuSPARSELt, eager F.linear), side by side in one process.

GPU: PYTHONPATH=. python tools/bench24.py [--quick] [--json out/bench24.json] [--plot out.png]
Ratios are dense time / method time (above 1 = faster than dense); tools/benchmarks_md.py
renders the recorded tables into BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import sparsegen  # noqa: E402
from bench import interleaved, median_ms  # noqa: E402
from bench_record import Table, write  # noqa: E402
from sparsegen.semi24 import ops as sp24_ops  # noqa: E402

WEIGHTS = [(4096, 4096), (11008, 4096), (4096, 11008), (8192, 8192)]  # N x K
TOKENS = [16, 128, 1024, 4096, 16384]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cusparselt_ms(w: torch.Tensor, x: torch.Tensor) -> float | None:
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

    SparseSemiStructuredTensor._FORCE_CUTLASS = False  # CUTLASS refuses sm_90; cuSPARSELt runs
    try:
        w_sparse = to_sparse_semi_structured(w)
        return median_ms(lambda: F.linear(x, w_sparse))
    except Exception as error:  # record the peer's refusal and go on
        print(f"  cuSPARSELt failed: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
        return None


def forward_table(dtype_names, weights, tokens) -> Table:
    table = Table("2:4 semi-structured", "16-bit 2:4 forward against cuBLAS and cuSPARSELt (to_sparse_semi_structured)", [
        ("dtype", ""), ("weight N x K", ""), ("M", ""), ("dense ms", ".4f"), ("sparsegen ms", ".4f"), ("sparsegen", "x"),
        ("cuSPARSELt", "x"), ("target", "x"), ("met", "")],
        "target: 1.15x dense from 1024 tokens (and faster than cuSPARSELt), 0.9x below")
    for name in dtype_names:
        dtype = DTYPES[name]
        for n, k in weights:
            w = torch.randn(n, k, device="cuda", dtype=dtype)
            sparse = sparsegen.to_sparse24(w)
            dense_w = sparse.to_dense()
            for m in tokens:
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                dense, ours, peer = interleaved(
                    lambda: median_ms(lambda: F.linear(x, w)),
                    lambda: median_ms(lambda: sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, None, n)),
                    lambda: cusparselt_ms(dense_w, x))
                target = 1.15 if m >= 1024 else 0.9
                ok = ours <= dense / target and (peer is None or ours < peer or m < 1024)
                table.add(name, f"{n}x{k}", m, dense, ours, dense / ours, None if peer is None else dense / peer,
                          target, "yes" if ok else "NO")
    return table


def prune_compress_ms(n: int = 4096, k: int = 11008) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return {method: median_ms(lambda: sparsegen.to_sparse24(w, method)) for method in ("magnitude", "transposable", "mvue")}


GPT2_WIDTHS = (768, 1024, 2048, 2560)  # the 2by4 paper's GPT-2 FFN shapes: d -> 4d -> d
TRAIN_TOKENS = 2048 * 4  # sequence 2048 x batch 4
# The 2:4 training layers timed, by column: fixed-mask layers (values trained) or the recipe's
# (dense weights, mask refreshed every 100 steps).
TRAIN_VARIANTS = {
    "Sparse24Linear, magnitude mask": lambda dense: sparsegen.Sparse24Linear.from_dense(dense, method="magnitude"),
    "Sparse24Linear, transposable mask": lambda dense: sparsegen.Sparse24Linear.from_dense(dense, method="transposable"),
    "2by4 recipe": lambda dense: sparsegen.Sparse24TrainingLinear.from_dense(dense),
    "recipe + dw_sparse": lambda dense: sparsegen.Sparse24TrainingLinear.from_dense(dense, dw_sparse=True),
}


def ffn(d: int, variant: str | None) -> torch.nn.Module:
    """GPT-2's FFN block (d -> 4d, GELU, 4d -> d) in bf16, its linears dense or 2:4."""
    torch.manual_seed(0)
    up, down = (torch.nn.Linear(a, b, device="cuda", dtype=torch.bfloat16) for a, b in ((d, 4 * d), (4 * d, d)))
    if variant is not None:
        up, down = TRAIN_VARIANTS[variant](up), TRAIN_VARIANTS[variant](down)
    return torch.nn.Sequential(up, torch.nn.GELU(approximate="tanh"), down)


def fwd_bwd_ms(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> float:
    """One training step's products - forward, backward into fresh gradients - replayed as a
    CUDA graph (as a graphed training step runs them: the GPU's time, no launch cost). Three
    eager steps first, on a side stream, as capture asks."""
    def step():
        model(x).backward(dy)

    def clear():
        for p in [*model.parameters(), x]:
            p.grad = None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            clear()
            step()
    torch.cuda.current_stream().wait_stream(side)
    clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return median_ms(graph.replay)


def train_table(widths=GPT2_WIDTHS, tokens: int = TRAIN_TOKENS) -> Table:
    """fwd+bwd per FFN block, dense against the 2:4 training variants, and one linear
    (8192, 4096, 11008) the same way, each as a CUDA graph."""
    cases = [(f"GPT-2 FFN d={d}", tokens, d, lambda v, d=d: ffn(d, v)) for d in widths]
    cases.append(("linear (8192, 4096, 11008)", 8192, 4096, lambda v: _linear_case(v)))
    table = Table("Training", "2:4 training layers, forward + backward as a CUDA graph, bf16", [
        ("case", ""), ("tokens", ""), ("dense ms", ".3f")] + [(v, "x") for v in TRAIN_VARIANTS],
        "each variant: dense time over its time, the same inputs, interleaved")
    for label, m, d, build in cases:
        models = [build(None)] + [build(v) for v in TRAIN_VARIANTS]
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, models[0](x).shape[-1], device="cuda", dtype=torch.bfloat16)
        times = interleaved(*(lambda model=model: fwd_bwd_ms(model, x, dy) for model in models))
        table.add(label, m, times[0], *(times[0] / t for t in times[1:]))
    return table


def _linear_case(variant: str | None) -> torch.nn.Module:
    torch.manual_seed(0)
    dense = torch.nn.Linear(4096, 11008, bias=False, device="cuda", dtype=torch.bfloat16)
    return dense if variant is None else TRAIN_VARIANTS[variant](dense)


DECODE_WEIGHTS = [(4096, 4096), (11008, 4096), (4096, 11008), (8192, 8192), (14336, 4096)]  # N x K
DECODE_TOKENS = (1, 8, 16, 64, 128)


def graph_ms(calls) -> float | None:
    """Per call, the median time of `calls` (each on its own weight) replayed from one CUDA
    graph - no launch cost - or None if they cannot be captured. The weights together are 3x
    the L2 cache, so each call reads its weight from HBM, as a decode step over many layers
    does (one weight replayed alone would stay in L2)."""
    from triton.testing import do_bench_cudagraph

    def all_calls():
        for call in calls:
            call()
    try:
        return do_bench_cudagraph(all_calls, rep=40, return_mode="median") / len(calls)
    except Exception as error:  # a peer that cannot be captured: recorded, not fatal
        print(f"  capture failed: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
        return None


# Bytes a weight of the 16-bit 2:4 layer (half the values, 2 metadata bits each) and of the
# 4-bit one (group 128: half the values in 4 bits, the metadata, a 16-bit scale per 128): the
# smallest layer a table times sizes its weight copies (hbm_copies).
SP24_BYTES_PER_WEIGHT = 1 + 0.125
INT4_BYTES_PER_WEIGHT = 0.25 + 0.125 + 2 / 128


def hbm_copies(n: int, k: int, bytes_per_weight: float = INT4_BYTES_PER_WEIGHT) -> int:
    """How many N x K weights of the smallest layer timed make 3x the L2 cache (at least 2): a
    graph replaying one call per copy reads every variant's weights from HBM."""
    return max(2, -(-3 * torch.cuda.get_device_properties(0).L2_cache_size // int(bytes_per_weight * n * k)))


def decode_weights(n: int, k: int) -> tuple[list, list]:
    """bf16 N x K weights, dense and 2:4, as many as make 3x the L2 cache in the 2:4 weight's
    bytes (at least 2): a graph replaying one call per weight reads each from HBM."""
    copies = hbm_copies(n, k, SP24_BYTES_PER_WEIGHT)
    dense_ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    return dense_ws, [sparsegen.to_sparse24(w) for w in dense_ws]


def decode_table(weights=DECODE_WEIGHTS, tokens=DECODE_TOKENS) -> Table:
    """1-128 tokens, bf16: eager (do_bench flushes L2 before each call) and CUDA-graph times
    of dense, sparsegen and cuSPARSELt."""
    from torch.sparse import to_sparse_semi_structured

    table = Table("2:4 semi-structured", "2:4 decode, 1-128 tokens, bf16, weights read from HBM", [
        ("weight N x K", ""), ("M", ""), ("dense eager ms", ".4f"), ("sparsegen eager", "x"), ("cuSPARSELt eager", "x"),
        ("dense graph ms", ".4f"), ("sparsegen graph", "x"), ("cuSPARSELt graph", "x"), ("graph: > 1.3x and > cuSPARSELt", "")],
        "graph: calls replayed from one CUDA graph over weights 3x the L2 cache in the 2:4 weight's bytes "
        "(no launch cost)")
    for n, k in weights:
        dense_ws, sparse = decode_weights(n, k)
        peers = [_cusparselt_weight(s.to_dense(), to_sparse_semi_structured) for s in sparse]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            calls = [[lambda w=w: F.linear(x, w) for w in dense_ws],
                     [lambda s=s: sp24_ops.sp24_dds(x, s.values, s.metadata, None, n) for s in sparse],
                     None if None in peers else [lambda p=p: F.linear(x, p) for p in peers]]
            eager = interleaved(*(lambda c=c: c and median_ms(c[0]) for c in calls))
            graph = interleaved(*(lambda c=c: c and graph_ms(c) for c in calls))
            table.add(*_decode_cells(n, k, m, eager, graph))
        del dense_ws, sparse, peers
    return table


# Issue 62's shapes: Llama-3-8B's projections (q/o, k/v, gate/up, down) and Llama-3-70B's gate/up, N x K
INT4_WEIGHTS = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]
INT4_TOKENS = (1, 8, 16, 32, 64, 2048)


def int4_table(weights=INT4_WEIGHTS, tokens=INT4_TOKENS) -> Table:
    """The W4A16 2:4 layer (Int4Sparse24Linear, group 128) against cuBLAS bf16, the bf16 2:4
    layer and the FP8 2:4 layer (activations quantized per token), each a layer call replayed
    from one CUDA graph over as many weights as make 3x the L2 cache in the 4-bit layer's bytes
    (every variant read from HBM, as a decode step does)."""
    table = Table("2:4 semi-structured", "4-bit 2:4 (W4A16, group 128) layer against bf16 dense, bf16 2:4 and FP8 2:4", [
        ("weight N x K", ""), ("M", ""), ("dense graph ms", ".4f"), ("bf16 2:4", "x"), ("FP8 2:4", "x"),
        ("int4 2:4", "x"), ("int4 vs FP8 2:4", "x")],
        "ratios: dense time / the layer's (above 1 = faster); CUDA-graph replays, weights from HBM; int4 vs "
        "FP8 2:4: the FP8 layer's time / the int4 layer's")
    for n, k in weights:
        layers = _int4_peers(n, k)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                times = interleaved(*(lambda c=c: graph_ms([lambda layer=layer: layer(x) for layer in c]) for c in layers))
            ratios = [None if t is None or times[0] is None else times[0] / t for t in times[1:]]
            table.add(f"{n}x{k}", m, times[0], *ratios,
                      None if None in (times[2], times[3]) else times[2] / times[3])
        del layers
    return table


def _int4_peers(n: int, k: int) -> list[list]:
    """Per variant (dense, bf16 2:4, FP8 2:4, int4 2:4), layers of as many N x K weights as make
    3x the L2 cache in the 4-bit layer's bytes (so that none is served from L2)."""
    copies = hbm_copies(n, k)
    dense = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    fp8 = "e4m3" if torch.cuda.get_device_capability() >= (8, 9) else "int8"
    return [dense, [sparsegen.Sparse24Linear.from_dense(d) for d in dense],
            [sparsegen.ScaledSparse24Linear.from_dense(d, fp8) for d in dense],
            [sparsegen.Int4Sparse24Linear.from_dense(d) for d in dense]]


def _cusparselt_weight(dense_w: torch.Tensor, convert):
    from torch.sparse import SparseSemiStructuredTensor

    SparseSemiStructuredTensor._FORCE_CUTLASS = False
    try:
        return convert(dense_w)
    except Exception as error:
        print(f"  cuSPARSELt failed: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
        return None


def _decode_cells(n, k, m, eager, graph) -> list:
    def ratio(times, i):
        return None if times[i] is None else times[0] / times[i]
    met = graph[1] is not None and graph[0] / graph[1] >= 1.3 and (graph[2] is None or graph[1] < graph[2])
    return [f"{n}x{k}", m, eager[0], ratio(eager, 1), ratio(eager, 2), graph[0], ratio(graph, 1), ratio(graph, 2),
            "yes" if met else "NO"]


def deterministic_table(weights=DECODE_WEIGHTS[:3], tokens=(1, 16, 64, 128)) -> Table:
    """What torch.use_deterministic_algorithms(True) costs: 2:4 decode (split K, whose splits add
    in split order in either mode), timed as CUDA graphs over weights from HBM in both modes,
    beside dense."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    table = Table("Reliability", "Deterministic mode: 2:4 decode, bf16, CUDA graphs, weights read from HBM", [
        ("weight N x K", ""), ("M", ""), ("dense ms", ".4f"), ("default ms", ".4f"), ("deterministic ms", ".4f"),
        ("deterministic, no NaN fill ms", ".4f"), ("default vs dense", "x"), ("deterministic vs dense", "x"),
        ("deterministic time / default", ".2f")],
        "sparsegen launches the same kernels in both modes (split K adds its splits in a fixed order); "
        "this measures that, on the 2:4 decode products that split K. Deterministic mode's time includes "
        "what PyTorch adds there: it fills each new tensor (here Y) with NaN, unless "
        "torch.utils.deterministic.fill_uninitialized_memory is False (the 'no NaN fill' column).")
    for n, k in weights:
        dense_ws, sparse = decode_weights(n, k)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            dense = [lambda w=w: F.linear(x, w) for w in dense_ws]
            ours = [lambda s=s: sp24_ops.sp24_dds(x, s.values, s.metadata, None, n) for s in sparse]
            times = interleaved(lambda: graph_ms(dense), lambda: graph_ms(ours), lambda: _deterministic(graph_ms, ours),
                                lambda: _deterministic(graph_ms, ours, fill=False))
            table.add(f"{n}x{k}", m, *times, times[0] / times[1], times[0] / times[2], times[2] / times[1])
        del dense_ws, sparse
    return table


def _deterministic(fn, *args, fill=True):
    filled = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    try:
        return fn(*args)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = filled


def random_bytes(shape, dtype) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, device="cuda", dtype=torch.int8)
    return (torch.randn(shape, device="cuda") * 8).to(dtype)


def dense_byte_ms(x: torch.Tensor, w: torch.Tensor) -> float:
    """cuBLAS on the same one-byte operands: torch._int_mm (int32 out) or _scaled_mm (bf16 out)."""
    if x.dtype == torch.int8:
        return median_ms(lambda: torch._int_mm(x, w.t()))
    one = torch.ones((), device="cuda")
    return median_ms(lambda: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))


def byte_table(weights, tokens=(1024, 4096, 16384)) -> Table:
    """int8 and e4m3 2:4 (mma.sp m16n8k64) against dense cuBLAS on the same type and bf16."""
    table = Table("2:4 semi-structured", "One-byte 2:4 (int8, e4m3) against cuBLAS on the same type and on bf16", [
        ("dtype", ""), ("weight N x K", ""), ("M", ""), ("dense same-type ms", ".4f"), ("dense bf16 ms", ".4f"),
        ("sparsegen 2:4 ms", ".4f"), ("x same-type", "x"), ("x bf16", "x")])
    for dtype in (torch.int8, torch.float8_e4m3fn):
        for n, k in weights:
            w, w16 = random_bytes((n, k), dtype), torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            sparse = sparsegen.to_sparse24(w)
            for m in tokens:
                x, x16 = random_bytes((m, k), dtype), torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                same, bf16, ours = interleaved(lambda: dense_byte_ms(x, w), lambda: median_ms(lambda: F.linear(x16, w16)),
                                               lambda: median_ms(lambda: F.linear(x, sparse)))
                table.add(str(dtype)[6:], f"{n}x{k}", m, same, bf16, ours, same / ours, bf16 / ours)
    return table


def tune() -> None:
    """Time tile configurations and K splits of the sp24 kernel (bf16) against dense."""
    from sparsegen.jit.spec import TileConfig

    big = [(TileConfig(128, 4, 2, 3), None, "mma"), (TileConfig(256, 8, 1, 5), None, "tma"),
           (TileConfig(256, 8, 1, 4), None, "tma"), (TileConfig(256, 8, 1, 4, 2), None, "tma"),
           (TileConfig(256, 8, 1, 5, 2), None, "tma"), (TileConfig(256, 8, 1, 4, 4), None, "tma"),
           (TileConfig(128, 8, 1, 6), None, "tma"),
           (TileConfig(192, 8, 1, 5), None, "tma"), (TileConfig(128, 12, 1, 6), None, "tma"),
           (TileConfig(128, 16, 1, 5), None, "tma"), (TileConfig(192, 12, 1, 4), None, "tma")]
    small = [(TileConfig(64, 2, 2, 3), None, "mma"), (TileConfig(64, 2, 2, 3), 1, "mma"),
             (TileConfig(32, 2, 1, 4), None, "mma"), (TileConfig(128, 8, 1, 6), None, "tma"),
             (TileConfig(64, 8, 1, 6), None, "tma"), (TileConfig(128, 4, 1, 6), None, "tma"),
             (TileConfig(32, 8, 1, 6), None, "tma")]
    for (n, k), m in [((4096, 4096), 4096), ((11008, 4096), 16384), ((4096, 11008), 16384), ((8192, 8192), 16384),
                      ((8192, 8192), 4096), ((8192, 8192), 1024),
                      ((4096, 4096), 16), ((11008, 4096), 128), ((4096, 11008), 16), ((8192, 8192), 128)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        sparse, x = sparsegen.to_sparse24(w), torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        dense = median_ms(lambda: F.linear(x, w))
        for tile, splits, instr in (big if m > 256 else small):
            ms = median_ms(lambda: sp24_ops.sp24_dds(x, sparse.values, sparse.metadata, None, n, tile=tile,
                                                splits=splits, instr=instr))
            print(f"{n}x{k} M={m} {instr} {tile.tag} splits={splits}: {ms:.4f} ms, {dense / ms:.2f}x dense", flush=True)


def tune_fp8() -> None:
    """Tile configurations of the scaled e4m3 2:4 product on Llama-3-8B's prefill products
    (2048 tokens: q, k and v, o, gate+up, down) against torch._scaled_mm with the same
    row-wise scales: where issue 30's FP8 prefill target stands."""
    from quantized_dense import QuantizedDenseLinear
    from sparsegen.jit.spec import TileConfig

    tiles = [TileConfig(256, 8, 1, 4, 2), TileConfig(256, 8, 1, 4, 4), TileConfig(256, 8, 1, 4),
             TileConfig(192, 8, 1, 5, 2), TileConfig(128, 8, 1, 6, 2), TileConfig(128, 12, 1, 5),
             TileConfig(128, 16, 1, 4)]
    for n, k in ((4096, 4096), (1024, 4096), (28672, 4096), (4096, 14336)):
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        layer, dense = sparsegen.ScaledSparse24Linear.from_dense(linear, "e4m3"), QuantizedDenseLinear(linear, "e4m3")
        xq, x_scale = sp24_ops.sp24_quantize(torch.randn(2048, k, device="cuda", dtype=torch.bfloat16),
                                             torch.float8_e4m3fn)
        base = median_ms(lambda: torch._scaled_mm(xq, dense.weight.t(), scale_a=x_scale.unsqueeze(-1),
                                                  scale_b=dense.weight_scale.unsqueeze(0), out_dtype=torch.bfloat16))
        for tile in tiles:
            ms = median_ms(lambda: sp24_ops.sp24_scaled_dds(xq, layer.values, layer.metadata, x_scale,
                                                            layer.weight_scale, None, n, torch.bfloat16, tile=tile,
                                                            instr="tma"))
            print(f"{n}x{k} M=2048 {tile.tag}: {ms:.4f} ms, {base / ms:.2f}x _scaled_mm ({base:.4f} ms)", flush=True)


def tune_decode() -> None:
    """Per decode weight and token count: CUDA-graph time (weights from HBM, as in --decode)
    of tile configurations and K splits of the sp24 kernel, against dense."""
    from sparsegen.jit.spec import TileConfig

    tiles = {32: [TileConfig(32, 8, 1, 6), TileConfig(32, 4, 1, 8)],
             128: [TileConfig(64, 8, 1, 6), TileConfig(64, 4, 1, 8), TileConfig(128, 8, 1, 6)]}
    for n, k in DECODE_WEIGHTS:
        dense_ws, sparse = decode_weights(n, k)
        for m in (1, 16, 64, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            dense = graph_ms([lambda w=w: F.linear(x, w) for w in dense_ws])
            default = graph_ms([lambda s=s: sp24_ops.sp24_dds(x, s.values, s.metadata, None, n) for s in sparse])
            print(f"{n}x{k} M={m}: dense {dense:.4f} ms, default {dense / default:.2f}x", flush=True)
            for tile in tiles[32 if m <= 32 else 128]:
                for splits in (1, 2, 4, 8, 16):
                    try:
                        ms = graph_ms([lambda s=s: sp24_ops.sp24_dds(x, s.values, s.metadata, None, n, tile=tile,
                                                                 splits=splits, instr="tma") for s in sparse])
                    except Exception as error:
                        print(f"  {tile.tag} splits={splits}: {type(error).__name__}", flush=True)
                        continue
                    print(f"  {tile.tag} splits={splits}: {dense / ms:.2f}x", flush=True)


def plot_rows(table: Table) -> list[dict]:
    """The forward table's speedups, as plot() reads them."""
    return [dict(dtype=r[0], weight=r[1], m=r[2], ours=r[5], peer=r[6]) for r in table.rows]


def plot(rows: list[dict], path: Path) -> None:
    """Speedup over dense against tokens M, per weight shape: sparsegen and cuSPARSELt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    weights = list(dict.fromkeys(r["weight"] for r in rows))
    fig, axes = plt.subplots(1, len(weights), figsize=(4 * len(weights), 3.8), sharey=True)
    for ax, weight in zip(axes, weights):
        for dtype, style in (("bf16", "-"), ("fp16", "--")):
            sel = [r for r in rows if r["weight"] == weight and r["dtype"] == dtype]
            ax.plot([r["m"] for r in sel], [r["ours"] for r in sel], "o" + style, color="C0", label=f"sparsegen {dtype}")
            ax.plot([r["m"] for r in sel], [r["peer"] or float("nan") for r in sel], "s" + style, color="C1",
                    label=f"cuSPARSELt {dtype}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", yscale="log", title=f"weight {weight}", xlabel="tokens M", ylabel="x dense")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bf16, two weights")
    parser.add_argument("--json", type=Path, help="record the tables here (tools/benchmarks_md.py renders them)")
    parser.add_argument("--tune", action="store_true", help="time tile configurations instead")
    parser.add_argument("--plot", type=Path, help="write the forward's speedup plot (PNG) here")
    parser.add_argument("--bytes", action="store_true", help="int8 and e4m3 2:4 against dense cuBLAS instead")
    parser.add_argument("--decode", action="store_true", help="only the 1-128 token table (eager and CUDA graphs)")
    parser.add_argument("--train", action="store_true", help="only the fwd+bwd table (GPT-2 FFNs, one linear)")
    parser.add_argument("--tune-decode", action="store_true", help="time decode tiles and K splits instead")
    parser.add_argument("--tune-fp8", action="store_true", help="time e4m3 prefill tiles against _scaled_mm instead")
    parser.add_argument("--int4", action="store_true", help="only the 4-bit 2:4 (W4A16) layer table")
    parser.add_argument("--deterministic", action="store_true",
                        help="only the decode table in default and deterministic mode")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.tune_fp8:
        return tune_fp8()
    if args.tune_decode or args.tune:
        return tune_decode() if args.tune_decode else tune()
    modes = [(args.decode, decode_table), (args.train, train_table), (args.bytes, bytes_table),
             (args.deterministic, deterministic_table), (args.int4, int4_table)]
    tables = [make() for wanted, make in modes if wanted] or forward_tables(args)
    write(args.json, "bench24.py", argv, tables)


def bytes_table() -> Table:
    table = byte_table(WEIGHTS)
    weights = {str(d)[6:]: random_bytes((4096, 11008), d) for d in (torch.int8, torch.float8_e4m3fn)}
    prune = {name: median_ms(lambda: sparsegen.to_sparse24(w, "transposable")) for name, w in weights.items()}
    table.notes = ["to_sparse24(4096x11008 weight, 'transposable') on the GPU kernels: "
                   + ", ".join(f"{k} {v:.3f} ms" for k, v in prune.items())]
    return table


def forward_tables(args) -> list[Table]:
    """The 16-bit forward (with pruning costs and weight memory as notes), then training."""
    dtypes, weights = (["bf16"], WEIGHTS[1:3]) if args.quick else (list(DTYPES), WEIGHTS)
    table = forward_table(dtypes, weights, TOKENS)
    times = prune_compress_ms()
    w = torch.randn(11008, 4096, dtype=torch.bfloat16)
    table.notes = ["prune + compress a 4096x11008 bf16 weight on the GPU (sp24_mask / sp24_compress kernels): "
                   + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()),
                   f"weight memory / dense: {sparsegen.to_sparse24(w).nbytes() / (w.numel() * 2):.4f}"]
    if args.plot:
        plot(plot_rows(table), args.plot)
    return [table] if args.quick else [table, train_table()]


if __name__ == "__main__":
    main()
