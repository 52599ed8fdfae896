"""Time the 4-bit 2:4 kernel's decode tiles, k-warps and K splits against cuBLAS bf16 (CUDA-graph
replays over weights 3x the L2 cache in the 4-bit layer's bytes, as bench24.py --int4 times
layers): which sp24_w4 configuration reads the weight fastest at 1-64 tokens.
GPU: PYTHONPATH=. python tools/probe_int4.py [--quick] [--weights 28672x4096,6144x4096] [--tokens 1,8,16]"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench24 import graph_ms, hbm_copies  # noqa: E402
from sparsegen.jit.spec import TileConfig  # noqa: E402
from sparsegen.semi24.int4_nn import Int4Sparse24Linear, sp24_w4  # noqa: E402

# (tile, k-warps): a block's W rows are 64 x warps_m, its tokens tile_m, its warps warps_m x
# warps_n x k-warps (k-warps of the same rows and tokens share each stage's instruction steps)
CONFIGS = [(None, None), (TileConfig(8, 4, 1, 6), 1), (TileConfig(8, 4, 1, 5), 1), (TileConfig(8, 4, 1, 6), 2),
           (TileConfig(8, 2, 1, 8), 2), (TileConfig(8, 4, 1, 3), 2), (TileConfig(8, 4, 1, 4), 2), (TileConfig(8, 2, 1, 4), 2), (TileConfig(16, 4, 1, 6), 1), (TileConfig(16, 4, 1, 6), 2), (TileConfig(16, 4, 1, 4), 2),
           (TileConfig(16, 2, 1, 6), 2), (TileConfig(16, 2, 1, 8), 2), (TileConfig(16, 4, 1, 3), 1),
           (TileConfig(32, 4, 1, 5), 2), (TileConfig(32, 4, 1, 4), 2), (TileConfig(32, 2, 1, 6), 2),
           (TileConfig(64, 4, 2, 4), 1), (TileConfig(64, 2, 2, 4), 2)]
SPLITS = (None, 2, 4, 8)


def label(tile, kwarps) -> str:
    return "default" if tile is None else f"{tile.tag}k{kwarps}"


def fits(tile, m: int) -> bool:
    return tile is None or m <= tile.tile_m <= max(16, 2 * m)


def main(weights=((28672, 8192), (14336, 4096), (4096, 14336), (4096, 4096)), tokens=(1, 16, 32, 64)) -> None:
    for n, k in weights:
        copies = hbm_copies(n, k)
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, copies // 5))]
        layers = [Int4Sparse24Linear.from_dense(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
                  for _ in range(copies)]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = graph_ms([lambda w=w: F.linear(x, w) for w in dense])
            rows = [_timed(base, x, layers, n, tile, kwarps, splits)
                    for tile, kwarps in CONFIGS if fits(tile, m) for splits in SPLITS]
            rows = sorted(r for r in rows if r)[::-1]
            auto = next((r for r, tag, s in rows if tag == "default" and s == "None"), 0.0)
            with torch.no_grad():  # (the layer's own forward, as bench24.py --int4 times it, beside the raw op's)
                layer = graph_ms([lambda q=q: q(x) for q in layers])
            print(f"{n}x{k} M {m}: dense {base * 1000:.1f} us; best " + "; ".join(
                f"{tag} s{splits} {r:.2f}x" for r, tag, splits in rows[:6]) + f" | default auto {auto:.2f}x"
                f" | layer forward {base / layer if layer else 0.0:.2f}x", flush=True)
        del dense, layers


def _timed(base, x, layers, n, tile, kwarps, splits):
    try:
        t = graph_ms([lambda q=q: sp24_w4(x, q.qweight, q.metadata, q.scales, None, q.group_size, n, splits=splits,
                                          tile=tile, kwarps=kwarps) for q in layers])
    except Exception as error:
        print(f"  {label(tile, kwarps)} {splits}: {type(error).__name__}: {str(error)[:100]}")
        return None
    return (base / t if t else 0.0, label(tile, kwarps), str(splits))


def _option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


if __name__ == "__main__":
    shapes = _option("--weights", "28672x8192,14336x4096,4096x14336,4096x4096")
    tokens = _option("--tokens", "1,16" if "--quick" in sys.argv else "1,16,32,64")
    main(tuple(tuple(int(d) for d in shape.split("x")) for shape in shapes.split(",")),
         tuple(int(m) for m in tokens.split(",")))
