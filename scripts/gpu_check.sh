#!/usr/bin/env bash
# Build jax_ep in place on the GPU machine (no network) and run the GPU tests
# and, when present, the benchmarks. Logs go to $OUT (default /tmp/jax_ep_gpu_check).
#   bash scripts/gpu_check.sh            # JAX_EP_TEST_NPROCS=4 for 4 GPUs, etc.
# Knobs: GPU_TESTS (pytest paths, default tests/gpu), SKIP_BENCH=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/jax_ep_gpu_check}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
t0=$(date +%s)

nvidia-smi -L > "$OUT/gpus.txt" 2>&1 || true
{ "$PY" -V; "$PY" -c "import jax, jaxlib; print('jax', jax.__version__)"; nvcc --version | tail -1; } \
  > "$OUT/env.txt" 2>&1

# --no-build-isolation: the machine has no network; its nanobind, jaxlib,
# NVSHMEM wheel and scikit-build-core are used as installed.
echo "== build" >&2
"$PY" -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1
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

echo "== tests" >&2
"$PY" -m pytest -m gpu ${GPU_TESTS:-tests/gpu} -x -v -rs -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
test_rc=$?
t_test=$(( $(date +%s) - t0 - t_build ))

bench_rc=skipped
if [ -f bench/run.sh ] && [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== bench" >&2
  bash bench/run.sh > "$OUT/bench.log" 2>&1
  bench_rc=$?
fi

echo "===== gpu_check summary ====="
cat "$OUT/gpus.txt" "$OUT/env.txt"
echo "build: rc=$build_rc (${t_build}s)  $(grep -m1 '^extension:' "$OUT/build.log")"
[ "$build_rc" = 0 ] || tail -40 "$OUT/build.log"
echo "tests: rc=$test_rc (${t_test}s)  $(tail -1 "$OUT/gpu_tests.log")"
[ "$test_rc" = 0 ] || grep -E "FAILED|ERROR|Error|error" "$OUT/gpu_tests.log" | tail -30
echo "bench: rc=$bench_rc"
[ -f "$OUT/bench.log" ] && tail -20 "$OUT/bench.log"
echo "total: $(( $(date +%s) - t0 ))s; logs in $OUT"
[ "$build_rc" = 0 ] && [ "$test_rc" = 0 ]
