#!/usr/bin/env bash
# Issue 62's GPU work in one call: the 4-bit 2:4 GPU tests, the layer table (bench24.py --int4:
# 1-64 and 2048 tokens) and the decode tile probe. Logs and results under $OUT.
# Usage: SPARSEGEN_COMMIT=<hash> tools/gpu_int4.sh (INT4_TEST_TIMEOUT, INT4_BENCH_TIMEOUT, SKIP_TESTS,
# INT4_TESTS (the test files: tests/test_gpu_int4.py), SKIP_BENCH, PROBE_ARGS, PROBE_TIMEOUT, SKIP_PROBE;
# NCU=1: Nsight Compute's view of the decode kernel on four shapes, M K N; MODELS=1: whole-model
# decode 8 / 32 in CUDA graphs at all 32 Llama-3-8B layers, and generate() with 4-bit 2:4; PROFILE=1: GPU time
# by kernel kind of a 32-layer decode step (PROFILE_CASE, default llama8b32_decode8), compiled, dense / 2:4 / FP8 / 4-bit;
# COMPILE=1: the 4-layer decode 8 / 32 under plain torch.compile, dense / FP8 2:4 / 4-bit 2:4)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/results"
source tools/device_env.sh
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
[ -n "${SKIP_TESTS:-}" ] || timeout ${INT4_TEST_TIMEOUT:-150} python3 -m pytest -q -m gpu -rfE ${INT4_TESTS:-tests/test_gpu_int4.py} \
  2>&1 | tail -25 | tee "$OUT/int4_tests.log"
[ -n "${SKIP_BENCH:-}" ] || SPARSEGEN_CACHE_DIR=/tmp/sgb timeout ${INT4_BENCH_TIMEOUT:-240} python3 tools/bench24.py --int4 \
  --json "$OUT/results/32_int4.json" 2>&1 | grep "^|" | tee "$OUT/int4_bench.log"
[ -n "${SKIP_PROBE:-}" ] || timeout ${PROBE_TIMEOUT:-200} python3 tools/probe_int4.py ${PROBE_ARGS:-} 2>&1 | grep -v "Warn\|capture failed" | tee "$OUT/probe.log"
[ -z "${NCU:-}" ] || for case in ${NCU_CASES:-"1 8192 28672" "16 8192 28672" "16 4096 14336" "1 4096 4096"}; do
  ncu --clock-control none -k regex:sp24_w4 -s 3 -c 1 --section SpeedOfLight --section WarpStateStats \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    python3 tools/ncu_case.py $case int4 128; done > "$OUT/ncu.log" 2>&1
[ -z "${NCU:-}" ] || grep -E "sp24_w4|Throughput|Duration|Stall|Warp Cycles|Issued|Occupancy|Registers|Grid|Block Size|Shared Memory Config|Waves" "$OUT/ncu.log" | head -150
[ -z "${MODELS:-}" ] || { timeout ${MODELS_TIMEOUT:-300} python3 tools/bench_models.py --cases llama8b32_decode8,llama8b32_decode32 \
    --modes reduce-overhead --reps 3 --variants dense,2:4,fp8-2:4,int4-2:4 --json "$OUT/results/19_models_llama8b32_int4.json" \
    2>&1 | tee "$OUT/models.log" | grep "^|"; timeout ${GEN_TIMEOUT:-150} python3 tools/bench_generate.py --families llama --modes eager \
    --prompts 128 --batches 1,8 --new 64 --rounds 3 --variants dense,2:4,fp8-2:4,int4-2:4 --json "$OUT/gen_int4.json" 2>&1 | tee "$OUT/gen.log" | grep "^|"; }
[ -z "${PROFILE:-}" ] || timeout ${PROFILE_TIMEOUT:-200} python3 tools/profile_gpu_time.py --case ${PROFILE_CASE:-llama8b32_decode8} \
  --mode compile --top 12 --json "$OUT/results/19_profile_decode.json" dense 2:4 fp8-2:4 int4-2:4 2>&1 | tee "$OUT/profile.log" \
  | grep -v "Warn\|warn"
[ -z "${COMPILE:-}" ] || timeout ${COMPILE_TIMEOUT:-200} python3 tools/bench_models.py --cases llama8b_decode8,llama8b_decode32 \
  --modes compile --reps 3 --variants dense,fp8-2:4,int4-2:4 --json "$OUT/results/19_models_llama8b_int4_compile.json" 2>&1 \
  | tee "$OUT/compile.log" | grep "^|"
