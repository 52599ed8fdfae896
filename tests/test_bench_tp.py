"""tools/bench_tp.py on the CPU (2 gloo processes, tiny shapes): the tensor-parallel benchmark
runs its sparse and dense twins under one plan, eager and compiled (each variant timed in
rounds with a dense twin), and records each row as it is measured."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_records_a_row_per_case_and_mode(tmp_path):
    out = tmp_path / "tp.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tools")]))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(ROOT / "tools" / "bench_tp.py"), "--smoke", "--cases", "llama_decode1",
                          "--modes", "eager,compile", "--variants", "dense,2:4,b64d0.5", "--json", str(out),
                          "--reps", "2", "--rounds", "3",
                          "--profile", "llama_decode1:2:4:eager"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    recorded = json.loads(out.read_text())
    assert recorded["meta"]["command"].startswith("PYTHONPATH=. torchrun --nproc_per_node=2 tools/bench_tp.py")
    table, = recorded["tables"]
    assert [c[0] for c in table["columns"]][3:] == ["2:4", "b64d0.5"]
    assert [row[1] for row in table["rows"]] == ["eager", "compile"]
    for name, mode, dense_ms, *speedups in table["rows"]:
        assert dense_ms > 0 and len(speedups) == 2 and all(s > 0 for s in speedups), (mode, speedups)
    # the profiled cell's header (the CPU has no kernels to list)
    assert "decode 1 seq, 16-token KV cache, 2:4, eager:" in run.stdout, run.stdout[-3000:]
