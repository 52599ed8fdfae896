"""DDP and FSDP2 on 2 GPUs (skipped with fewer): gradients equal a single-process run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_and_fsdp2_match_single_process():
    worker = Path(__file__).with_name("distributed_worker.py")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(worker)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("worst relative gradient error") == 2
