#!/usr/bin/env bash
# Build jax_ep in place on the GPU machine (no network) and run the GPU tests
# and, when present, the benchmarks. Logs go to $OUT (default /tmp/jax_ep_gpu_check).
#   bash scripts/gpu_check.sh            # JAX_EP_TEST_NPROCS=4 for 4 GPUs, etc.
# Knobs: GPU_TESTS (pytest paths, default tests/gpu; "none" skips the tests),
# SKIP_BENCH=1, SKIP_EXAMPLES=1, TESTS_FIRST=1, BENCH_ARGS (e.g. --no-sweep), GMM_BENCH=1
# (grouped matmul bench, GMM_ARGS), MOE_STEP_ARGS (layer bench), LAYER_AB
# (e.g. "default;dw_partitions=4": the V3 layer per --gmm-tiles variant, one
# GPU, LAYER_AB_TOKENS), TRAIN_STEPS
# (0 skips the training example), SKIP_LL_BENCH=1 / LL_BENCH_ARGS (bench/run.sh),
# BREAKDOWN (";"-separated argument lists of bench/kernel_breakdown.py, e.g.
# "ll": per-kernel CUPTI times, one GPU; $OUT/kernel_breakdown.log).
# Everything together takes far longer than one 10-minute device call, and the
# one-GPU suite alone needed two (session 10). On 2 GPUs, in order of need
# (the one-GPU suites ran in session 10; each call below <= ~9 min, unmeasured):
#   1  SKIP_BENCH=1 SKIP_EXAMPLES=1 GPU_TESTS="tests/gpu/test_native_dispatch.py tests/gpu/test_native_internode.py tests/gpu/test_native_low_latency.py"
#   2  SKIP_BENCH=1 SKIP_EXAMPLES=1 GPU_TESTS="tests/gpu/test_runtime.py tests/gpu/test_native_mesh.py tests/gpu/test_native_hardening.py tests/gpu/test_native_timeout.py tests/gpu/test_peer_memory.py"
#   3  GPU_TESTS=none SKIP_EXAMPLES=1 BENCH_ARGS="--no-sweep --no-ragged"     # ops + LL bench
#   4  GPU_TESTS=none SKIP_BENCH=1 MOE_STEP_ARGS="--configs v3,mixtral --tokens 128,1024,4096,8192"
# A pytest stopped by TEST_TIMEOUT now stops its job's ranks too (harness.py).
# Session 17 (one H200; bench/results/2026-12-02-h200x1-s17.md): dw's SM
# partitions deleted (at best 0.9% of the layer at T 4096, 2.4% slower at
# T 128); the forward takes 64-row tiles at small groups (T 128: both forward
# kernels 1.5-1.8% faster); test_native_low_latency.py passed at R = 1 (7);
# loopback op benches ran whole. moe_layer_step writes its .png to --out:
# give it $OUT so the plot comes back.
# Session 18 (one H200; bench/results/2026-12-02-h200x1-s18.md):
# dw_out_slots deleted (gate_up dw 6-8% slower at T 128); the small-group
# forward on (64, 256, 64, 2, 2) tiles (T 128 fwd kernels 1.7-2.5% faster;
# T 1024 keeps 128-row tiles); test_grouped_matmul_gpu.py whole: 23 passed
# (~260 s: give it TEST_TIMEOUT=320). At T 4096 shapes XLA's batched dw
# (cuBLAS) is 0.82-0.83 of dense against our 0.70-0.74: dw is the lever.
# Session 19 (one H200; bench/results/2026-12-03-h200x1-s19.md): dw on 2-CTA
# clusters (x multicast) and the ring pipeline across groups are the defaults
# (dw 0.79 of dense at T 4096 shapes; layer T 4096 1.71x XLA, T 128 0.96x).
# The call-4 test run cut test_v3_small_groups_down_projection and
# test_dw_small_groups at 140 s: run them first next time, e.g.
#   TESTS_FIRST=1 SKIP_BENCH=1 GPU_TESTS="tests/gpu/test_grouped_matmul_gpu.py" TEST_TIMEOUT=320
# Then the layer at T 8192 and Mixtral beside XLA (not re-run since s16):
#   JAX_EP_TEST_NPROCS=1 TRAIN_STEPS=0 MOE_STEP_ARGS="--configs v3 --experts 128
#   --skip-ragged --no-split --deadline 400 --tokens 8192 --impls jax_ep,xla_padded"
# and the same with "--configs mixtral --tokens 4096" (no --experts: it sets
# every config's expert count). moe_layer_step's --deadline is its own time
# budget: s19's 150 s cut T 4096's XLA row.
# Session 20 (one H200; bench/results/2026-12-03-h200x1-s20.md): those tests
# passed (18); V3 T 8192 1.92x and Mixtral 1.72x XLA; wider T 128 dx/dw
# tiles, dw visiting groups by size, and forward/dx wgmmas per 64-row chunk
# measured slower and were deleted.
# Session 21 (one H200; bench/results/2026-12-03-h200x1-s21.md): fwd_half_tiles
# (half-empty forward/dx tiles in a 64-row pipeline) measured no faster in the
# layer in either order (T 8192 fwd+dx +1.9%) and was deleted; 17 grouped-
# matmul GPU tests passed, the dw-default ones included.
# Still open on one GPU: up dw is 3% behind cuBLAS; T 128 is 0.4 ms behind
# XLA (the weight streams); Nsight Compute of our forward against XLA's GEMM
# at 16-64 rows per group with 16 groups (weights < 1 GB, so replays fit).
# Session 13's ideas still open: ncu (--clock-control none) DRAM throughput
# of the in-layer forward kernel at T 128; 2-CTA TMA multicast of the weight
# tiles.
# The one-GPU suite needs more than one
# 600 s call at JAX_EP_TEST_NPROCS=1 SKIP_BENCH=1 SKIP_EXAMPLES=1: split
# GPU_TESTS. Waiting for 2 GPUs: the whole suite (test_native_low_latency.py at
# R = 2 under ll_transport "auto" and "put", test_native_internode.py: the
# emulated 2-node path through JAX, never run yet, test_peer_memory.py),
# bench/run.sh (ring kernels, and the low-latency bench with command buffers
# off / on; add --ll-transport put), the layer at every T and Mixtral at EP 2
# (MOE_STEP_ARGS="--configs v3,mixtral --tokens 128,1024,4096,8192"), and
# python -m jax_ep.launch -n 2 examples/decode_overlap.py --backend native.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/jax_ep_gpu_check}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
t0=$(date +%s)

# At most 8 files come back from $OUT: build.log, gpu_tests.log (worker_logs.log
# when tests failed), ep_bench.log, the benches' tables and examples.log (or
# loopback_bench.log on one GPU).
{ nvidia-smi -L; "$PY" -V; "$PY" -c "import jax, jaxlib; print('jax', jax.__version__)"; nvcc --version | tail -1; } \
  > /tmp/jax_ep_env.txt 2>&1

# --no-build-isolation: the machine has no network; its nanobind, jaxlib,
# NVSHMEM wheel and scikit-build-core are used as installed.
echo "== build" >&2
{ cat /tmp/jax_ep_env.txt; JAX_EP_NATIVE=1 "$PY" -m pip install --no-build-isolation --no-deps -v .; } > "$OUT/build.log" 2>&1
build_rc=$?
t_build=$(( $(date +%s) - t0 ))
# Tests (and the processes they spawn) import jax_ep from this tree: put the
# built extension next to the sources too (an in-place build; *.so is ignored by git).
if [ "$build_rc" = 0 ]; then
  so=$(cd /tmp && "$PY" -c "import glob, os, jax_ep; print(*glob.glob(os.path.join(os.path.dirname(jax_ep.__file__), '_C*.so')))")
  [ -n "$so" ] && cp -f $so jax_ep/ >> "$OUT/build.log" 2>&1
fi
"$PY" -c "import jax_ep.runtime as r; print('extension:', r.extension_available(), r.unavailable_reason())" \
  >> "$OUT/build.log" 2>&1

# Fewer GPUs than processes (a one-GPU machine): the multi-process examples and
# bench cannot run; the loopback kernel bench (every rank on one GPU) runs instead.
N="${JAX_EP_TEST_NPROCS:-2}"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
few_gpus=0
[ "$NGPU" -lt "$N" ] && few_gpus=1

# The training example and the MoE-layer bench (jax_ep layer beside the best
# XLA layer), one process per GPU. MOE_STEP_ARGS narrows the bench (e.g.
# "--configs v3 --tokens 4096 --skip-ragged"); it writes moe_layer_step.{md,json,png} to $OUT.
ex_rc=skipped
if [ "${SKIP_EXAMPLES:-0}" != 1 ] && [ "$build_rc" = 0 ] && [ "$few_gpus" = 0 ]; then
  echo "== examples" >&2
  { if [ "${TRAIN_STEPS:-150}" != 0 ]; then
      echo "== train_moe.py (native, $N GPUs)"
      timeout ${TRAIN_TIMEOUT:-150} "$PY" -m jax_ep.launch -n "$N" examples/train_moe.py --backend native \
        --platform gpu --steps ${TRAIN_STEPS:-150}; echo "rc=$?"
    fi
    echo "== moe_layer_step.py ($N GPUs)"
    timeout ${LAYER_TIMEOUT:-540} "$PY" -m jax_ep.launch -n "$N" bench/moe_layer_step.py --out "$OUT" ${MOE_STEP_ARGS:-}; echo "rc=$?"
  } > "$OUT/examples.log" 2>&1
  ex_rc=0
fi

test_rc=skipped
run_tests() {
  if [ "${GPU_TESTS:-tests/gpu}" != none ]; then
    echo "== tests" >&2
    timeout -k 30 ${TEST_TIMEOUT:-540} "$PY" -m pytest -m gpu ${GPU_TESTS:-tests/gpu} -v -rs -p no:cacheprovider \
      > "$OUT/gpu_tests.log" 2>&1
    test_rc=$?
  fi
  t_test=$(( $(date +%s) - t0 - t_build ))
  # Tests failed or timed out: the last lines of every worker log
  # (tests/gpu/harness.py: /tmp/jax_ep_job_*/rank*.log) show where each stopped.
  if [ "$test_rc" != 0 ] && [ "$test_rc" != skipped ]; then
    for f in /tmp/jax_ep_job_*/rank*.log; do
      [ -f "$f" ] && { echo "== $f"; tail -n 15 "$f"; }
    done > "$OUT/worker_logs.log" 2>/dev/null
  fi
}
# TESTS_FIRST=1: the tests before the grouped-matmul bench and the layer A/B,
# which are skipped when a test fails (a new kernel that hangs or is wrong
# costs one test timeout, not every bench's).
if [ "${TESTS_FIRST:-0}" = 1 ]; then
  run_tests
  if [ "$test_rc" != 0 ] && [ "$test_rc" != skipped ]; then GMM_BENCH=0; LAYER_AB=; fi
fi

# Grouped matmul on one GPU (GMM_BENCH=1): $OUT/grouped_matmul.md.
gmm_rc=skipped
if [ "${GMM_BENCH:-0}" = 1 ]; then
  echo "== grouped matmul bench" >&2
  timeout ${GMM_TIMEOUT:-240} "$PY" bench/grouped_matmul_bench.py ${GMM_ARGS:---no-xla --sweep-small} > "$OUT/gmm_bench.log" 2>&1
  gmm_rc=$?
fi

# Layer A/B on any number of GPUs (LAYER_AB: ";"-separated --gmm-tiles values,
# "default" for none): V3 at EP 1 with 128 experts, each T of LAYER_AB_TOKENS,
# every variant in turn (same machine, interleaved), --profile: per-kernel
# times per step. $OUT/layer_ab.log.
ab_rc=skipped
if [ -n "${LAYER_AB:-}" ] && [ "$build_rc" = 0 ]; then
  echo "== layer A/B" >&2
  ab_rc=0
  # variants split at '|' when there is one (a variant may then hold several
  # ';'-separated --gmm-tiles fields), else at ';'
  case "$LAYER_AB" in *"|"*) IFS='|' read -ra abs <<< "$LAYER_AB" ;; *) IFS=';' read -ra abs <<< "$LAYER_AB" ;; esac
  for T in ${LAYER_AB_TOKENS:-4096 128 8192}; do
    for v in "${abs[@]}"; do
      extra=(); [ "$v" != default ] && extra=(--gmm-tiles "$v")
      echo "== T $T $v"
      timeout ${LAYER_AB_TIMEOUT:-90} "$PY" -m jax_ep.launch -n 1 bench/moe_layer_step.py \
        --configs v3 --experts 128 --impls jax_ep --skip-ragged --no-split --profile \
        --tokens "$T" "${extra[@]}" --out /tmp/jax_ep_layer_ab || ab_rc=$?
    done
  done > "$OUT/layer_ab.log" 2>&1
fi

[ "${TESTS_FIRST:-0}" = 1 ] || run_tests

bd_rc=skipped
if [ -n "${BREAKDOWN:-}" ] && [ "$build_rc" = 0 ]; then
  echo "== kernel breakdown" >&2
  bd_rc=0
  IFS=';' read -ra bds <<< "$BREAKDOWN"
  for b in "${bds[@]}"; do
    echo "== kernel_breakdown.py $b"
    timeout ${BREAKDOWN_TIMEOUT:-240} "$PY" -m jax_ep.launch -n 1 bench/kernel_breakdown.py $b || bd_rc=$?
  done > "$OUT/kernel_breakdown.log" 2>&1
fi

bench_rc=skipped
if [ "${SKIP_BENCH:-0}" != 1 ] && [ "$few_gpus" = 0 ]; then
  echo "== bench" >&2
  bash bench/run.sh > /tmp/jax_ep_bench.out 2>&1  # run.sh keeps its own log: $OUT/ep_bench.log
  bench_rc=$?
elif [ "${SKIP_BENCH:-0}" != 1 ] && [ "$build_rc" = 0 ]; then
  echo "== loopback bench ($NGPU GPU < $N processes)" >&2
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \
    timeout ${LOOPBACK_TIMEOUT:-400} "$PY" tests/gpu/test_loopback.py --bench > "$OUT/loopback_bench.log" 2>&1
  bench_rc=$?
  # the low-latency kernels at V3-decode, loopback and the native path at R = 1,
  # and the emulated-node (internode) kernels (same log)
  for p in "" --put; do   # P2P stores, then every send by NVSHMEM puts (the put path's own cost)
    CUDA_DEVICE_MAX_CONNECTIONS=32 JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \
      timeout ${LL_BENCH_TIMEOUT:-120} "$PY" tests/gpu/test_loopback_ll.py --bench $p >> "$OUT/loopback_bench.log" 2>&1
  done
  for g in "" --graphs; do
    timeout ${LL_BENCH_TIMEOUT:-120} "$PY" -m jax_ep.launch -n 1 bench/low_latency_bench.py $g \
      >> "$OUT/loopback_bench.log" 2>&1
  done
  CUDA_DEVICE_MAX_CONNECTIONS=32 JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    timeout ${LOOPBACK_TIMEOUT:-400} "$PY" tests/gpu/test_loopback_internode.py --bench >> "$OUT/loopback_bench.log" 2>&1
fi

echo "===== gpu_check summary ====="
cat /tmp/jax_ep_env.txt
echo "build: rc=$build_rc (${t_build}s)  $(grep -m1 '^extension:' "$OUT/build.log")"
[ "$build_rc" = 0 ] || tail -40 "$OUT/build.log"
echo "tests: rc=$test_rc (${t_test}s)  $(tail -1 "$OUT/gpu_tests.log" 2>/dev/null)"
[ "$test_rc" = 0 ] || [ "$test_rc" = skipped ] || grep -E "FAILED|ERROR|Error|error" "$OUT/gpu_tests.log" | tail -30
echo "bench: rc=$bench_rc"
if [ -f "$OUT/ep_bench.log" ]; then tail -45 "$OUT/ep_bench.log"; elif [ -f /tmp/jax_ep_bench.out ]; then tail -30 /tmp/jax_ep_bench.out; fi
[ -f "$OUT/loopback_bench.log" ] && tail -60 "$OUT/loopback_bench.log"
echo "kernel breakdown: rc=$bd_rc"
[ -f "$OUT/kernel_breakdown.log" ] && grep -E "^(\[rank 0\] )?(\||###|==)" "$OUT/kernel_breakdown.log" | tail -120
echo "layer A/B: rc=$ab_rc"
[ -f "$OUT/layer_ab.log" ] && grep -E "^== |ms/step|mosaic_gpu_kernel" "$OUT/layer_ab.log" | cut -c1-160
echo "grouped matmul: rc=$gmm_rc"
[ -f "$OUT/gmm_bench.log" ] && grep "^|" "$OUT/gmm_bench.log" | tail -30
echo "examples: rc=$ex_rc"
[ -f "$OUT/examples.log" ] && grep -E "^==|rc=|loss|tokens/s|share|\|" "$OUT/examples.log" | tail -40
echo "total: $(( $(date +%s) - t0 ))s; logs in $OUT"
[ "$build_rc" = 0 ] && { [ "$test_rc" = 0 ] || [ "$test_rc" = skipped ]; }
