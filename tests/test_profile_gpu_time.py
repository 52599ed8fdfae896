"""tools/profile_gpu_time.py's kernel lists (the GPU tool and bench_tp --profile print them),
from a stand-in for torch.profiler's events: per-step GPU ms and launches of each kernel."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import profile_gpu_time  # noqa: E402


def fake_profile(kernels_of_events: list[list[tuple[str, float]]]):
    events = [SimpleNamespace(kernels=[SimpleNamespace(name=name, duration=us) for name, us in kernels])
              for kernels in kernels_of_events]
    return SimpleNamespace(events=lambda: events)


def test_kernels_per_step_sums_each_kernels_time_and_launches_over_the_steps(capsys):
    long_name = "sp24_dds_" + "x" * 200
    prof = fake_profile([[("gemm", 300.0), (long_name, 50.0)], [("gemm", 100.0)], [(long_name, 70.0)]])
    kernels, launches = profile_gpu_time.kernels_per_step(prof, steps=2)
    cut = long_name[:profile_gpu_time.NAME_WIDTH]
    assert kernels.keys() == {"gemm", cut} and launches == {"gemm": 1.0, cut: 1.0}
    assert abs(kernels["gemm"] - 0.2) < 1e-12 and abs(kernels[cut] - 0.06) < 1e-12
    profile_gpu_time.print_top_kernels("case", kernels, launches, top=1)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == ["case: 0.260 GPU ms and 2 launches per step; top kernels (GPU ms, launches per step)",
                     "     0.200     1  gemm"]


@pytest.mark.parametrize("kernel, kind", [
    ("sp24_dds_b16x32_bf16_nt_sm90a_tma_t32w8x1s6_eswiglu", "sparsegen"),
    ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", "GEMM"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16", "attention"),
    # Inductor's kernels are named after the ops they fuse, ours among them: still Inductor's
    ("triton_poi_fused__to_copy_add_arange_embedding_index_copy_mean_sp24_dds_transpose_view_3", "Triton (Inductor)"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_cat_clone", "Triton (Inductor)")])
def test_kernels_are_told_apart_by_name(kernel, kind):
    assert profile_gpu_time.kind_of(kernel) == kind
