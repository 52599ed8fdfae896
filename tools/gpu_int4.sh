#!/usr/bin/env bash
# Issue 62's GPU work in one call: the 4-bit 2:4 GPU tests, the layer table (bench24.py --int4:
# 1-64 and 2048 tokens) and the decode tile probe. Logs and results under $OUT.
# Usage: SPARSEGEN_COMMIT=<hash> tools/gpu_int4.sh (INT4_TEST_TIMEOUT, INT4_BENCH_TIMEOUT, SKIP_PROBE)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/results"
source tools/device_env.sh
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout ${INT4_TEST_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/test_gpu_int4.py 2>&1 | tail -25 | tee "$OUT/int4_tests.log"
SPARSEGEN_CACHE_DIR=/tmp/sgb timeout ${INT4_BENCH_TIMEOUT:-240} python3 tools/bench24.py --int4 \
  --json "$OUT/results/32_int4.json" 2>&1 | grep "^|" | tee "$OUT/int4_bench.log"
[ -n "${SKIP_PROBE:-}" ] || timeout 200 python3 tools/probe_int4.py 2>&1 | grep -v "Warn\|capture failed" | tee "$OUT/probe.log"
