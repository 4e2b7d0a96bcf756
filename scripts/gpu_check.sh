#!/usr/bin/env bash
# Build jax_ep in place on the GPU machine (no network) and run the GPU suites.
# Logs go to $OUT (default /tmp/jax_ep_gpu_check).
#
#   bash scripts/gpu_check.sh            # multi-process suite at N = 2, 4 and 8
#
# With fewer GPUs than N the N processes of a job share them (tests/gpu/harness.py,
# jax_ep.shared_gpu): every multi-process path runs and is checked; no timing
# from that mode means anything. Warm jobs (JAX_EP_TEST_WARM=1, the default
# here) keep a job's processes between tests of one shape. On one H200 the
# whole suite at N = 2, 4 and 8 side by side takes about 25 minutes (on a GPU
# with less memory the sessions run one after another: SUITE_MIN_POOL_GIB), so on
# a machine whose calls last 10 minutes split it and give each N what is
# left for it, e.g.
#   SUITE_PART=families bash scripts/gpu_check.sh
#   SUITE_N="2 4 8" SUITE_PART=core SUITE_TESTS_N8="tests/gpu/test_native_dispatch.py" \
#     SKIP_BUILD=1 bash scripts/gpu_check.sh
# bench/results/gpu-suite-shared-gpu.md: what passed, per N.
#
# Knobs:
#   SUITE_N        process counts; each runs as its own pytest session, side by
#                  side, with the GPU memory split between all their processes
#   SUITE_MIN_POOL_GIB  the least memory pool per process for side by side
#                  (default 5.5); below it the sessions run one after another
#   SUITE_PART     core (runtime, mesh, hardening, timeout, dispatch) or
#                  families (low latency, internode, ragged, examples); default both
#   SUITE_TESTS    the multi-process test files or node ids (overrides SUITE_PART)
#   SUITE_TESTS_N<n>  the same for the session of N = <n> alone (e.g. the tests
#                  a previous call did not reach at that N); one run keeps the
#                  fair memory fraction, two runs side by side would not
#   ONE_GPU_TESTS  single-GPU test files run after (loopback kernels, grouped
#                  matmul bf16 and fp8; default none)
#   ONE_GPU_WORKERS  pytest-xdist workers for them (compile-bound: the bf16
#                  grouped-matmul file's 31 cases took 190 s with 3; default 1).
#                  The fp8 file runs with 8; the bf16 file's V3 cases need up to
#                  14 GiB each and ran out of memory beside 7 others on 80 GB
#   REHEARSAL=1    two launchers on this machine as two hosts (--host-id):
#                  the training example and the internode workers (tests/gpu/rehearsal.py);
#                  REHEARSAL=internode: the workers only
#   SKIP_BUILD=1   use the jax_ep/_C*.so already in the tree (e.g. carried)
#   EXTRA          a command run last (a benchmark), output in $OUT/extra.log
#   TEST_TIMEOUT   seconds per pytest session (default 540); JOB_TIMEOUT per job (240)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/jax_ep_gpu_check}"
mkdir -p "$OUT"
rm -f "$OUT"/suite_n*.log "$OUT"/rehearsal.log "$OUT"/one_gpu.log "$OUT"/extra.log  # this run's logs only
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 JAX_EP_TEST_WARM=${JAX_EP_TEST_WARM:-1}
PY="${PYTHON:-python3}"
t0=$(date +%s)
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')

# --no-build-isolation: the machine has no network; its nanobind, jaxlib,
# NVSHMEM wheel and scikit-build-core are used as installed. JAX_EP_TESTING=1:
# the test build (cc/testing: loopback, ping, output poisoning), which the GPU
# tests need. The tests' ranks import jax_ep from this tree: the extension is
# copied next to the sources.
build_rc=0
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  echo "== build" >&2
  { nvidia-smi -L; "$PY" -V; nvcc --version | tail -1
    JAX_EP_NATIVE=1 JAX_EP_TESTING=1 "$PY" -m pip install --no-build-isolation --no-deps -v .; } > "$OUT/build.log" 2>&1
  build_rc=$?
  if [ "$build_rc" = 0 ]; then
    so=$(cd /tmp && "$PY" -c "import glob, os, jax_ep; print(*glob.glob(os.path.join(os.path.dirname(jax_ep.__file__), '_C*.so')))")
    [ -n "$so" ] && cp -f $so jax_ep/
  fi
fi
"$PY" -c "import jax_ep.runtime as r; print('extension:', r.extension_available(), r.unavailable_reason())" \
  >> "$OUT/build.log" 2>&1
t_build=$(( $(date +%s) - t0 ))

# The suite in two halves (SUITE_PART), one device call each where calls are short.
CORE_TESTS="tests/gpu/test_runtime.py tests/gpu/test_native_mesh.py tests/gpu/test_native_hardening.py
  tests/gpu/test_native_timeout.py tests/gpu/test_native_dispatch.py"
FAMILY_TESTS="tests/gpu/test_native_low_latency.py tests/gpu/test_native_internode.py
  tests/gpu/test_ragged_native.py tests/gpu/test_examples_gpu.py"
case "${SUITE_PART:-all}" in
  core) MP_TESTS=$CORE_TESTS ;;
  families) MP_TESTS=$FAMILY_TESTS ;;
  all) MP_TESTS="$CORE_TESTS $FAMILY_TESTS" ;;
  *) echo "gpu_check: SUITE_PART must be core, families or all, got '$SUITE_PART'" >&2; exit 2 ;;
esac
SUITE_N="${SUITE_N:-2 4 8}"
total=0; for n in $SUITE_N; do total=$(( total + n )); done
# Concurrent sessions share the GPU(s): each process gets the fair share of all
# the processes on its GPU (jax_ep.shared_gpu.fair_fraction), or
# $XLA_PYTHON_CLIENT_MEM_FRACTION when set. Side by side only while that share
# is at least SUITE_MIN_POOL_GIB (default 5.5: the suite passed with 5.9 GiB
# per process, N = 2, 4 and 8 together on an H200, and ran out of memory in
# the low-latency tests with 2.1 GiB, the same on an 80 GB H100); below it the
# sessions run one after another, each with its own N's share.
fraction() {   # fair_fraction for $1 processes on the GPU(s)
  local g=$(( NGPU > 0 ? NGPU : 1 )); local per=$(( ($1 + g - 1) / g ))
  echo "${XLA_PYTHON_CLIENT_MEM_FRACTION:-$("$PY" -c "from jax_ep import shared_gpu as s; print(s.fair_fraction($per, s.gpu_memory_bytes()))")}"
}
frac=$(fraction $total)
side_by_side=$("$PY" -c "from jax_ep import shared_gpu as s; b = s.gpu_memory_bytes(); print(int(not b or $frac * b >= ${SUITE_MIN_POOL_GIB:-5.5} * 2**30))")

run_session() {   # N, memory fraction
  local per_n="SUITE_TESTS_N$1"
  JAX_EP_TEST_NPROCS=$1 XLA_PYTHON_CLIENT_MEM_FRACTION=$2 \
    JAX_EP_GPU_TEST_TIMEOUT=${JOB_TIMEOUT:-240} \
    timeout -k 30 "${TEST_TIMEOUT:-540}" "$PY" -m pytest -m gpu ${!per_n:-${SUITE_TESTS:-$MP_TESTS}} -v -rs \
    -p no:cacheprovider --durations=15 > "$OUT/suite_n$1.log" 2>&1
}

declare -A rc
if [ "$build_rc" = 0 ] && [ "${SUITE_TESTS:-}" != none ]; then
  if [ "$side_by_side" = 1 ]; then
    echo "== multi-process suite at N = $SUITE_N side by side ($NGPU GPU(s), memory fraction $frac each)" >&2
    pids=()
    for n in $SUITE_N; do run_session $n $frac & pids+=("$n:$!"); done
    for p in "${pids[@]}"; do wait "${p#*:}"; rc[${p%%:*}]=$?; done
  else
    for n in $SUITE_N; do
      f=$(fraction $n)
      echo "== multi-process suite at N = $n ($NGPU GPU(s), memory fraction $f each)" >&2
      run_session $n $f; rc[$n]=$?
    done
  fi
fi

reh_rc=skipped
if [ "${REHEARSAL:-0}" != 0 ] && [ "$build_rc" = 0 ]; then
  echo "== multi-host rehearsal (2 launchers as 2 hosts)" >&2
  port=$("$PY" -c "from jax_ep.launch import free_port; print(free_port())")
  run2() {   # both "hosts" of one job, 2 processes each, sharing GPU 0
    local pids=() r
    for r in 0 1; do
      XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.18} timeout ${REHEARSAL_TIMEOUT:-300} "$PY" -m jax_ep.launch -n 2 --gpus 1 \
        --nnodes 2 --node-rank $r --host-id node$r --coordinator 127.0.0.1:$1 "${@:2}" &
      pids+=($!)
    done
    local bad=0; for r in "${pids[@]}"; do wait "$r" || bad=1; done; return $bad
  }
  { if [ "$REHEARSAL" != internode ]; then
      echo "== train_moe.py"; run2 "$port" examples/train_moe.py --backend native --platform gpu \
        --steps ${TRAIN_STEPS:-60} --no-comm-timing --log-every 20; echo "rc=$?"
      port=$("$PY" -c "from jax_ep.launch import free_port; print(free_port())")
    fi
    echo "== internode workers"; JAX_EP_TEST_NUM_NODES=1 JAX_EP_DEBUG_POISON=1 run2 "$port" \
      tests/gpu/rehearsal.py; echo "rc=$?"
  } > "$OUT/rehearsal.log" 2>&1
  reh_rc="$(grep -c '^rc=0' "$OUT/rehearsal.log") of $(grep -c '^rc=' "$OUT/rehearsal.log")"
  [ "$(grep -c '^rc=0' "$OUT/rehearsal.log")" = "$(grep -c '^rc=' "$OUT/rehearsal.log")" ] || reh_failed=1
fi

one_rc=skipped
if [ -n "${ONE_GPU_TESTS:-}" ] && [ "$build_rc" = 0 ]; then
  echo "== one-GPU tests" >&2
  # Several workers: no preallocation, or the first would take 75% of the GPU.
  workers=(); [ "${ONE_GPU_WORKERS:-1}" -gt 1 ] && { workers=(-n "$ONE_GPU_WORKERS"); export XLA_PYTHON_CLIENT_PREALLOCATE=false; }
  timeout -k 30 "${TEST_TIMEOUT:-540}" "$PY" -m pytest -m gpu "${workers[@]}" $ONE_GPU_TESTS -v -rs \
    -p no:cacheprovider > "$OUT/one_gpu.log" 2>&1
  one_rc=$?
fi

if [ -n "${EXTRA:-}" ] && [ "$build_rc" = 0 ]; then
  echo "== extra" >&2
  bash -c "$EXTRA" > "$OUT/extra.log" 2>&1
fi

# Failed jobs: the last lines of every rank's log (harness.py: /tmp/jax_ep_job_*/rank*.log).
for f in /tmp/jax_ep_job_*/rank*.log; do
  [ -f "$f" ] && grep -q -E "Error|FAIL|Traceback" "$f" && { echo "== $f"; tail -n 15 "$f"; }
done > "$OUT/worker_logs.log" 2>/dev/null

echo "===== gpu_check summary ====="
echo "build: rc=$build_rc (${t_build}s)  $(grep -m1 '^extension:' "$OUT/build.log")"
[ "$build_rc" = 0 ] || tail -40 "$OUT/build.log"
ok=$([ "$build_rc" = 0 ] && echo 1 || echo 0)
for n in $SUITE_N; do
  [ -f "$OUT/suite_n$n.log" ] || continue
  echo "suite N=$n: rc=${rc[$n]:-?}  $(tail -1 "$OUT/suite_n$n.log")"
  grep -E "FAILED|ERROR" "$OUT/suite_n$n.log" | grep -v "^tests.*PASSED" | tail -15
  [ "${rc[$n]:-1}" = 0 ] || ok=0
done
echo "rehearsal: $reh_rc passed"
[ "${reh_failed:-0}" = 1 ] && ok=0
[ -f "$OUT/rehearsal.log" ] && grep -E "^== |rc=|rehearsal rank|loss: start|FAIL" "$OUT/rehearsal.log" | tail -20
[ "$one_rc" = skipped ] || { echo "one-GPU tests: rc=$one_rc  $(tail -1 "$OUT/one_gpu.log")"; [ "$one_rc" = 0 ] || ok=0; }
[ -f "$OUT/extra.log" ] && tail -40 "$OUT/extra.log"
echo "total: $(( $(date +%s) - t0 ))s; logs in $OUT"
[ "$ok" = 1 ]
