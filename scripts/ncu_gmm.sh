#!/usr/bin/env bash
# Hardware counters of the grouped-matmul kernels (scripts/profile_gmm.py) with
# Nsight Compute, clocks untouched. Writes $OUT/ncu_*.txt. OPS=fp8_up SASS=1:
# the fp8 kernel and the SASS blocks its instructions go to. One-GPU machines
# with counters (Firecracker runtime, .library/device/KINDS.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/ncu_gmm}"; mkdir -p "$OUT"
OPS="${OPS:-dw_up,fwd_up,dense_dw_up}"
export XLA_FLAGS="--xla_gpu_autotune_level=0" PYTHONPATH=.
M=gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
# Only the matmul kernels: XLA's small fusions (group offsets, converts) are
# skipped, each profiled kernel is replayed once per metric pass.
KF='regex:^(?!.*fusion)(?!wrapped).*'
timeout ${NCU_TIMEOUT:-240} ncu --clock-control none -k "$KF" --metrics "$M" --csv python3 scripts/profile_gmm.py "$OPS" \
  > "$OUT/ncu_metrics.csv" 2> "$OUT/ncu_stderr.txt"
echo "ncu rc=$?"
pkill -f scripts/profile_gmm.py; sleep 2   # a timed-out ncu leaves its target holding the GPU
# One pass over the CSV: the metrics of every kernel of 200 us or more, and
# the longest kernel's full name (for the second run) in ncu_longest.txt.
python3 - "$OUT/ncu_metrics.csv" "$OUT/ncu_longest.txt" <<'PY' | tee "$OUT/ncu_summary.txt"
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; rows = rows[1:]
iK, iN, iM, iU, iV = (hdr.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"))
US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
      "second": 1e6, "s": 1e6}
k = collections.OrderedDict()
for r in rows:
    k.setdefault((r[iK], r[iN]), {})[r[iM]] = (r[iV], r[iU])
def us(m):
    v, u = m.get("gpu__time_duration.sum", ("0", "usecond"))
    return float(v.replace(",", "")) * US.get(u, 1.0)
for (i, name), m in k.items():
    if us(m) < 200:
        continue
    print(f"== {i} {name[:70]}")
    for key, (v, u) in m.items():
        print(f"   {key} = {v} {u}")
if k:
    open(sys.argv[2], "w").write(max(k.items(), key=lambda kv: us(kv[1]))[0][1])
PY
# Stall reasons and memory breakdown of the longest kernel of the first run;
# SourceCounters: the SASS lines where warps stall most (a dw run
# put 37% of the stalls on a long scoreboard, which the sections alone could
# not place: producer, consumers' barrier waits or the epilogue).
name=$(cat "$OUT/ncu_longest.txt" 2>/dev/null)
echo "longest kernel: $name" | tee -a "$OUT/ncu_summary.txt"
# -k matches the function's base name ("gmm_fp8_nt_kernel" of "void
# (anonymous namespace)::gmm_fp8_nt_kernel<...>(Maps, GmmFp8Args)"): the
# full name matched nothing
name=$(python3 -c 'import re, sys; m = re.search(r"(\w+)[<(]", sys.argv[1]); print(m.group(1) if m else sys.argv[1])' "$name")
OPS1="${OPS%%,*}"
timeout ${NCU_TIMEOUT:-240} ncu --clock-control none -k "$name" --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
  --section SourceCounters --import-source no \
  python3 scripts/profile_gmm.py "$OPS1" > "$OUT/ncu_sections.txt" 2>&1
echo "ncu sections rc=$?"
grep -E "Duration|Throughput|Hit Rate|Stall|stall|Warp Cycles|Issued|Achieved|Busy|Bandwidth|Registers|Shared|Pipe|Bank|Wavefront|Location|0x" "$OUT/ncu_sections.txt" | head -120
# SASS=1: where the longest kernel's instructions go, per loop body
# (scripts/sass_counts.py; an issue-bound kernel showed it: the fp8 forward).
if [ "${SASS:-0}" = 1 ]; then
  timeout ${NCU_TIMEOUT:-240} ncu --clock-control none -o "$OUT/sass" -f -k "$name" --launch-skip 1 \
    --launch-count 1 --section SourceCounters --section InstructionStats \
    python3 scripts/profile_gmm.py "$OPS1" > /dev/null 2>&1
  ncu -i "$OUT/sass.ncu-rep" --page source --print-source sass --csv > "$OUT/sass.csv" 2>/dev/null
  python3 scripts/sass_counts.py "$OUT/sass.csv" | tee -a "$OUT/ncu_summary.txt"
fi
