#!/bin/bash
# jax_ep benchmark on this machine's GPUs (JAX_EP_TEST_NPROCS processes, default 2, one GPU each).
# Results: bench/results/<date>-h200x<N>.{md,json,png}, and a copy under $OUT
# when set (the device tool brings $OUT back).
set -o pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEST=${OUT:-bench/results}
python3 bench/ep_bench.py --nproc ${JAX_EP_TEST_NPROCS:-2} --out "$DEST" ${BENCH_ARGS:-} 2>&1 | grep -v "WatchTasks\|GRPC\|CANCELLED" | tee "$DEST/ep_bench.log"
