"""Crossover tables (where the sparse kernels lose to cuBLAS) and the dense path's copies."""
import importlib
import json
import math

import pytest
import torch

from sparsegen import cli, env, tune
from sparsegen.jit import registry
from sparsegen.launch import crossovers, dense_path

H100 = "NVIDIA H100 80GB HBM3"


def point(layout="sp24", n=768, k=768, m=2048, speedup=0.8, **more):
    return dict(layout=layout, n=n, k=k, m=m, speedup=speedup, **more)


@pytest.fixture
def user_table(tmp_path, monkeypatch):
    """Write this GPU's user table (as `sparsegen tune` would) into a fresh cache directory."""
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPARSEGEN_DENSE_FALLBACK", "1")  # (the dense path is asked for)
    crossovers.reload()

    def write(points, gpu=H100):
        path = crossovers.user_table_path(gpu)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(gpu=gpu, points=points)))
        crossovers.reload()
        return path
    yield write
    crossovers.reload()


def test_file_names_are_plain():
    assert crossovers.file_name(H100) == "nvidia_h100_80gb_hbm3.json"
    assert crossovers.file_name("../../etc/passwd") == "etc_passwd.json"


def test_user_table_comes_before_the_packaged_one(user_table):
    user_table([point(speedup=1.5)])
    assert crossovers.table(H100)[0].speedup == 1.5
    assert not crossovers.dense_wins(H100, "sp24", 768, 768, 2048)


def test_packaged_tables_load_and_hold_their_layouts():
    tables = sorted(crossovers.PACKAGED.glob("*.json"))
    assert {t.name for t in tables} >= {"nvidia_h100_80gb_hbm3.json", "nvidia_h200.json"}
    for path in tables:
        points = crossovers.load(path)
        assert {p.layout for p in points} >= {"sp24", "bsr"}, path
        assert all(p.speedup > 0 and math.isfinite(p.speedup) for p in points)
    h100 = crossovers.load(crossovers.PACKAGED / "nvidia_h100_80gb_hbm3.json")
    assert shipped_tuned_layouts() <= {p.layout for p in h100} <= set(tune.NAMES)  # the target GPU: ours measured


def shipped_tuned_layouts() -> set[str]:
    """The tuning keys of sparsegen's own layouts (a plugin's come with no packaged points)."""
    ours = [importlib.import_module(layout.module(layout.faces_module)) for layout in registry.layouts()
            if layout.package is None and layout.faces_module]
    return {face.tuning.key for module in ours for face in module.FACES if face.tuning is not None}


def test_a_layout_the_packaged_tables_do_not_cover_has_no_points_and_runs_its_kernels():
    """A plugin's tuned layout (until someone tunes it on that GPU) finds no packaged points:
    no dense path is chosen for it, and nothing fails."""
    h100 = crossovers.table(H100)
    assert "band" not in {p.layout for p in h100} and h100
    assert crossovers.nearest(h100, "band", 4096, 4096, 16, (64, 64), 0.5) is None
    assert not crossovers.dense_wins(H100, "band", 4096, 4096, 16, (64, 64), 0.5)


def test_nearest_point_decides_in_log_space():
    points = tuple(crossovers._point(p) for p in [point(m=16, speedup=0.5), point(m=8192, speedup=1.4),
                                                   point(n=8192, k=8192, m=16, speedup=1.2)])
    assert crossovers.nearest(points, "sp24", 768, 768, 32).speedup == 0.5
    assert crossovers.nearest(points, "sp24", 1024, 768, 4096).speedup == 1.4
    assert crossovers.nearest(points, "sp24", 6000, 9000, 8).speedup == 1.2
    assert crossovers.nearest(points, "bsr", 768, 768, 32, (64, 64), 0.5) is None


def test_block_sparse_points_match_block_then_nearest_density():
    points = tuple(crossovers._point(point("bsr", block=[64, 64], density=d, speedup=s))
                   for d, s in [(0.25, 1.6), (0.5, 0.9)])
    assert crossovers.nearest(points, "bsr", 768, 768, 2048, (64, 64), 0.3).speedup == 1.6
    assert crossovers.nearest(points, "bsr", 768, 768, 2048, (64, 64), 0.45).speedup == 0.9
    assert crossovers.nearest(points, "bsr", 768, 768, 2048, (32, 32), 0.45) is None


def test_a_point_carries_to_other_densities_by_the_blocks_read(user_table):
    # block 32 measured at d 0.25 only: 0.85x there means about 2.1x at d 0.1 (H100: 1.89x)
    user_table([point("bsr", n=11008, k=4096, m=8192, block=[32, 32], density=0.25, speedup=0.85)])
    assert crossovers.dense_wins(H100, "bsr", 11008, 4096, 8192, (32, 32), 0.25)
    assert crossovers.dense_wins(H100, "bsr", 11008, 4096, 8192, (32, 32), 0.5)
    assert not crossovers.dense_wins(H100, "bsr", 11008, 4096, 8192, (32, 32), 0.1)
    assert crossovers.expected_speedup(crossovers.table(H100)[0], 0.1) == pytest.approx(2.125)


@pytest.mark.parametrize("text", ["not json", json.dumps({"gpu": H100}), json.dumps({"points": [1]}),
                                  json.dumps({"points": [point(speedup=-1)]}),
                                  json.dumps({"points": [point(speedup="nan")]}),
                                  json.dumps({"points": [point(layout="__import__('os')")]}),
                                  json.dumps({"points": [point(m=0)]}),
                                  json.dumps({"points": [point("bsr", block=[64], density=0.5)]}),
                                  json.dumps({"points": [point("bsr", block=[64, 64], density=2)]})])
def test_a_damaged_table_counts_as_none_with_a_warning(user_table, text):
    path = user_table([])
    path.write_text(text)
    crossovers.reload()
    with pytest.warns(RuntimeWarning, match="ignoring the crossover table"):
        assert crossovers.table(H100) == ()
    assert not crossovers.dense_wins(H100, "sp24", 768, 768, 2048)


def test_dense_path_wanted_follows_the_table_the_switch_and_the_variable(user_table, monkeypatch):
    user_table([point(speedup=0.7)])
    monkeypatch.setattr("sparsegen.launch.runtime.device_name", lambda index: H100)
    assert dense_path.wanted("sp24", 0, 768, 768, 2048)
    with dense_path.disabled():
        assert not dense_path.wanted("sp24", 0, 768, 768, 2048)
    monkeypatch.setenv("SPARSEGEN_DENSE_FALLBACK", "0")
    assert not env.dense_fallback() and not dense_path.wanted("sp24", 0, 768, 768, 2048)
    monkeypatch.delenv("SPARSEGEN_DENSE_FALLBACK")  # off unless asked for: no hidden dense copy
    assert not env.dense_fallback() and not dense_path.wanted("sp24", 0, 768, 768, 2048)


def test_dense_copy_is_kept_while_the_weight_stays_and_dropped_once_it_trains():
    key, values = torch.zeros(3), torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    builds = []

    def build():
        builds.append(1)
        return values.clone() * 2

    first = dense_path.copy_of(key, values, build)
    assert dense_path.copy_of(key, values, build) is first and len(builds) == 1
    assert dense_path.held_bytes() >= first.numel() * 4
    values.add_(1)  # loaded weights: rebuilt once, and right
    torch.testing.assert_close(dense_path.copy_of(key, values, build), values * 2)
    for _ in range(dense_path.TRAINED_AFTER):  # trained: no copy any more
        values.add_(1)
        last = dense_path.copy_of(key, values, build)
    assert last is None and dense_path.copy_of(key, values, build) is None
    assert len(builds) == dense_path.TRAINED_AFTER


def test_no_dense_copy_of_a_temporary():
    """A per-call cast (autocast) can reuse its address and version with new contents."""
    assert dense_path.copy_of(torch.zeros(3), torch.randn(4, 4), lambda: torch.zeros(4, 4)) is None


def test_tune_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["tune", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_tune_names_an_unknown_layout(capsys):
    assert cli.main(["tune", "--layout", "bell", "--layout", "csr"]) != 0
    err = capsys.readouterr().err
    assert f"layouts among {tune.NAMES}" in err and "csr" in err
    assert set(tune.NAMES) == {"sp24", "bsr", "bell", "bdiag"}  # (every shipped layout's face is tuned)
