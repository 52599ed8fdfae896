#!/usr/bin/env bash
# Everything the GPU is needed for, in one call of the device tool: GPU tests, then the
# benchmarks. Logs go to $OUT (or ./out); benchmark runs are recorded under $OUT/results/
# (copy them to tools/results/, then python tools/benchmarks_md.py). Pass SPARSEGEN_COMMIT
# (the device's copy has no .git). Usage: tools/gpu_run.sh STEP... (steps: the case labels below)
set -uo pipefail
OUT=${OUT:-out}; R=$OUT/results; mkdir -p "$OUT" "$R"
source tools/device_env.sh
# A writable bytecode cache: the image's site-packages hold no .pyc files, and recompiling
# jinja2 at every import would dominate the new-process timing (a pip install has them).
export PYTHONPYCACHEPREFIX=/tmp/pycache
# NVLink multicast stays off on the lent multi-GPU machines (KINDS.md), for every program started here
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 SPARSEGEN_CACHE_DIR=${SPARSEGEN_CACHE_DIR:-/tmp/sgcache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests bench)
for step in "${steps[@]}"; do
  case $step in
    compare) # a refactor's check: the same benchmarks on the tree before it (.old/, carried: git archive
         # REV sparsegen templates tools | tar -x -C .old) and on this one, interleaved tool by tool
         IFS=';' read -ra tools <<< "${COMPARE_TOOLS:-bench_models.py --host --cases none;bench.py --quick;bench24.py --quick}"
         for tool in "${tools[@]}"; do
           for tree in old new; do
             root=$([ $tree = old ] && echo .old || echo .)
             echo "== $tree: $tool" | tee -a "$OUT/compare.log"
             PYTHONPATH=$root:${PYTHONPATH#.:} SPARSEGEN_CACHE_DIR=/tmp/sgcache_$tree timeout ${COMPARE_TIMEOUT:-200} \
               python3 $root/tools/$tool 2>&1 | grep -v '^{' | grep -E "^\||us|x dense|ms" | tail -40 | tee -a "$OUT/compare.log"
           done
         done ;;
    sanitize) # tools/sanitize_tests.txt under compute-sanitizer's four tools at once (a process each),
         # sparsegen's kernels only (every name has _sm<arch>_ in it: bsr_dds_b32x32_bf16_nt_sm90a_...),
         # PyTorch's caching allocator off (each tensor its own allocation, its end where memcheck
         # sees it). SANITIZE_SAMPLE="tool=N ..." runs N cases of each test under that tool
         # (conftest.py's SPARSEGEN_TEST_SAMPLE; none: every case).
         export PYTORCH_NO_CUDA_MEMORY_CACHING=1
         tests=$(grep -v '^#' tools/sanitize_tests.txt | tr '\n' ' ')
         arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
         filter=(--kernel-name "kns=_sm$arch")
         compute-sanitizer --version | tail -1 | tee "$OUT/sanitize.log"
         # memcheck pads every allocation (its default is none): a read just past a tensor's end then
         # lands in the padding, not in whatever allocation the driver put next to it
         planted() { compute-sanitizer --tool memcheck --padding 8192 "$@" python3 tools/sanitize_planted.py > "$OUT/sanitize_planted.log" 2>&1
                     grep -c 'Invalid __global__ read' "$OUT/sanitize_planted.log"; }
         found=$(planted "${filter[@]}")
         [ "$found" = 0 ] && { filter=(); found=$(planted); }  # the filter missed it: every kernel then
         echo "planted: an out-of-bounds read (bsr_dds on mma.sync, values one block short) gave $found memcheck" \
           "reports with the filter ${filter[*]:-none (kns=_sm$arch missed it)}" | tee -a "$OUT/sanitize.log"
         compute-sanitizer --tool initcheck python3 tools/sanitize_planted.py cublas > "$OUT/sanitize_cublas.log" 2>&1
         echo "planted: initcheck on a PyTorch read of cuBLAS's output (torch.mm into torch.empty) gave" \
           "$(grep -c 'Uninitialized __global__' "$OUT/sanitize_cublas.log") reports" | tee -a "$OUT/sanitize.log"
         for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
           sample=$(echo " ${SANITIZE_SAMPLE:-memcheck=16 racecheck=2 synccheck=8 initcheck=6} " | grep -o " $tool=[0-9]*" | cut -d= -f2)
           echo "sample: $tool runs ${sample:-all} cases of each test" | tee -a "$OUT/sanitize.log"
           pad=(); [ $tool = memcheck ] && pad=(--padding 8192)
           # initcheck sees writes only by the kernels it instruments: filtered, every tensor PyTorch
           # wrote (an index, an input) would read as uninitialised to our kernels
           only=("${filter[@]}"); [ $tool = initcheck ] && only=()
           # the liveness test's own 180 s limit is too short under the slow tools
           slow=(); [ $tool = racecheck ] || [ $tool = initcheck ] && \
             slow=(--deselect tests/test_gpu.py::test_persistent_kernels_with_many_empty_and_short_rows_finish)
           ( start=$SECONDS
             SPARSEGEN_TEST_SAMPLE=$sample SPARSEGEN_TEST_KERNEL_LOG="$OUT/sanitize_${tool}_kernels.txt" \
               timeout ${SANITIZE_TIMEOUT:-480} compute-sanitizer --tool $tool "${pad[@]}" "${only[@]}" --print-limit 200 \
               python3 -m pytest -q -p no:cacheprovider "${slow[@]}" $tests > "$OUT/sanitize_$tool.log" 2>&1
             echo "$tool: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/sanitize.log" ) &
         done
         wait
         python3 tools/sanitize_report.py "$OUT" --json "$R/60_sanitize.json" | tee -a "$OUT/sanitize.log" ;;
    reliability_tests) timeout ${RELIABILITY_TIMEOUT:-500} python3 -m pytest -q -m gpu tests/test_gpu_determinism.py \
           tests/test_gpu_nonfinite.py tests/test_gpu_graphs.py -rs 2>&1 | tee "$OUT/reliability_tests.log" | tail -40 ;;
    precompile_bytes) # the one-byte 2:4 kernels (scaled ones included) on all cores, before the steps that use them
         python3 -m sparsegen precompile --dtype int8 e4m3 -j 16 2>&1 | tail -2 | tee "$OUT/precompile_bytes.log" ;;
    profile_fp8) # GPU time by kernel kind, FP8 dense against FP8 2:4, where issue 30's targets stand
         # (PROFILE_CASES; the device tool returns at most 8 files from $OUT: few steps per call)
         for c in ${PROFILE_CASES:-llama8b_prefill llama8b_decode64}; do
           timeout 160 python3 tools/profile_gpu_time.py --case $c --mode compile --top 12 fp8-dense fp8-2:4 \
             --json "$R/62_profile_$c.json" 2>&1 | tee "$OUT/profile_$c.log" | grep -E "^\||^ +[0-9]"; done ;;
    plain_compile_profile) # issue 39 item 6: a decode step under plain torch.compile, dense against the
         # byte variants: GPU time and launches per kernel, host time (cProfile), Inductor's code for FP8 2:4
         c=${PROFILE_CASE:-llama8b_decode8}
         timeout 200 python3 tools/profile_gpu_time.py --case $c --mode compile --top 45 dense 2:4 fp8-dense fp8-2:4 \
           > "$OUT/plain_gpu_$c.log" 2>&1; grep -E "^\||launches per step" "$OUT/plain_gpu_$c.log"
         timeout 200 python3 tools/profile_model.py --compile --case $c dense 2:4 fp8-dense fp8-2:4 > "$OUT/plain_host_$c.log" 2>&1
         grep -E "====|function calls" "$OUT/plain_host_$c.log"
         TORCH_LOGS=output_code timeout 150 python3 tools/profile_model.py --compile --case $c fp8-2:4 > "$OUT/plain_code_$c.log" 2>&1 ;;
    decode_compile) # issue 39 item 6's cells: every decode case and 16-bit / one-byte variant under plain
         # compile, each (variant) beside a dense twin compiled again after a Dynamo reset (--alone),
         # the two timed in turn over DECODE_ROUNDS rounds (the speedup: the rounds' ratios' median)
         timeout ${DECODE_TIMEOUT:-500} python3 tools/bench_models.py --modes compile --alone --rounds ${DECODE_ROUNDS:-15} \
           --cases ${DECODE_CASES:-llama_decode1,llama_decode8,llama8b_decode1,llama8b_decode8,llama8b_decode32,llama8b_decode64} \
           --variants ${DECODE_VARIANTS:-2:4,b128d0.25,fp8-2:4,int8-2:4} --json "$R/11_models_decode_compile_alone.json" \
           2>&1 | tee "$OUT/decode_compile.log" | grep "^|" ;;
    trust_tests) # copies after every mode, strict checkpoint loads, the attacker tests, the skip guard
         timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_copy.py tests/test_copy.py \
           tests/test_compressed.py tests/test_compressed_strict.py tests/test_skip_guard.py tests/test_hostile_user.py \
           tests/test_docs.py tests/test_arguments.py \
           "tests/test_gpu_scaled24.py::test_checkpoint_layers_run_on_the_gpu" -rs 2>&1 | tee "$OUT/trust_tests.log" | tail -25 ;;
    scaled_tests) timeout 400 python3 -m pytest -q tests/test_gpu_scaled24.py tests/test_scaled24.py \
           tests/test_compressed.py -rs 2>&1 | tee "$OUT/scaled_tests.log" | tail -25 ;;
    deterministic) timeout 300 python3 tools/bench24.py --deterministic --json "$R/61_deterministic.json" 2>&1 \
           | tee "$OUT/deterministic.log" | grep "^|" ;;
    models_tests) timeout 500 python3 -m pytest -q -m gpu tests/test_gpu_models.py -x 2>&1 | tee "$OUT/gpu_models_tests.log" | tail -25 ;;
    host) python3 tools/bench_models.py --host --cases none --json "$R/10_models_host.json" 2>&1 | tail -12 ;;
    models:*) cases=${step#models:}  # models:CASE[,CASE...]: whole-model benchmark of those cases
         tag=${cases//,/_}${MODEL_TAG:-}
         timeout ${MODEL_TIMEOUT:-590} python3 -X faulthandler tools/bench_models.py --cases "$cases" ${MODEL_ARGS:-} \
           --json "$R/11_models_$tag.json" 2>&1 | tee "$OUT/models_$tag.log" | grep -v '^{' | grep "^|" ;;
    bell_bench) timeout 300 python3 tools/bench.py --bell --json "$R/21_layers_bell.json" 2>&1 | tee "$OUT/bell_bench.log" | grep "^|" ;;
    bdiag_bench) timeout 300 python3 tools/bench.py --bdiag --json "$R/22_layers_bdiag.json" 2>&1 | tee "$OUT/bdiag_bench.log" | grep "^|" ;;
    bdiag) timeout 420 python3 -m pytest -q -m gpu tests/test_gpu_bdiag.py 2>&1 | tee "$OUT/bdiag_tests.log" | tail -15
         timeout 300 python3 tools/bench.py --bdiag --json "$R/22_layers_bdiag.json" 2>&1 | tee "$OUT/bdiag_bench.log" | grep "^|" ;;
    kit) # the layout kit's layouts (issue 41): their GPU suites and the tutorial's, then each by
         # its face's tuning points (forward, forward + backward, the sampled dW against dense + gather)
         timeout 400 python3 -m pytest -q -m gpu tests/test_gpu_bell.py tests/test_gpu_bdiag.py tests/test_tutorial.py \
           -rs 2>&1 | tee "$OUT/kit_tests.log" | tail -15
         for layout in bell bdiag; do
           timeout 200 python3 tools/bench.py --layout $layout --json "$R/23_layout_$layout.json" 2>&1 \
             | tee "$OUT/layout_$layout.log" | grep "^|"; done ;;
    bell) timeout 300 python3 -m pytest -q -m gpu tests/test_gpu_bell.py -x 2>&1 | tee "$OUT/bell_tests.log" | tail -15
         timeout 300 python3 tools/bench.py --bell --json "$R/21_layers_bell.json" 2>&1 | tee "$OUT/bell_bench.log" | grep "^|" ;;
    acc) timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_acc.py 2>&1 | tee "$OUT/acc_tests.log" | tail -8
         timeout 200 python3 tools/bench.py --acc --json "$R/22_layers_acc.json" 2>&1 | tee "$OUT/acc_bench.log" | grep "^|" ;;
    grouped_tests) # grouped 2:4 products (q, k and v in one launch) and the lowerings that make them
         timeout ${GROUPED_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_gpu_grouped.py tests/test_inductor.py \
           "tests/test_gpu_scaled24.py::test_compiled_decode_layer_is_one_launch" \
           "tests/test_gpu_scaled24.py::test_compiled_and_graphed_match_eager" 2>&1 | tee "$OUT/grouped_tests.log" | tail -15 ;;
    tests) timeout 400 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_sp24.py -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    epi_tests) timeout 400 python3 -m pytest -q -m gpu tests/test_gpu_epilogues.py tests/test_inductor.py --maxfail=8 2>&1 | tee "$OUT/epi_tests.log" | tail -15 ;;
    dense_tests) timeout 300 python3 -m pytest -q -m gpu tests/test_gpu_dense_path.py -x 2>&1 | tee "$OUT/dense_tests.log" | tail -5 ;;
    lean_tests) timeout 300 python3 -m pytest -q -m gpu tests/test_gpu_lean.py 2>&1 | tee "$OUT/lean_tests.log" | tail -25 ;;
    bundle) rm -rf /tmp/bundle; start=$SECONDS  # every default bf16/fp16 kernel of this GPU, then run from them alone
         python3 -m sparsegen precompile --dtype bf16 fp16 -j 16 --bundle /tmp/bundle 2>/dev/null | tee "$OUT/precompile.log"
         echo "precompile: $((SECONDS - start)) s" | tee -a "$OUT/precompile.log"
         mkdir -p /tmp/ro_cache && chattr +i /tmp/ro_cache  # a cache nobody can write (root included)
         SPARSEGEN_CACHE_DIR=/tmp/ro_cache SPARSEGEN_KERNEL_BUNDLE=/tmp/bundle python3 tools/bundle_check.py 2>&1 | tee "$OUT/bundle.log"
         chattr -i /tmp/ro_cache ;;
    probe) python3 tools/probe_host.py 2>&1 | tee "$OUT/probe.log" ;;
    launch_probe) # host us per launch of each launcher a compiled graph calls, against torch.mm(out=):
         # in bursts of one call (probe_launch), then in place in a compiled decode step (probe_in_situ)
         for tokens in ${PROBE_TOKENS:-1 8 32}; do
           timeout 150 python3 tools/probe_launch.py --tokens $tokens --width ${PROBE_WIDTH:-2048} 2>&1 \
             | tee -a "$OUT/launch_probe.log" | grep -E "^\||host us"; done
         timeout 200 python3 tools/probe_in_situ.py --case llama_decode1 dense b128d0.25 2:4 2>&1 \
           | tee -a "$OUT/launch_probe.log" | grep -E "^\||under"
         timeout 200 python3 tools/probe_in_situ.py --case llama8b_decode32 dense fp8-2:4 int8-2:4 2>&1 \
           | tee -a "$OUT/launch_probe.log" | grep -E "^\||under" ;;
    crossovers) python3 -m sparsegen tune ${TUNE_ARGS:-} 2>&1 | tee "$OUT/crossovers.log" | tail -16  # this GPU's table, used by later steps
         cp "$SPARSEGEN_CACHE_DIR"/crossovers/*.json "$OUT/" ;;
    tune) python3 tools/bench.py --tune 2>&1 | tee "$OUT/tune.log" ;;
    train) python3 tools/bench.py --train --json "$R/40_train_bsr.json" 2>&1 | tee "$OUT/train.log" ;;
    cputests) timeout 500 python3 -m pytest -q tests/test_patching.py tests/test_autograd.py 2>&1 | tee "$OUT/cpu_tests.log" | tail -3 ;;
    distributed) timeout ${DIST_TIMEOUT:-500} python3 -m pytest -q -m gpu tests/test_distributed.py -rs 2>&1 | tee "$OUT/distributed.log" | tail -30 ;;
    tp_bench) # tensor parallelism of the MLPs against the dense twin under the same plan (issue 40 item 5)
         timeout ${TP_BENCH_TIMEOUT:-500} python3 -m torch.distributed.run --nproc_per_node=${NGPU:-2} tools/bench_tp.py \
           ${TP_BENCH_ARGS:-} --json "$R/71_tp${DIST_TAG:-}.json" 2>&1 | tee "$OUT/tp_bench${DIST_TAG:-}.log" | grep "^|" ;;
    train_unfused) # one GPU's training step at bench_distributed's shape, the gated MLPs fused (act(gate) * up
         # on strided views of the fused product: non-vectorized kernels in eager) and unfused (PyTorch's MLP)
         timeout ${UNFUSED_TIMEOUT:-300} python3 -m torch.distributed.run --nproc_per_node=1 tools/bench_distributed.py \
           --engines one --modes eager,compile --variants dense,2:4t-mlp,2:4t-mlp-unfused,b64d0.25,b64d0.25-unfused \
           --steps 10 --json "$R/72_train_unfused.json" 2>&1 | tee "$OUT/train_unfused.log" | grep "^|" ;;
    distributed_bench) # FSDP2 / DDP training steps against dense (issue 40), NVLink multicast off (KINDS.md)
         timeout ${DIST_BENCH_TIMEOUT:-500} \
           python3 -m torch.distributed.run --nproc_per_node=${NGPU:-2} tools/bench_distributed.py ${DIST_BENCH_ARGS:-} \
           --json "$R/70_distributed_train${DIST_TAG:-}.json" 2>&1 | tee "$OUT/distributed_bench${DIST_TAG:-}.log" | grep -E "^\||====|recompiles|built again" ;;
    train_profile) timeout 100 python3 tools/profile_train.py 2>&1 | tee "$OUT/train_profile.log" | grep -E " ms|corpus|batches" ;;
    train_demo) timeout 420 python3 tools/train_demo.py --out "$OUT" 2>&1 | tee "$OUT/train_demo.log" | tail -8 ;;
    train_demo_seeds) timeout 500 python3 tools/train_demo.py --out "$OUT/seeds" --models dense,0.5,2:4-train --seeds 0,1,2 --steps 400 --json "$R/44_train_demo_seeds.json" \
           2>&1 | tee "$OUT/train_demo_seeds.log" | grep "^|" ;;  # issue 27's quality target: within 2% of dense
    overheads) python3 tools/bench.py --overheads --json "$R/50_overheads.json" 2>&1 | tee "$OUT/overheads.log" ;;
    profile_model) python3 tools/profile_model.py 2>&1 | tee "$OUT/profile_model.log" | grep -A22 "====" ;;
    profile_compiled) python3 tools/profile_model.py --compile dense 2:4 b64d0.5 2>&1 | tee "$OUT/profile_compiled.log" | grep -A30 "====" ;;
    profile) python3 tools/profile_host.py 2>&1 | tee "$OUT/profile.log" ;;
    gpu_time) python3 tools/profile_host.py --gpu-time 2>&1 | tee "$OUT/gpu_time.log" | grep -E "====|Self CUDA time|sparsegen|sp24|bsr|gemm|nvjet|Memset|elementwise|Kernel" ;;
    bound) python3 tools/probe_bound.py 2>&1 | tee "$OUT/bound.log" ;;
    ncu) for case in "16384 1024 4096 128 0.25" "8192 4096 11008 128 0.1" "8192 4096 11008 64 0.25"; do
           ncu --clock-control none -k regex:bsr_dds -s 3 -c 1 --section SpeedOfLight \
             --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
             python3 tools/ncu_case.py $case; done 2>&1 | tee "$OUT/ncu.log" | grep -E "bsr_dds|Throughput|Duration|Stall|Warp Cycles|Issued|L2|DRAM|Hit" ;;
    demo) python3 tools/demo.py 2>&1 | tee "$OUT/demo.log" ;;
    tune24) python3 tools/bench24.py --tune 2>&1 | tee "$OUT/tune24.log" ;;
    tests24) timeout 300 python3 -m pytest -q -m gpu tests/test_gpu_sp24.py -x 2>&1 | tee "$OUT/tests24.log" | tail -15 ;;
    tests24k) SPARSEGEN_COMPRESS_KERNEL=1 timeout 300 python3 -m pytest -q -m gpu tests/test_gpu_sp24.py -x 2>&1 | tail -15 | tee "$OUT/tests24k.log" ;;
    bench24) python3 tools/bench24.py --json "$R/30_sp24.json" 2>&1 | tee "$OUT/bench24.log" ;;
    bench24_train) python3 tools/bench24.py --train --json "$R/41_train_sp24.json" 2>&1 | tee "$OUT/bench24_train.log" ;;
    tune_fp8) python3 tools/bench24.py --tune-fp8 2>&1 | tee "$OUT/tune_fp8.log" ;;
    tune_decode) python3 tools/bench24.py --tune-decode 2>&1 | tee "$OUT/tune_decode.log" ;;
    bench24_decode) python3 tools/bench24.py --decode --json "$R/31_sp24_decode.json" 2>&1 | tee "$OUT/bench24_decode.log" ;;
    train24_profile) timeout 200 python3 tools/profile_train.py --models dense,2:4-train,2:4 2>&1 | tee "$OUT/train24_profile.log" | grep -E " ms" ;;
    train_demo24) for s in ${SEEDS:-0 1 2}; do  # issue 15's demo: dense, the 2by4 recipe and fixed-mask 2:4, three seeds
           timeout 190 python3 tools/train_demo.py --out "$OUT/s$s" --models dense,2:4-train,2:4 --seed $s 2>&1 | tee "$OUT/train_demo24_s$s.log" | tail -5; done ;;
    bench24bytes) python3 tools/bench24.py --bytes --json "$R/32_sp24_bytes.json" 2>&1 | tee "$OUT/bench24bytes.log" ;;
    quick) python3 tools/bench.py --quick 2>&1 | tee "$OUT/bench_quick.log" ;;
    bench) python3 tools/bench.py --json "$R/20_layers_bsr.json" 2>&1 | tee "$OUT/bench.log" | grep -E "^\||targets" ;;
  esac
done
