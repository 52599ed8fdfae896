"""Time the 4-bit 2:4 kernel's decode tiles and K splits against cuBLAS bf16 (CUDA-graph
replays over weights 3x the L2 cache, as bench24.py --int4 times layers): which sp24_w4
configuration reads the weight fastest at 1-64 tokens. GPU: PYTHONPATH=. python tools/probe_int4.py"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench24 import graph_ms  # noqa: E402
from sparsegen.jit.spec import TileConfig  # noqa: E402
from sparsegen.semi24.int4_nn import Int4Sparse24Linear, sp24_w4  # noqa: E402

TILES = [None, TileConfig(16, 4, 1, 6), TileConfig(16, 2, 1, 8), TileConfig(32, 4, 1, 5),
         TileConfig(16, 8, 1, 4), TileConfig(64, 4, 2, 4)]
SPLITS = (None, 2, 4, 8, 16, 32)


def main(weights=((4096, 4096), (14336, 4096), (4096, 14336)), tokens=(1, 16, 64)) -> None:
    for n, k in weights:
        copies = max(2, -(-3 * torch.cuda.get_device_properties(0).L2_cache_size // (2 * n * k)))
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        layers = [Int4Sparse24Linear.from_dense(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
                  for _ in range(copies)]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = graph_ms([lambda w=w: F.linear(x, w) for w in dense])
            rows = []
            for tile in TILES:
                for splits in SPLITS:
                    try:
                        t = graph_ms([lambda q=q, tile=tile, splits=splits: sp24_w4(
                            x, q.qweight, q.metadata, q.scales, None, q.group_size, n, splits=splits, tile=tile)
                            for q in layers])
                    except Exception as error:
                        print(f"  {tile} {splits}: {type(error).__name__}: {str(error)[:100]}")
                        continue
                    rows.append((base / t if t else 0.0, tile.tag if tile else "default", str(splits)))
            rows.sort(reverse=True)
            print(f"{n}x{k} M {m}: dense {base * 1000:.1f} us; best " + "; ".join(
                f"{tag} s{splits} {r:.2f}x" for r, tag, splits in rows[:6]) + " | default auto " +
                f"{next(r for r, tag, s in rows if tag == 'default' and s == 'None'):.2f}x", flush=True)


if __name__ == "__main__":
    main()
