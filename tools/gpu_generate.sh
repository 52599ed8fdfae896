#!/usr/bin/env bash
# Issue 58's GPU work in one call, spread over the GPUs there are (one process per GPU, each its
# own share of the families; ratios are taken within a process): the generate() tables, then on
# the last GPU the GPU tests of the decode work, cold first calls and the static-cache run.
# Logs and results under $OUT. Usage: tools/gpu_generate.sh (GEN_NEW, GEN_ROUNDS, GEN_PROMPTS, GEN_BATCHES; SKIP_TESTS,
# SKIP_TIMINGS, SKIP_COLD, SKIP_STATIC, SKIP_PROFILE, AFTER_TIMINGS, MODELS_CASES; COLD_PROFILE=variants for cProfile's view
# of a cold call; COLD_TRACE=1: the cold calls' timelines of compiles and waits; COLD_KERNELS=1: the cold calls also with the sparsegen_kernels package, its bundle precompiled here)
set -uo pipefail
OUT=${OUT:-out}; R=$OUT/results; mkdir -p "$R"
source tools/device_env.sh
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
variants=${GEN_VARIANTS:-dense,dense-merged,2:4,b64d0.5,b128d0.25,fp8-dense,fp8-2:4,int8-dense,int8-2:4}
common=(--modes eager --prompts "${GEN_PROMPTS:-128}" --batches "${GEN_BATCHES:-1,8,32}" --new "${GEN_NEW:-128}" --rounds "${GEN_ROUNDS:-5}" --variants "$variants")
shares=(${GEN_SHARES:-llama,qwen2 mistral,gemma phi3})
[ -z "${SKIP_TIMINGS:-}" ] || shares=()
for i in "${!shares[@]}"; do
  gpu=$((i % gpus))
  ( CUDA_VISIBLE_DEVICES=$gpu SPARSEGEN_CACHE_DIR=/tmp/sgcache$gpu timeout ${GEN_TIMEOUT:-540} \
      python3 tools/bench_generate.py --families "${shares[$i]}" "${common[@]}" --json "$R/15_generate_$i.json" \
      > "$OUT/generate_$i.log" 2>&1 ) &
done
last=$((gpus - 1))
# One GPU, or AFTER_TIMINGS set: the timings alone first (tests and compiles load the host), then the rest.
{ [ "$gpus" = 1 ] || [ -n "${AFTER_TIMINGS:-}" ]; } && wait
# MODELS_CASES: bench_models.py's decode cases of the families (eager and plain compile), on the
# first GPU beside the last one's work.
[ -z "${MODELS_CASES:-}" ] || ( export CUDA_VISIBLE_DEVICES=0 SPARSEGEN_CACHE_DIR=/tmp/sgcache_m
  timeout ${MODELS_TIMEOUT:-400} python3 tools/bench_models.py --cases "$MODELS_CASES" --modes ${MODELS_MODES:-eager,compile} \
    --variants ${MODELS_VARIANTS:-dense,2:4,b64d0.5,b128d0.25,fp8-dense,fp8-2:4} --json "$R/18_models_families.json" \
    > "$OUT/models.log" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=$last SPARSEGEN_CACHE_DIR=/tmp/sgcache_t
  [ -n "${SKIP_TESTS:-}" ] || timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu ${GEN_TESTS:-tests/test_gpu_warm.py tests/test_gpu_epilogues.py -k "warm or geglu_tanh or reglu"} 2>&1 | tail -15
  # Bytecode as pip writes it at install (this image may not write it: every cold process would
  # compile sparsegen's modules from source, which no installed copy does).
  python3 -m compileall -q sparsegen tools > /dev/null
  kernels=()  # (the package as its wheel installs it: sparsegen_kernels/<arch>/ on the path)
  [ -z "${COLD_KERNELS:-}" ] || { kernels=(--cold-kernels /tmp/sgk)
    python3 -m sparsegen precompile --arch sm_90 --bundle /tmp/sgk/sparsegen_kernels/sm_90 2>&1 | grep -v "kernel/s\|it/s" | tail -2; }
  [ -z "${COLD_PROFILE:-}" ] || timeout 200 python3 tools/bench_generate.py --cold "$COLD_PROFILE" --cold-profile \
     "${kernels[@]}" --families ${COLD_FAMILIES:-gemma} > "$OUT/cold_profile.log" 2>&1
  [ -n "${SKIP_COLD:-}" ] || timeout ${COLD_TIMEOUT:-200} python3 tools/bench_generate.py --cold ${COLD_VARIANTS:-2:4,fp8-2:4} "${kernels[@]}" ${COLD_TRACE:+--cold-trace} \
     --families ${COLD_FAMILIES:-gemma} --json "$R/16_generate_cold.json" 2>&1 | tee "$OUT/cold.log" | grep -v "Warn\|^TRACE" | tail -12
  [ -n "${SKIP_STATIC:-}" ] || timeout ${STATIC_TIMEOUT:-150} python3 tools/bench_generate.py --modes static --families llama --prompts 128 --batches 8 --new 64 --rounds 3 --layers ${STATIC_LAYERS:-4} \
     --variants dense,2:4,b128d0.25,fp8-2:4 --json "$R/17_generate_static.json" 2>&1 | grep "^|"
  [ -n "${SKIP_PROFILE:-}" ] || timeout ${PROFILE_TIMEOUT:-120} python3 tools/bench_generate.py --profile "${PROFILE_ITEMS:-gemma:fp8-2:4,gemma:2:4}" --batches ${PROFILE_BATCH:-32} \
     --prompts 128 > "$OUT/profile.log" 2>&1
) > "$OUT/last_gpu.log" 2>&1 &
wait
cat "$OUT/last_gpu.log"; grep -h "^|" "$OUT"/generate_*.log
# (the device tool brings back 8 files: the logs as one)
cat "$OUT"/generate_*.log > "$OUT/generate.log" 2>/dev/null; rm -f "$OUT"/generate_*.log "$OUT/gpu.txt"
