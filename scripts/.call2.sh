set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT
T=tests/gpu/test_grouped_matmul_fp8_gpu.py
# HBM-scale variants first, in their own processes (a faulting kernel kills its process's context)
timeout 100 python -m pytest -q -m gpu "$T::test_fp8_kernel_variants" -k "staged_scales" -p no:cacheprovider -W ignore::DeprecationWarning > $OUT/t_hbm.log 2>&1; echo "hbm tests rc=$?"; tail -1 $OUT/t_hbm.log
OUT=$OUT timeout 150 python bench/grouped_matmul_fp8_bench.py --reps 5 --sweep --proj up --kinds uniform --kw '{"staged_scales": false}' > $OUT/b_hbm.log 2>&1; echo "bench hbm rc=$?"; grep "^|" $OUT/b_hbm.log
timeout 100 python -m pytest -q -m gpu $T -p no:cacheprovider -W ignore::DeprecationWarning > $OUT/t_all.log 2>&1; echo "all tests rc=$?"; grep -E "^E  .*Error|passed|failed" $OUT/t_all.log | sort | uniq -c | cut -c1-250 | tail -6
OUT=$OUT timeout 200 python bench/grouped_matmul_fp8_bench.py --reps 5 --sweep > $OUT/b_staged.log 2>&1; echo "bench staged rc=$?"; grep "^|" $OUT/b_staged.log
