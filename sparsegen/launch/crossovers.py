"""Where the sparse kernels beat dense, per GPU: measured speedups that pick each call's path.

A table holds points (layout, N, K, M tokens) -> speedup of the sparse kernel over cuBLAS
on the same weight made dense, measured side by side on one GPU. `sparsegen tune`
(sparsegen/tune.py) measures them on the local GPU into the cache directory; tables for
the H100 and the H200 ship in sparsegen/launch/crossover_tables/. A call takes the dense path
where the table's nearest point says the sparse kernel loses (ops.py).

Tables are JSON, read with json and checked field by field: nothing in one is run.
"""
from __future__ import annotations

import functools
import os
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import plans
from .. import env
from ..jit import private_files, trust

PACKAGED = Path(__file__).parent / "crossover_tables"
LOSES_BELOW = 1.0  # the sparse kernel's speedup under which the dense path runs
LAYOUT_NAME = re.compile(r"[a-z][a-z0-9]{0,15}")  # a table names layouts; it knows none of them


@dataclass(frozen=True)
class Point:
    layout: str            # the caller's name for its kernels ("sp24", "bsr"): a lowercase word
    n: int                 # out_features
    k: int                 # in_features
    m: int                 # tokens
    speedup: float         # dense time / sparse time
    block: tuple[int, int] = (0, 0)  # (0, 0): a layout without blocks
    density: float = 1.0


def file_name(gpu_name: str) -> str:
    """The table's file name for a GPU ("NVIDIA H100 80GB HBM3" -> nvidia_h100_80gb_hbm3.json)."""
    return re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_") + ".json"


def user_table_path(gpu_name: str) -> Path:
    return env.cache_dir() / "crossovers" / file_name(gpu_name)


@functools.lru_cache(maxsize=None)
def table(gpu_name: str) -> tuple[Point, ...]:
    """The measured points for this GPU: the user's `sparsegen tune` table, else the packaged
    one, else none (every call then takes the sparse kernels)."""
    user = user_table_path(gpu_name)
    if os.path.lexists(user):
        return load(user, check_trust=True)
    packaged = PACKAGED / file_name(gpu_name)
    return load(packaged) if packaged.is_file() else ()


def reload() -> None:
    """Read the tables again at the next call (a new one was written), and plan every call
    again: plans hold the dense-path decision taken from the table."""
    table.cache_clear()
    plans.forget_all()


def load(path: Path, check_trust: bool = False) -> tuple[Point, ...]:
    """A table file's points; a damaged file counts as none, with one warning. One in the
    cache directory (check_trust) is read only if trust.py trusts it: one it does not trust
    counts as none too, with a warning saying why (a table only steers kernel choice, so it
    must never stop a model from running)."""
    try:
        raw = trust.read_file(path) if check_trust else private_files.read_regular(path, trust.MAX_READ_BYTES,
                                                                                     follow_links=True)
        return tuple(_point(p) for p in private_files.parse_json(raw)["points"])
    except (OSError, ValueError, KeyError, TypeError, trust.UntrustedPathError) as error:
        warnings.warn(f"sparsegen: ignoring the crossover table {path} ({error}); run `sparsegen tune` "
                      "to measure a new one", RuntimeWarning, stacklevel=3)
        return ()


def _point(raw: dict) -> Point:
    """One point, every field checked (ValueError / TypeError / KeyError when not as written)."""
    sizes = [int(raw[f]) for f in ("n", "k", "m")]
    speedup, density = float(raw["speedup"]), float(raw.get("density", 1.0))
    block = tuple(int(b) for b in raw.get("block", (0, 0)))
    if (not LAYOUT_NAME.fullmatch(str(raw["layout"])) or min(sizes) < 1 or not math.isfinite(speedup)
            or speedup <= 0 or not 0 < density <= 1 or len(block) != 2):
        raise ValueError(f"a point of a lowercase layout name, positive sizes and speedup, density in (0, 1]: {raw}")
    return Point(raw["layout"], *sizes, speedup, block, density)


def as_json(point: Point) -> dict:
    row = dict(layout=point.layout, n=point.n, k=point.k, m=point.m, speedup=round(point.speedup, 4))
    if point.block != (0, 0):
        row.update(block=list(point.block), density=round(point.density, 4))
    return row


def nearest(points, layout: str, n: int, k: int, m: int, block=(0, 0), density: float = 1.0) -> Point | None:
    """The measured point of this layout (and block) closest in log N, log K, log M and
    density; None where the table has none."""
    same = [p for p in points if p.layout == layout and p.block == tuple(block)]
    if not same:
        return None

    def distance(p: Point) -> float:
        logs = (math.log(p.n / n), math.log(p.k / k), math.log(p.m / max(m, 1)))
        return sum(d * d for d in logs) + (4 * (p.density - density)) ** 2

    return min(same, key=distance)


def expected_speedup(point: Point, density: float) -> float:
    """The point's speedup carried to this density: the kernel's time follows the blocks it
    reads, cuBLAS's does not. (An H100 table measured block 32 at d 0.25 only, 0.85x; taken
    as it was, d 0.1 ran cuBLAS at 1.16x where the kernel ran 1.89x, 2.12x at 3374e47.)"""
    return point.speedup * point.density / density


def dense_wins(gpu_name: str, layout: str, n: int, k: int, m: int, block=(0, 0), density: float = 1.0) -> bool:
    """Whether this GPU's table says cuBLAS on the dense weight beats the sparse kernel here."""
    point = nearest(table(gpu_name), layout, n, k, m, block, density)
    return point is not None and expected_speedup(point, density) < LOSES_BELOW
