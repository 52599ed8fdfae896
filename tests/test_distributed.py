"""Sparse models on more than one process: FSDP2 (MixedPrecisionPolicy, activation
checkpointing, per-layer torch.compile after sharding), DDP (no_sync, compiled),
torch.distributed.checkpoint (saved on 2 ranks, loaded back on 2 - also into a model built on
the meta device - on 1 and on 4) and tensor
parallelism (sparsegen.parallel's styles through parallelize_module, with sequence
parallelism too), each against a
twin in one process that sees every rank's batch (tests/distributed_worker.py says how).
On 2 GPUs with NCCL; on the CPU with gloo (no compile there: Inductor's C++ build of every
case would take minutes on the CI machine, and gloo moves no float8, so e4m3 runs on GPUs)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("distributed_worker.py")
TRAINABLE = ["bsr", "bsr-unfused", "2:4", "2:4-unfused", "2:4-recipe", "bdiag", "bell"]
SAVED = ["bsr", "2:4-recipe", "bell", "int8+2:4"]
BOTH = ([f"fsdp2:{v}" for v in ["dense", *TRAINABLE, "int8+2:4"]] + ["fsdp2-ckpt:bsr", "fsdp2-ckpt:2:4-recipe"]
        + [f"ddp:{v}" for v in [*TRAINABLE, "int8+2:4"]] + ["ddp-nosync:bsr", "ddp-nosync:2:4"]
        # (each rank built from a seed of its own: the one sync at construction makes them the first rank's)
        + [f"ddp-once:{v}" for v in ["bsr", "2:4-recipe", "bell", "int8+2:4"]]
        + [f"ddp-synced:{v}" for v in ["2:4-recipe", "bell", "scaled+bsr"]]
        + [f"dcp:{v}" for v in SAVED] + [f"dcp-meta:{v}" for v in SAVED]  # (loads what dcp saved)
        + [f"tp:{v}" for v in ["dense", "bsr", "bsr-unfused+bias", "2:4+bias", "2:4-unfused", "int8-mlp",
                               "int8-mlp-unfused+bias", "bell-colwise+bias"]]
        + [f"tpdcp:{v}" for v in ["2:4+bias", "2:4-unfused", "int8-mlp-unfused+bias", "bsr", "bell-colwise"]]
        + [f"sp:{v}" for v in ["dense", "2:4+bias", "bsr-unfused+bias", "bell-colwise", "int8-mlp-unfused+bias"]])
GPU_ONLY = (["fsdp2:scaled+bsr", "ddp:scaled+bsr", "ddp-once:scaled+bsr", "dcp:scaled+bsr"]
            + [f"fsdp2-compile:{v}" for v in ["dense", "bsr", "2:4", "2:4-recipe", "bell", "bdiag", "scaled+bsr"]]
            + ["fsdp2-compile-ckpt:bsr", "fsdp2-compile-ckpt:2:4-recipe"]
            + [f"ddp-compile:{v}" for v in ["bsr", "2:4", "bell", "bdiag"]] + ["ddp-once-compile:2:4-recipe"]
            + ["tp-compile:bsr", "tp-compile:2:4-unfused+bias", "tp-compile:bell-colwise+bias", "sp-compile:2:4+bias"])
# NVLink multicast off, as the GPU machines require (and harmless elsewhere)
ENV = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


def run_cases(cases: list[str], out: Path, timeout: int, reshard_ranks: int) -> None:
    """The cases on 2 ranks; then what 2 ranks saved, loaded in one process and (where
    reshard_ranks) on that many ranks."""
    run = subprocess.run(torchrun(2, "--cases", ",".join(cases), "--out", str(out)), env=ENV, capture_output=True,
                         text=True, timeout=timeout)
    assert_all_ok(run, cases, ranks=2)
    # (a tensor-parallel block-sparse model's state is refused, so nothing of it is saved)
    saved = [case for case in cases if case.startswith(("dcp:", "tpdcp:")) and case != "tpdcp:bsr"]
    one = subprocess.run([sys.executable, str(WORKER), "--load-one", "--cases", ",".join(saved), "--out",
                          str(out)], env=ENV, capture_output=True, text=True, timeout=timeout)
    assert_all_ok(one, saved, ranks=1)
    if reshard_ranks:
        more = subprocess.run(torchrun(reshard_ranks, "--load-sharded", "--cases", ",".join(saved), "--out", str(out)),
                              env=ENV, capture_output=True, text=True, timeout=timeout)
        assert_all_ok(more, saved, ranks=reshard_ranks)


def torchrun(ranks: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(WORKER),
            *args]


def assert_all_ok(run: subprocess.CompletedProcess, cases: list[str], ranks: int) -> None:
    failures = [line for line in run.stdout.splitlines() if line.startswith("FAIL")]
    # (the whole output: a failed case's traceback follows its FAIL line)
    assert run.returncode == 0 and not failures, "\n".join(failures) + "\n" + run.stdout[-30000:] + run.stderr[-3000:]
    missing = [case for case in cases if run.stdout.count(f"ok {case}\n") != ranks]
    assert not missing, f"no result from every rank for {missing}\n" + run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp2_ddp_and_checkpoints_on_two_gpus_match_one(tmp_path):
    """(Checkpoints reshard to 4 ranks where there are 4 GPUs: NCCL takes one rank per GPU.)"""
    run_cases(BOTH + GPU_ONLY, tmp_path, timeout=900, reshard_ranks=4 if torch.cuda.device_count() >= 4 else 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run (gloo); on a GPU machine the GPU test runs these")
def test_fsdp2_ddp_and_checkpoints_on_two_cpu_processes_match_one(tmp_path):
    run_cases(BOTH, tmp_path, timeout=600, reshard_ranks=4)
