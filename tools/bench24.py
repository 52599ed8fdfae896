"""2:4 semi-structured benchmark: sparsegen's mma.sp kernel vs dense cuBLAS vs PyTorch's
to_sparse_semi_structured (cuSPARSELt, eager F.linear), side by side in one process.

GPU: PYTHONPATH=. python tools/bench24.py [--quick] [--markdown out.md] [--plot out.png]
Plot a table again, no GPU: python tools/bench24.py --replot out.md --plot out.png
Ratios are dense time / method time (above 1 = faster than dense).
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import sparsegen  # noqa: E402
from bench import interleaved, median_ms  # noqa: E402
from sparsegen import ops  # noqa: E402

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


def forward_rows(dtype_names, weights, tokens) -> list[str]:
    rows = []
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
                    lambda: median_ms(lambda: ops.sp24_dds(x, sparse.values, sparse.metadata, None, n)),
                    lambda: cusparselt_ms(dense_w, x))
                target = 1.15 if m >= 1024 else 0.9
                ok = ours <= dense / target and (peer is None or ours < peer or m < 1024)
                rows.append(f"| {name} | {n}x{k} | {m} | {dense:.4f} | {ours:.4f} | {dense / ours:.2f} | "
                            f"{'-' if peer is None else f'{dense / peer:.2f}'} | {target} | {'yes' if ok else 'NO'} |")
                print(rows[-1], flush=True)
    return ["| dtype | weight N x K | M | dense ms | sparsegen ms | sparsegen x dense | cuSPARSELt x dense "
            "| target | met |", "|---|---|---|---|---|---|---|---|---|"] + rows


def prune_compress_ms(n: int = 4096, k: int = 11008) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return {method: median_ms(lambda: sparsegen.to_sparse24(w, method)) for method in ("magnitude", "transposable", "mvue")}


def training_row(m: int = 8192, k: int = 4096, n: int = 11008) -> list[str]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dense = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = sparsegen.Sparse24Linear.from_dense(dense)
    trained = sparsegen.Sparse24TrainingLinear.from_dense(dense)
    sparse_dw = sparsegen.Sparse24TrainingLinear.from_dense(dense, dw_sparse=True)
    step = lambda model: lambda: median_ms(lambda: model(x).backward(dy))  # noqa: E731
    dense_ms, ours, pretrain, mvue = interleaved(*(step(model) for model in (dense, layer, trained, sparse_dw)))
    return [f"- fwd+bwd of one linear ({m}, {k}, {n}), bf16: dense {dense_ms:.3f} ms; Sparse24Linear "
            f"(fixed mask, values trained) {ours:.3f} ms ({dense_ms / ours:.2f}x dense); "
            f"Sparse24TrainingLinear (2by4 recipe, transposable mask) {pretrain:.3f} ms ({dense_ms / pretrain:.2f}x dense); "
            f"the same with dw_sparse=True (MVUE dY, dW on the 2:4 kernel) {mvue:.3f} ms ({dense_ms / mvue:.2f}x dense)"]


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


def byte_rows(weights, tokens=(1024, 4096, 16384)) -> list[str]:
    """int8 and e4m3 2:4 (mma.sp m16n8k64) against dense cuBLAS on the same type and bf16."""
    rows = []
    for dtype in (torch.int8, torch.float8_e4m3fn):
        for n, k in weights:
            w, w16 = random_bytes((n, k), dtype), torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            sparse = sparsegen.to_sparse24(w)
            for m in tokens:
                x, x16 = random_bytes((m, k), dtype), torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                same, bf16, ours = interleaved(lambda: dense_byte_ms(x, w), lambda: median_ms(lambda: F.linear(x16, w16)),
                                               lambda: median_ms(lambda: F.linear(x, sparse)))
                rows.append(f"| {str(dtype)[6:]} | {n}x{k} | {m} | {same:.4f} | {bf16:.4f} | {ours:.4f} | "
                            f"{same / ours:.2f} | {bf16 / ours:.2f} |")
                print(rows[-1], flush=True)
    return ["| dtype | weight N x K | M | dense same-type ms | dense bf16 ms | sparsegen 2:4 ms | x same-type "
            "| x bf16 |", "|---|---|---|---|---|---|---|---|"] + rows


def tune() -> None:
    """Time tile configurations and K splits of the sp24 kernel (bf16) against dense."""
    from sparsegen.spec import TileConfig

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
            ms = median_ms(lambda: ops.sp24_dds(x, sparse.values, sparse.metadata, None, n, tile=tile,
                                                splits=splits, instr=instr))
            print(f"{n}x{k} M={m} {instr} {tile.tag} splits={splits}: {ms:.4f} ms, {dense / ms:.2f}x dense", flush=True)


def table_rows(markdown: str) -> list[dict]:
    """The forward table of a markdown file this script wrote, as dicts."""
    rows = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 9 and cells[0] in DTYPES:
            rows.append(dict(dtype=cells[0], weight=cells[1], m=int(cells[2]), ours=float(cells[5]),
                             peer=None if cells[6] == "-" else float(cells[6])))
    return rows


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
    parser.add_argument("--markdown", type=Path, help="write the section here")
    parser.add_argument("--tune", action="store_true", help="time tile configurations instead")
    parser.add_argument("--plot", type=Path, help="write the speedup plot (PNG) here")
    parser.add_argument("--replot", type=Path, help="only plot the table of this markdown file (no GPU)")
    parser.add_argument("--bytes", action="store_true", help="int8 and e4m3 2:4 against dense cuBLAS instead")
    args = parser.parse_args(argv)
    if args.bytes:
        weights = {str(d)[6:]: random_bytes((4096, 11008), d) for d in (torch.int8, torch.float8_e4m3fn)}
        prune = {name: median_ms(lambda: sparsegen.to_sparse24(w, "transposable")) for name, w in weights.items()}
        return print("\n".join([f"GPU: {torch.cuda.get_device_name()} - date: {datetime.date.today()} - "
                                "command: `python tools/bench24.py --bytes`\n"] + byte_rows(WEIGHTS) +
                                ["", "- to_sparse24(4096x11008 weight, 'transposable') on the GPU kernels: " + ", ".join(f"{k} {v:.3f} ms" for k, v in prune.items())]))
    if args.replot:
        return plot(table_rows(args.replot.read_text()), args.plot or Path("BENCHMARKS-2to4.png"))
    if args.tune:
        return tune()
    dtypes, weights = (["bf16"], WEIGHTS[1:3]) if args.quick else (list(DTYPES), WEIGHTS)
    lines = [f"GPU: {torch.cuda.get_device_name()} - date: {datetime.date.today()} - torch {torch.__version__} "
             f"- command: `python tools/bench24.py{' --quick' if args.quick else ''}`\n"]
    lines += forward_rows(dtypes, weights, TOKENS)
    times = prune_compress_ms()
    lines += ["", "- prune + compress a 4096x11008 bf16 weight on the GPU (sp24_mask / sp24_compress kernels): " +
              ", ".join(f"{k} {v:.3f} ms" for k, v in times.items())]
    lines += training_row()
    w = torch.randn(11008, 4096, dtype=torch.bfloat16)
    lines.append(f"- weight memory / dense: {sparsegen.to_sparse24(w).nbytes() / (w.numel() * 2):.4f}")
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    if args.plot:
        plot(table_rows("\n".join(lines)), args.plot)


if __name__ == "__main__":
    main()
