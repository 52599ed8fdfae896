"""tools/bench_distributed.py's timing on the CPU: rounds rotate which variant goes first, and a
speedup is the median of the rounds' own dense/variant ratios (a slow round moves neither)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_distributed  # noqa: E402


def test_each_round_starts_with_the_next_variant():
    names = ["dense", "b64d0.25", "2:4t-mlp"]
    orders = [bench_distributed.bench_models.in_turn(names, r) for r in range(4)]  # (bench_models' rounds too)
    assert [order[0] for order in orders] == ["dense", "b64d0.25", "2:4t-mlp", "dense"]
    assert all(sorted(order) == sorted(names) for order in orders)


def test_speedup_is_the_median_of_each_rounds_ratio():
    # the host drifts between rounds: each round's ratio is 2, 2 and 1 (a hiccup in the last),
    # while the medians over every step give 12 / 10 = 1.2x
    rounds = [{"dense": [10.0, 10.0], "sparse": [5.0, 5.0]}, {"dense": [20.0, 20.0], "sparse": [10.0, 10.0]},
              {"dense": [12.0, 12.0], "sparse": [12.0, 12.0]}]
    ms, speedups = bench_distributed.medians_and_speedups(rounds, ["dense", "sparse"])
    assert ms == {"dense": 12.0, "sparse": 10.0}
    assert speedups == {"dense": 1.0, "sparse": 2.0}


def test_spread_lists_each_rounds_speedup_lowest_first():
    rounds = [{"dense": [10.0], "a": [8.0], "b": [10.0]}, {"dense": [10.0], "a": [12.5], "b": [5.0]}]
    assert bench_distributed.spread(rounds, ["dense", "a", "b"]) == "a 0.80 1.25; b 1.00 2.00"


def test_a_row_gives_each_variants_median_and_the_middle_half_of_its_rounds():
    # sparse's rounds: 0.5, 1, 2, 4 and 8 (dense 10 ms a step throughout)
    rounds = [{"dense": [10.0, 10.0], "sparse": [10.0 / x, 10.0 / x]} for x in (4.0, 0.5, 8.0, 1.0, 2.0)]
    row = bench_distributed.table_row("ddp", "eager", rounds, ["dense", "sparse"])
    assert row[:4] == ["ddp", "eager", 10.0, 2.0]
    assert row[4] == "0.75-6.00"  # statistics.quantiles' exclusive quartiles of 0.5, 1, 2, 4, 8


def test_one_round_has_no_middle_half():
    rounds = [{"dense": [10.0, 10.0], "sparse": [5.0, 5.0]}]
    assert bench_distributed.table_row("one", "eager", rounds, ["dense", "sparse"])[3:] == [2.0, "-"]
