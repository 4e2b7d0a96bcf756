#!/bin/bash
# jax_ep benchmark on this machine's GPUs (JAX_EP_TEST_NPROCS processes, default 2, one GPU each).
# Results: bench/results/<date>-h200x<N>.{md,json,png}, and a copy under $OUT
# when set (the device tool brings $OUT back: at most 8 files, so the
# low-latency rows go into ep_bench.log too). LL_BENCH_ARGS reach the
# low-latency bench (e.g. "--ll-transport put"). Exit status: non-zero when
# any of the runs failed.
set -o pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEST=${OUT:-bench/results}
rc=0
python3 bench/ep_bench.py --nproc ${JAX_EP_TEST_NPROCS:-2} --out "$DEST" ${BENCH_ARGS:-} 2>&1 \
  | grep -v "WatchTasks\|GRPC\|CANCELLED" | tee "$DEST/ep_bench.log" || rc=1
# The low-latency (decode) mode at V3-decode, XLA command buffers off and on.
if [ "${SKIP_LL_BENCH:-0}" != 1 ]; then
  for g in "" --graphs; do
    echo "== low_latency_bench.py $g ${LL_BENCH_ARGS:-}" | tee -a "$DEST/ep_bench.log"
    timeout ${LL_BENCH_TIMEOUT:-150} python3 -m jax_ep.launch -n ${JAX_EP_TEST_NPROCS:-2} \
      bench/low_latency_bench.py $g ${LL_BENCH_ARGS:-} 2>&1 | grep -v "WatchTasks\|GRPC\|CANCELLED" \
      | tee -a "$DEST/ep_bench.log" || rc=1
  done
fi
exit $rc
