"""MoE layer forward+backward: jax_ep beside the best XLA-only layer, one table.

The layer is ``examples/moe_layer.py``'s block (router, shared expert, routed
SwiGLU experts between dispatch and combine). Routed and shared experts use a
fused gate_up weight ``[E, H, 2F]`` (shared: ``[H, 2S]``). Implementations (``--impls``):

* ``jax_ep``: jax_ep's native dispatch/combine (NVSHMEM kernels; the reference
  backend on CPU) + ``jax_ep.grouped_matmul`` experts (``expert_impl="grouped"``),
  ``expert_major`` layout at the default capacity.
* ``xla_padded``: the reference backend (XLA's dense ``all_to_all``) + padded
  batched-matmul experts at ``--expert-capacity-factor`` (2) times the mean rows
  per expert (overflow dropped and counted).
* ``xla_ragged``: the reference backend + ``jax.lax.ragged_dot`` experts, with
  ``--xla_gpu_experimental_use_ragged_dot_fusion=true`` on GPUs. Slow, and it
  runs out of memory at DeepSeek-V3 sizes: by default only up to
  ``--ragged-max-tokens`` (V3: 1024), under ``--ragged-timeout``; "OOM" /
  "timeout" go into the table instead of stopping the run.
* ``jax_ep_padded`` (optional): jax_ep dispatch/combine + padded experts.
* ``jax_ep_fp8`` (optional; ``--impls jax_ep,jax_ep_fp8,xla_padded``): the
  layer as DeepSeek-V3 runs it: fp8 dispatch -> fp8 grouped matmul experts
  (``expert_impl="grouped_fp8"``: the weights quantized to 128 x 128 blocks
  inside the step, in the same jit) -> bf16 combine. Needs hidden and d_ff
  divisible by 128 (the tiny preset: ``--hidden 128 --d-ff 128``). Its
  experts run the fp8 kernel on Hopper where it compiles, else the
  dequantizing reference (a warning says so). The summary gives its layer
  time against jax_ep's bf16 layer.
* ``jax_ep_fp8_wq`` (optional): the same with the expert weights quantized
  once in both layouts, outside the timed steps (``moe_layer.quantize_experts``
  -> ``moe_block(experts_fp8=...)``, the forward reading the K-major copy
  through ``grouped_matmul(w_transposed=...)``): what a step pays when one
  quantization serves several micro-batches (the gradients still reach the
  bf16 weights).

The faster XLA layer of each (config, T) is the baseline.

Configs (``--configs``): ``v3`` (H 7168, E 256, top-8, group-limited routing
8 groups / best 4, SwiGLU d_ff 2048, one shared expert; T in 128, 1024, 4096,
8192 tokens per rank), ``mixtral`` (H 4096, E 8, top-2 softmax, d_ff 14336, no
shared expert; T 4096; at EP 2 each rank holds L = 4 experts), ``tiny`` (CPU
smoke). ``--tokens`` replaces the T list of every selected config.

Per (config, T, impl) one job (its own processes, so the peak-memory figure is
that job's alone): the fwd+bwd step time and its split — dispatch+combine
fwd+bwd alone (identity experts, the layer's routing), the routed expert
matmuls fwd+bwd alone (on that routing's dispatched rows), and the rest
(router, shared expert, glue = layer - both) — tokens/s per GPU, and
``device.memory_stats()['peak_bytes_in_use']`` after the layer's timing (JAX's
allocator; jax_ep's NVSHMEM heap is extra and listed in the notes).

Timing: every figure is device time per step of chained steps inside one jit
(a ``fori_loop`` whose step i+1 takes step i's input gradient and touched
parameters, so nothing is hoisted out of the loop; parameters and gradients are
carried and donated, as in training). Per step = median over reps of
``(t(n_hi) - t(n_lo)) / (n_hi - n_lo)`` for calls of n_lo and n_hi chained
steps (interleaved), which cancels the fixed per-call costs (host dispatch,
argument handling). Random data, after warm-up; never a host-timed single call.
The layer and expert loops take n as an argument (one compile; XLA then checks
the loop condition on the host once per step, ~tens of µs against steps of
milliseconds); dispatch+combine, which is short, gets static trip counts (two
compiles; ``--static-loops`` does that everywhere). An xla_ragged job takes its
d+c from xla_padded's job (the same XLA dispatch).

``--expert-breakdown`` (jax_ep's grouped experts only) additionally times, by
the same method and on the job's real dispatched rows and group sizes, each
grouped matmul alone (gate_up/down x fwd, dx = ``gmm(..., transpose_rhs=True)``,
dw = ``tgmm``), the SwiGLU elementwise fwd+bwd, and the whole experts fwd alone
and fwd+bwd in the same chain, and reports the routing's group-size statistics
beside those of bench/grouped_matmul_bench.py's "uniform"/"skewed" sizes (an
extra table and ``breakdown`` in the JSON; ~10 more compiles per job)::

    python -m jax_ep.launch -n 2 bench/moe_layer_step.py --configs v3 --tokens 4096 \
        --impls jax_ep --expert-breakdown

``--profile`` traces one call of each job's layer chain (``jax.profiler``) and
adds a table of its kernels' device time per step, per (kernel, HLO op),
largest first (``bench/device_trace.py``): where a step's time goes.
``--gmm-tiles 'fwd=bm,bn,bk,stages,band;dx=...'`` runs the jax_ep jobs with
those grouped-matmul tiles (a ``GroupedMatmulConfig``), to compare tiles in
the layer rather than standalone.

Run (one process per GPU through the launcher; rank 0 runs the jobs)::

    python -m jax_ep.launch -n 2 bench/moe_layer_step.py            # everything, <= 8 min
    python bench/moe_layer_step.py -n 2                              # the same
    python -m jax_ep.launch -n 2 bench/moe_layer_step.py --configs v3 --tokens 4096 --skip-ragged

Results: a markdown table on stdout, and ``moe_layer_step.{md,json,png}`` in
``--out`` (default ``$OUT`` when set). ``--merge old.json`` reuses the jobs of
an earlier run (to split the sweep over several calls). CPU smoke (tiny shapes)::

    python bench/moe_layer_step.py --smoke                           # 1 process, 2 CPU devices
    python -m jax_ep.launch -n 2 --platform cpu bench/moe_layer_step.py --smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import types
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PRESETS = {
    "v3": dict(hidden=7168, d_ff=2048, experts=256, topk=8, n_groups=8, topk_groups=4,
               n_shared=1, score_func="sigmoid", route_scale=2.5, tokens=[128, 1024, 4096, 8192],
               ragged_max_tokens=1024),
    "mixtral": dict(hidden=4096, d_ff=14336, experts=8, topk=2, n_groups=1, topk_groups=1,
                    n_shared=0, score_func="softmax", route_scale=1.0, tokens=[4096],
                    ragged_max_tokens=4096),
    "tiny": dict(hidden=64, d_ff=32, experts=8, topk=2, n_groups=4, topk_groups=2, n_shared=1,
                 score_func="sigmoid", route_scale=2.5, tokens=[16, 64], ragged_max_tokens=64),
}
IMPLS = {  # name -> (jax_ep backend on GPUs, expert_impl, label)
    "jax_ep": ("native", "grouped", "jax_ep: dispatch/combine + grouped matmul"),
    "jax_ep_padded": ("native", "padded", "jax_ep: dispatch/combine + padded matmul"),
    "jax_ep_fp8": ("native", "grouped_fp8",
                   "jax_ep: fp8 dispatch + fp8 grouped matmul (weights quantized in the step) "
                   "+ bf16 combine"),
    "jax_ep_fp8_wq": ("native", "grouped_fp8",
                      "jax_ep_fp8 with the weights quantized once, outside the step"),
    "xla_padded": ("reference", "padded", "XLA: all_to_all + padded batched matmul"),
    "xla_ragged": ("reference", "ragged_dot", "XLA: all_to_all + ragged_dot"),
}
XLA_IMPLS = ("xla_padded", "xla_ragged")
RAGGED_XLA_FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion=true"
SHAPE_KEYS = ("hidden", "d_ff", "experts", "topk", "n_groups", "topk_groups", "n_shared",
              "route_scale")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="MoE layer fwd+bwd: jax_ep beside the XLA-only layers (one table)")
    p.add_argument("--configs", default="v3,mixtral", help="comma list of " + ",".join(PRESETS))
    p.add_argument("--tokens", default=None,
                   help="comma list of tokens per rank T for every config (default per config: "
                        "v3 128,1024,4096,8192; mixtral 4096)")
    p.add_argument("--impls", default="jax_ep,xla_padded,xla_ragged",
                   help="comma list of " + ",".join(IMPLS))
    p.add_argument("--skip-ragged", action="store_true", help="drop xla_ragged")
    p.add_argument("--ragged-max-tokens", type=int, default=None,
                   help="run xla_ragged only up to this T (default: v3 1024, mixtral 4096)")
    p.add_argument("--ragged-timeout", type=float, default=100.0,
                   help="seconds an xla_ragged job may take before it is killed (\"timeout\")")
    p.add_argument("--job-timeout", type=float, default=240.0, help="seconds for any other job")
    p.add_argument("--deadline", type=float, default=470.0,
                   help="seconds for the whole run: jobs that cannot start in time are "
                        "reported as skipped (0 = none)")
    p.add_argument("-n", "--nproc", type=int, default=None,
                   help="processes per job through jax_ep.launch (default: under the launcher "
                        "its process count; else the GPUs; on CPU 0 = one process with "
                        "--cpu-devices fake devices)")
    p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--cpu-devices", type=int, default=2,
                   help="CPU devices of a one-process CPU job (with -n 0)")
    p.add_argument("--data", type=int, default=1, help="data axis size (ep = devices / data)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke test: --configs tiny, few reps (tiny shapes)")
    for k in SHAPE_KEYS:
        p.add_argument("--" + k.replace("_", "-"), type=(float if k == "route_scale" else int),
                       default=None, help=f"override the preset's {k}")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--capacity", type=int, default=None,
                   help="EpConfig.capacity of jax_ep (default: the library default)")
    p.add_argument("--expert-alignment", type=int, default=None)
    p.add_argument("--num-sms", type=int, default=None)
    p.add_argument("--buffer-bytes", type=int, default=None,
                   help="NVSHMEM buffer per process (default: sized from the config)")
    p.add_argument("--expert-capacity-factor", type=float, default=2.0,
                   help="padded experts: rows per local expert = factor * R*T*K/E, rounded "
                        "up to 8 (overflow dropped and counted)")
    p.add_argument("--steps", default="1,4",
                   help="n_lo,n_hi chained steps per timed call (layer and experts)")
    p.add_argument("--comm-steps", default="2,8",
                   help="n_lo,n_hi for dispatch+combine (static trip counts)")
    p.add_argument("--min-time", type=float, default=1.5,
                   help="seconds of timed calls per measurement (sets the reps)")
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--max-reps", type=int, default=40)
    p.add_argument("--static-loops", action="store_true",
                   help="static trip counts everywhere (two compiles per measurement; a "
                        "dynamic while loop syncs with the host once per step)")
    p.add_argument("--no-split", action="store_true", help="time the whole layer only")
    p.add_argument("--gmm-tiles", default=None,
                   help="grouped-matmul config of the jax_ep jobs, e.g. 'fwd=64,128,64,4,2;"
                        "dw=64,128,64,5,4;fwd_warpgroups=1' (GroupedMatmulConfig fields: tiles "
                        "and its int knobs; default: its defaults)")
    p.add_argument("--profile", action="store_true",
                   help="also trace one call of the layer chain (jax.profiler) and print its "
                        "kernels' device time per step, largest first (bench/device_trace.py)")
    p.add_argument("--expert-breakdown", action="store_true",
                   help="jax_ep (grouped experts) jobs: also time each grouped matmul alone "
                        "(gate_up/down x fwd/dx/dw), the SwiGLU elementwise fwd+bwd and the "
                        "experts fwd alone, on the job's real dispatched rows, and report the "
                        "routing's group-size statistics (an extra table)")
    p.add_argument("--out", default=os.environ.get("OUT") or None,
                   help="write moe_layer_step.{md,json,png} here (default $OUT)")
    p.add_argument("--merge", default=None,
                   help="moe_layer_step.json of an earlier run: reuse its successful jobs "
                        "(the others run)")
    p.add_argument("--keep-logs", action="store_true", help="print every job's log")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)  # worker: the job spec
    args = p.parse_args(argv)
    args.gmm_fields = _parse_gmm_tiles(args.gmm_tiles)   # a bad one stops here, before any job
    if args.smoke:
        if args.configs == "v3,mixtral":
            args.configs = "tiny"
        args.min_time, args.min_reps, args.max_reps = 0.2, 3, 5
    return args


# =============================================================================== orchestrator


def _under_launcher() -> bool:
    return "JAX_EP_NUM_PROCESSES" in os.environ


def _detect_gpus() -> int:
    return len([q for q in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", q)])


def _ints(s):
    return [int(v) for v in str(s).split(",") if v.strip()]


def plan_jobs(args, platform):
    """-> list of job dicts (name, config, T, impl, model shapes, ...), in run order:
    every non-ragged job first, the xla_ragged ones (likely to fail) last."""
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for i in impls:
        if i not in IMPLS:
            raise SystemExit(f"unknown impl {i!r}; choose from {', '.join(IMPLS)}")
    if args.skip_ragged:
        impls = [i for i in impls if i != "xla_ragged"]
    jobs, ragged = [], []
    for cname in [c.strip() for c in args.configs.split(",") if c.strip()]:
        if cname not in PRESETS:
            raise SystemExit(f"unknown config {cname!r}; choose from {', '.join(PRESETS)}")
        pre = dict(PRESETS[cname])
        model = {k: pre[k] for k in SHAPE_KEYS + ("score_func",)}
        for k in SHAPE_KEYS:
            if getattr(args, k) is not None:
                model[k] = getattr(args, k)
        tokens = _ints(args.tokens) if args.tokens else pre["tokens"]
        rmax = args.ragged_max_tokens if args.ragged_max_tokens is not None \
            else pre["ragged_max_tokens"]
        for T in tokens:
            for impl in impls:
                be, experts, _ = IMPLS[impl]
                job = {"name": f"{cname}/T{T}/{impl}", "config": cname, "T": T, "impl": impl,
                       "backend": be if platform == "gpu" else "reference",
                       "experts_impl": experts, "model": model}
                if impl == "xla_ragged" and T > rmax:
                    job["skipped"] = f"T > {rmax} (--ragged-max-tokens)"
                if experts == "grouped_fp8" and (model["hidden"] % 128 or model["d_ff"] % 128):
                    job["skipped"] = "fp8 needs hidden and d_ff divisible by 128"
                if impl == "xla_ragged" and "xla_padded" in impls:
                    job["comm_from"] = f"{cname}/T{T}/xla_padded"  # the same XLA dispatch
                (ragged if impl == "xla_ragged" else jobs).append(job)
    return jobs + ragged


def _job_env(platform, nproc, cpu_devices, extra_xla_flags=""):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_EP_")}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        if nproc == 0:
            flags += f" --xla_force_host_platform_device_count={cpu_devices}"
    flags = " ".join((flags + " " + extra_xla_flags).split())
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env


def _classify_failure(log_text: str) -> str:
    low = log_text.lower()
    if ("resource_exhausted" in low or "out of memory" in low or "oom" in low.split()
            or "failed to allocate" in low):
        return "OOM"
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"(Error|Exception|error:|FAILED)", ln)]
    tail = (errs or lines or ["no output"])[-1]
    tail = re.sub(r"^\[rank \d+\]\s*", "", tail)
    return "error: " + tail[:160]


class _Stopped(Exception):
    """SIGTERM/SIGINT to the orchestrator: stop the job, report what is done."""


def _on_signal(sig, _frame):
    raise _Stopped(signal.Signals(sig).name)


def _kill_group(proc, term_wait=8.0):
    """SIGTERM to the job's process group (a launcher passes it on to its ranks and
    kills them after its --grace), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, term_wait), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


INT_GMM_FIELDS = ("dw_warpgroups", "fwd_warpgroups", "dw_cluster",   # GroupedMatmulConfig ints
                  "fp8_cluster")
STR_GMM_FIELDS = ("dw_pipeline", "fp8_kernel", "fp8_dx_cast")       # and strings
BOOL_GMM_FIELDS = ("fp8_dx", "fp8_dw", "fp8_tma_store")               # and bools (0/1)


def _parse_gmm_tiles(text):
    """'fwd=64,128,64,4,2;dx=...;fwd_warpgroups=1' -> {field: [5 ints] | int}
    (None: the defaults; GroupedMatmulConfig checks the values)."""
    if not text:
        return None
    out = {}
    for part in filter(None, (t.strip() for t in text.split(";"))):
        op, _, vals = part.partition("=")
        op = op.strip()
        try:
            nums = [int(v) for v in vals.split(",")]
        except ValueError:
            nums = []
        if op in STR_GMM_FIELDS and vals.strip():
            out[op] = vals.strip()
        elif op in INT_GMM_FIELDS and len(nums) == 1:
            out[op] = nums[0]
        elif op in BOOL_GMM_FIELDS and nums in ([0], [1]):
            out[op] = bool(nums[0])
        elif op in ("fwd", "dx", "dw") and len(nums) == 5:
            out[op] = nums
        else:
            raise SystemExit(f"--gmm-tiles: bad entry {part!r} (op=bm,bn,bk,stages,band "
                             f"for fwd/dx/dw, one of {', '.join(INT_GMM_FIELDS)}=int, "
                             f"{', '.join(BOOL_GMM_FIELDS)}=0|1, or "
                             f"{', '.join(STR_GMM_FIELDS)}=name)")
    return out


def _job_spec(args, job):
    """The job's spec file contents: the job plus the run-wide options."""
    spec = dict(job)
    spec.update({
        "dtype": args.dtype, "data": args.data, "capacity": args.capacity,
        "expert_alignment": args.expert_alignment, "num_sms": args.num_sms,
        "buffer_bytes": args.buffer_bytes, "expert_capacity_factor": args.expert_capacity_factor,
        "steps": _ints(args.steps), "comm_steps": _ints(args.comm_steps),
        "min_time": args.min_time, "min_reps": args.min_reps, "max_reps": args.max_reps,
        "static_loops": args.static_loops, "split": not args.no_split,
        "skip_comm": bool(job.get("comm_from")),
        "expert_breakdown": bool(getattr(args, "expert_breakdown", False)),
        "profile": bool(getattr(args, "profile", False)),
        "gmm_tiles": getattr(args, "gmm_fields", None),
    })
    return spec


def _spawn_job(cmd, env, log_path, timeout):
    """Runs cmd with its output in log_path. -> (rc, timed out, wall seconds, log text)."""
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        except _Stopped:  # be quick: an outer launcher kills this process after its grace
            _kill_group(proc, term_wait=3.5)
            raise
    wall = time.monotonic() - t0
    with open(log_path, errors="replace") as f:
        log_text = f.read()
    return rc, timed_out, wall, log_text


def _merge_rank_results(res, result_prefix):
    """Rank 0's figures, the peaks' max over ranks and the first error of any rank."""
    ranks = []
    for path in sorted(glob.glob(result_prefix + ".rank*.json")):
        try:
            with open(path) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            pass
    ranks.sort(key=lambda r: r.get("rank", 0))
    if not ranks:
        return
    r0 = ranks[0]
    for k, v in r0.items():
        if k not in ("rank", "peak_bytes", "peak_bytes_layer", "error", "stage_error"):
            res[k] = v
    peaks = [r.get("peak_bytes_layer") for r in ranks if r.get("peak_bytes_layer")]
    res["peak_bytes_layer"] = max(peaks) if peaks else None
    peaks = [r.get("peak_bytes") for r in ranks if r.get("peak_bytes")]
    res["peak_bytes"] = max(peaks) if peaks else None
    for key in ("error", "stage_error"):
        errs = [r[key] for r in ranks if r.get(key)]
        if errs:
            res[key] = errs[0]


def run_job(args, job, platform, nproc, timeout, workdir):
    """Runs one job in its own process(es); -> the job dict with its results."""
    spec = _job_spec(args, job)
    tag = job["name"].replace("/", "_")
    spec_path = os.path.join(workdir, tag + ".spec.json")
    spec["result"] = os.path.join(workdir, tag + ".result")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    extra = RAGGED_XLA_FLAG if (job["impl"] == "xla_ragged" and platform == "gpu") else ""
    env = _job_env(platform, nproc, args.cpu_devices, extra)
    if nproc == 0:
        cmd = [sys.executable, "-u", os.path.abspath(__file__), "--job", spec_path]
    else:
        cmd = [sys.executable, "-u", "-m", "jax_ep.launch", "-n", str(nproc), "--platform",
               platform, "--grace", "3", os.path.abspath(__file__), "--job", spec_path]
    rc, timed_out, wall, log_text = _spawn_job(cmd, env, os.path.join(workdir, tag + ".log"),
                                               timeout)
    res = dict(job)
    res["wall_s"] = wall
    _merge_rank_results(res, spec["result"])
    if timed_out and res.get("layer_s"):
        res["stage_error"] = f"timeout ({timeout:.0f} s) in {res.get('stage', '?')}"
    elif timed_out:
        res["error"] = f"timeout ({timeout:.0f} s)"
    elif rc != 0 and not (res.get("error") or res.get("stage_error")):
        res["error"] = _classify_failure(log_text)
    if res.get("error") or args.keep_logs:
        print(f"---- log of {job['name']} (rc={rc}{', killed' if timed_out else ''}), "
              f"last lines:", flush=True)
        keep = [ln for ln in log_text.splitlines()
                if not re.search(r"WatchTasks|GRPC|CANCELLED|coordination_service", ln)]
        print("\n".join(keep if args.keep_logs else keep[-12:]), flush=True)
    return res


def _ms(v):
    return None if v is None else 1e3 * v


def _fmt(v, nd=2):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return f"{v:,.{nd}f}"


def _tf(v):
    return _fmt(v, 0 if v is not None and v >= 100 else 3)


def make_table(results, meta):
    """-> (markdown text, per-(config, T) summary)."""
    groups = {}
    for r in results:
        groups.setdefault((r["config"], r["T"]), []).append(r)
    summary = []
    L = [f"# MoE layer forward+backward — {meta['machine']}, {meta['date']}", "",
         f"`{meta['command']}`", "",
         f"{meta['devices']} device(s), {meta['nproc_desc']}; {meta['dtype']}; jax "
         f"{meta.get('jax', '?')}. Per-step device time of chained fwd+bwd steps in one jit "
         "(median over reps of (t(n_hi) - t(n_lo)) / (n_hi - n_lo)); d+c = dispatch+combine "
         "fwd+bwd alone, experts = routed expert matmuls fwd+bwd alone, rest = layer - d+c - "
         "experts; tokens/s per GPU; peak = JAX allocator peak per process (max over ranks) "
         "after the layer's timing. 'vs best XLA' = best XLA layer time / this layer's time.",
         "",
         "| layer | T/rank | impl | fwd+bwd (ms) | d+c (ms) | experts (ms) | rest (ms) "
         "| expert TF/s | tokens/s/GPU | peak (GiB) | vs best XLA | dropped | notes |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (cname, T), rows in groups.items():
        ok = {r["impl"]: r for r in rows if r.get("layer_s") and not r.get("error")}
        xla = [ok[i] for i in XLA_IMPLS if i in ok]
        best = min(xla, key=lambda r: r["layer_s"]) if xla else None
        s = {"config": cname, "T": T, "baseline": best["impl"] if best else None,
             "baseline_ms": _ms(best["layer_s"]) if best else None}
        losses = [r["loss"] for r in ok.values() if r.get("loss") is not None]
        if len(losses) >= 2:  # same layer, same data: the impls must agree
            s["loss_rel_diff"] = (max(losses) - min(losses)) / max(1e-30, max(map(abs, losses)))
        for r in rows:
            notes = []
            if r.get("skipped"):
                notes.append("skipped: " + r["skipped"])
            if r.get("error"):
                notes.append(r["error"])
            if r is best:
                notes.append("**baseline**")
            if r.get("backend") == "reference" and r["impl"].startswith("jax_ep"):
                notes.append("reference backend")
            if r.get("nvshmem_bytes") and r.get("backend") == "native":
                notes.append(f"+{r['nvshmem_bytes'] / 2**30:.2f} GiB NVSHMEM heap")
            if r.get("gmm_tiles_used"):
                notes.append("gmm tiles " + r["gmm_tiles_used"])
            if r.get("expert_capacity"):
                notes.append(f"{r['expert_capacity']} rows/expert")
            if r.get("stage_error"):
                notes.append(r["stage_error"])
            if r.get("comm_note"):
                notes.append(r["comm_note"])
            speed = None
            if best is not None and r.get("layer_s") and not r.get("error"):
                speed = best["layer_s"] / r["layer_s"]
                if r["impl"] == "jax_ep":
                    s["jax_ep_ms"] = _ms(r["layer_s"])
                    s["speedup"] = speed
            fp8_key = {"jax_ep_fp8": "fp8", "jax_ep_fp8_wq": "fp8_wq"}.get(r["impl"])
            if fp8_key and r.get("layer_s") and not r.get("error"):
                s[f"{fp8_key}_ms"] = _ms(r["layer_s"])
                if ok.get("jax_ep"):   # the measure: fp8 layer vs our bf16 layer
                    s[f"{fp8_key}_vs_bf16"] = ok["jax_ep"]["layer_s"] / r["layer_s"]
            peak = r.get("peak_bytes_layer")
            L.append(
                f"| {cname} | {T} | {r['impl']} | {_fmt(_ms(r.get('layer_s')))} "
                f"| {_fmt(_ms(r.get('comm_s')), 3)} | {_fmt(_ms(r.get('experts_s')))} "
                f"| {_fmt(_ms(r.get('rest_s')))} | {_tf(r.get('experts_tflops'))} "
                f"| {_fmt(r.get('tokens_per_s'), 0)} "
                f"| {_fmt(peak / 2**30 if peak else None, 1)} "
                f"| {(f'{speed:.2f}x' if speed else '—')} "
                f"| {r.get('dropped', '—') if r.get('layer_s') else '—'} | {'; '.join(notes)} |")
        summary.append(s)
    L.append("")
    L += _summary_md(summary)
    labels = "; ".join(f"{k} = {v[2]}" for k, v in IMPLS.items())
    L += ["", f"impls: {labels}. xla_ragged runs with `{RAGGED_XLA_FLAG}` on GPUs.",
          "Peak memory excludes jax_ep's NVSHMEM symmetric heap (outside JAX's allocator)."]
    L += _breakdown_md(results)
    L += _profile_md(results)
    return "\n".join(L) + "\n", summary


def _summary_md(summary):
    """One line per (config, T): jax_ep against the best XLA layer, and the fp8
    layer against jax_ep's bf16 one."""
    L = []
    for s in summary:
        if s.get("speedup"):
            L.append(f"- {s['config']} T={s['T']}: jax_ep {s['jax_ep_ms']:.2f} ms vs best XLA "
                     f"({s['baseline']}) {s['baseline_ms']:.2f} ms: **{s['speedup']:.2f}x**"
                     + (f"; step-1 loss max rel. diff across impls {s['loss_rel_diff']:.1e}"
                        if s.get("loss_rel_diff") is not None else ""))
        for key, impl in (("fp8", "jax_ep_fp8"), ("fp8_wq", "jax_ep_fp8_wq")):
            if s.get(f"{key}_vs_bf16"):
                L.append(f"- {s['config']} T={s['T']}: {impl} {s[f'{key}_ms']:.2f} ms: "
                         f"**{s[f'{key}_vs_bf16']:.2f}x** jax_ep's bf16 layer")
    return L


def _stats_md(g):
    return (f"{g['valid_rows']:,} of {g['rows']:,} rows in {g['groups']} groups, rows/group "
            f"min/mean/max {g['min']}/{g['mean']:.1f}/{g['max']} (std {g['std']:.1f}, "
            f"{g['empty']} empty), {g['ends_inside_block']} group ends inside a row block; "
            f"fwd/dx row tiles {g['row_tiles']} (ideal {g['ideal_row_tiles']}, +"
            f"{g['tail_row_tiles']} tail tiles stored as zeros); dw k-steps {g['dw_ksteps']} "
            f"(ideal {g['ideal_dw_ksteps']})")


MATMUL_PARTS = ("gate_up", "down")  # the --expert-breakdown pieces that are grouped matmuls


def _profile_md(results):
    """The --profile section: each job's kernels per layer step."""
    done = [r for r in results if r.get("profile")]
    if not done:
        return []
    sys.path.insert(0, HERE)
    import device_trace

    L = ["", "## Kernels per layer step (`--profile`: one traced call of the chain)", ""]
    for r in done:
        L += device_trace.table_md(f"{r['config']} T={r['T']} {r['impl']}", r["profile"],
                                   1e6 * r["layer_s"] if r.get("layer_s") else None)
    return L


def _breakdown_md(results):
    """The --expert-breakdown section (empty without breakdowns: default output unchanged)."""
    done = [r for r in results if r.get("breakdown", {}).get("ops")]
    if not done:
        return []
    L = ["", "## Expert breakdown (`--expert-breakdown`)", "",
         "Each piece of the grouped-matmul experts fwd+bwd timed alone on the job's real "
         "dispatched rows and group sizes, same method as above (chained calls in one jit, "
         "traced counts, median; max over ranks). gate_up: [rows, H] x [L, H, 2F]; down: "
         "[rows, F] x [L, F, H]; dx = dy @ w[g]^T (`gmm(..., transpose_rhs=True)`), dw = "
         "x[g]^T @ dy[g] (`tgmm`); TF/s = useful FLOPs (valid rows) / time. 'experts "
         "fwd+bwd (chain)' = the vjp in the same barrier chain as the pieces; 'experts "
         "column' = the table's experts figure.", "",
         "| layer | T/rank | part | op | ms | TF/s | ms per rank | notes |",
         "|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in done:
        bd, c, T = r["breakdown"], r["config"], r["T"]
        for o in bd["ops"]:
            L.append(f"| {c} | {T} | {o['part']} | {o['op']} | {_fmt(o['ms'], 3)} "
                     f"| {_tf(o.get('tflops'))} "
                     f"| {' / '.join(_fmt(v, 3) for v in o.get('ms_ranks', []))} | |")
        if bd.get("parts_ms") is not None:
            n_mm = sum(o["part"] in MATMUL_PARTS for o in bd["ops"])
            L.append(f"| {c} | {T} | {n_mm} grouped matmuls | sum "
                     f"| {_fmt(bd['matmuls_ms'], 3)} "
                     f"| | | |")
            L.append(f"| {c} | {T} | + swiglu | sum of parts | {_fmt(bd['parts_ms'], 3)} "
                     f"| | | |")
            L.append(f"| {c} | {T} | experts column | fwd+bwd | {_fmt(bd['experts_ms'], 3)} "
                     f"| {_tf(r.get('experts_tflops'))} | | column − sum of parts = "
                     f"{_fmt(bd['experts_ms'] - bd['parts_ms'], 3)} ms |")
        for i, g in enumerate(bd.get("group_stats", [])):
            notes.append(f"- {c} T={T} routing, rank {i}: {_stats_md(g)}.")
        if bd.get("wall_s") is not None:
            notes.append(f"- {c} T={T}: breakdown took {bd['wall_s']:.0f} s "
                         f"(row block {bd['block_m']}, dw k-step {bd['dw_block_k']}).")
    ref = next((r["breakdown"]["standalone"] for r in done if r["breakdown"].get("standalone")),
               {})
    for k, g in ref.items():
        notes.append(f"- for comparison, bench/grouped_matmul_bench.py '{k}' (one GPU, "
                     f"per-rank V3 shapes at EP 2): {_stats_md(g)}.")
    return L + [""] + notes


def make_plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"(no plot: matplotlib unavailable: {e})")
        return False
    configs = list(dict.fromkeys(r["config"] for r in results))
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4.5), squeeze=False)
    for ax, cname in zip(axes[0], configs):
        for ci, impl in enumerate(IMPLS):
            pts = sorted((r["T"], 1e3 * r["layer_s"]) for r in results
                         if r["config"] == cname and r["impl"] == impl and r.get("layer_s")
                         and not r.get("error"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl, color=f"C{ci}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank T")
        ax.set_ylabel("layer fwd+bwd (ms per step)")
        ax.set_title(f"MoE layer '{cname}'")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def orchestrate(args):
    if _under_launcher():  # `python -m jax_ep.launch -n N bench/moe_layer_step.py`
        if int(os.environ.get("JAX_EP_PROCESS_ID", "0")) != 0:
            return 0  # rank 0 runs the jobs, each in processes of its own
        platform = os.environ.get("JAX_EP_PLATFORM", "gpu")
        nproc = args.nproc if args.nproc is not None else int(os.environ["JAX_EP_NUM_PROCESSES"])
    else:
        platform = args.platform
        if platform == "auto":
            platform = "cpu" if args.smoke or _detect_gpus() == 0 else "gpu"
        nproc = args.nproc if args.nproc is not None else (_detect_gpus() if platform == "gpu"
                                                           else 0)
    if args.platform != "auto":
        platform = args.platform
    if platform == "gpu" and nproc == 0:
        raise SystemExit("GPU jobs run one process per GPU: give -n <GPUs>")
    jobs = plan_jobs(args, platform)
    merged = {}
    if args.merge:
        with open(args.merge) as f:
            for r in json.load(f).get("results", []):
                if r.get("layer_s") and not r.get("error"):  # failed jobs run again
                    merged[r["name"]] = r
    t_start = time.monotonic()
    date = datetime.date.today().isoformat()
    nproc_desc = (f"{nproc} process(es) per job" if nproc else
                  f"1 process per job ({args.cpu_devices} CPU devices)")
    print(f"moe_layer_step: {len(jobs)} jobs on {platform}, {nproc_desc}", flush=True)
    results = []
    meta = {"date": date, "machine": "?", "devices": "?", "dtype": args.dtype,
            "nproc_desc": nproc_desc, "platform": platform,
            "command": "python bench/moe_layer_step.py " + shlex.join(sys.argv[1:])}
    if _under_launcher():
        meta["command"] = (f"python -m jax_ep.launch -n {os.environ['JAX_EP_NUM_PROCESSES']} "
                           f"bench/moe_layer_step.py " + shlex.join(sys.argv[1:]))
    workdir = tempfile.mkdtemp(prefix="moe_layer_step.")
    old = {sg: signal.signal(sg, _on_signal) for sg in (signal.SIGTERM, signal.SIGINT)}
    try:
        _run_all(args, jobs, merged, results, meta, platform, nproc, workdir, t_start)
        stopped = None
    except _Stopped as e:
        stopped = str(e)
        done = {r["name"] for r in results}
        results += [dict(j, skipped=f"run stopped ({stopped})") for j in jobs
                    if j["name"] not in done]
    finally:
        for sg, h in old.items():
            signal.signal(sg, h)
    table, summary = _write(args, results, meta, final=True)
    print()
    print(table, flush=True)
    print(f"moe_layer_step: {time.monotonic() - t_start:.0f} s"
          + (f"; stopped by {stopped}" if stopped else ""), flush=True)
    if stopped:
        return 143
    failed_native = [r for r in results if r["impl"].startswith("jax_ep") and r.get("error")]
    return 1 if failed_native else 0


def _run_all(args, jobs, merged, results, meta, platform, nproc, workdir, t_start):
    for k, job in enumerate(jobs):
        t_used = time.monotonic() - t_start
        head = f"[{k + 1}/{len(jobs)}] {job['name']}"
        if job["name"] in merged:
            res = merged[job["name"]]
            res["merged"] = True
            print(f"{head}: from {args.merge}", flush=True)
        elif job.get("skipped"):
            res = dict(job)
            print(f"{head}: skipped ({job['skipped']})", flush=True)
        else:
            timeout = args.ragged_timeout if job["impl"] == "xla_ragged" else args.job_timeout
            if args.deadline:
                left = args.deadline - t_used
                if left < min(30.0, timeout):
                    res = dict(job, skipped=f"time budget (--deadline {args.deadline:.0f} s)")
                    print(f"{head}: skipped ({res['skipped']})", flush=True)
                    results.append(res)
                    continue
                timeout = min(timeout, left)
            res = run_job(args, job, platform, nproc, timeout, workdir)
            src = next((r for r in results if r["name"] == job.get("comm_from")), None)
            if res.get("layer_s") and "comm_s" not in res and src and src.get("comm_s"):
                res["comm_s"] = src["comm_s"]
                res["comm_note"] = f"d+c of {src['impl']}"
                if res.get("experts_s") is not None:
                    res["rest_s"] = res["layer_s"] - res["comm_s"] - res["experts_s"]
            if res.get("layer_s"):
                print(f"{head}: {1e3 * res['layer_s']:.3f} ms/step (d+c "
                      f"{_fmt(_ms(res.get('comm_s')), 3)}, experts "
                      f"{_fmt(_ms(res.get('experts_s')))}, rest {_fmt(_ms(res.get('rest_s')))})"
                      f", peak {_fmt((res.get('peak_bytes_layer') or 0) / 2**30, 1)} GiB"
                      f"{' — ' + res['stage_error'] if res.get('stage_error') else ''}"
                      f" [{res['wall_s']:.0f} s]", flush=True)
                bd = res.get("breakdown") or {}
                if bd.get("ops"):
                    print("    breakdown (ms): " + ", ".join(
                        f"{o['part']} {o['op']} {o['ms']:.3f}" for o in bd["ops"])
                        + (f"; sum of parts {bd['parts_ms']:.3f} vs experts "
                           f"{bd['experts_ms']:.3f}" if bd.get("parts_ms") is not None
                           else ""), flush=True)
            else:
                print(f"{head}: {res.get('error', 'no result')} [{res['wall_s']:.0f} s]",
                      flush=True)
        for key in ("machine", "devices", "jax"):
            if res.get(key) and meta.get(key) in ("?", None):
                meta[key] = res[key]
        results.append(res)
        _write(args, results, meta, final=False)


def _write(args, results, meta, final):
    table, summary = make_table(results, meta)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, "moe_layer_step")
        with open(stem + ".md", "w") as f:
            f.write(table)
        with open(stem + ".json", "w") as f:
            json.dump({"meta": meta, "args": {k: v for k, v in vars(args).items() if k != "job"},
                       "results": results, "summary": summary, "table_md": table}, f, indent=1)
        if final and make_plot(results, stem + ".png"):
            print(f"wrote {stem}.md, .json, .png")
        elif final:
            print(f"wrote {stem}.md, .json")
    return table, summary


# =============================================================================== worker


def _group_stats(sizes, rows, bm=128, bk=64):
    """Group-size statistics of one rank's ``group_sizes`` on ``rows`` dispatched rows, in
    the grouped-matmul kernels' terms (jax_ep/gmm/): fwd/dx compute
    ``cdiv(size + lead, bm)`` row tiles per non-empty group (from its first row
    rounded down to 8) and store zeros in the tail's tiles; dw walks each group in
    ``bk``-row k-steps from its start rounded down to 8."""
    import numpy as np

    s = np.maximum(np.asarray(sizes, np.int64).reshape(-1), 0)
    ends = np.minimum(np.cumsum(s), rows)
    starts = np.concatenate([[0], ends[:-1]])
    total = int(ends[-1]) if len(ends) else 0
    lead = starts % 8
    work = int(np.sum(np.where(ends > starts, -(-(ends - starts + lead) // bm), 0)))
    tail = -(-(rows - total // 8 * 8) // bm)
    nz = s > 0
    ksteps = int(np.sum(np.where(nz, -(-(s + lead) // bk), 0)))
    return {"groups": int(len(s)), "rows": int(rows), "valid_rows": total,
            "min": int(s.min()), "mean": float(s.mean()), "max": int(s.max()),
            "std": float(s.std()), "empty": int(np.sum(~nz)),
            "ends_inside_block": int(np.sum(nz & (ends % bm != 0))),
            "row_tiles": work, "ideal_row_tiles": -(-total // bm),
            "tail_row_tiles": int(tail), "dw_ksteps": ksteps,
            "ideal_dw_ksteps": -(-total // bk)}




def worker(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from jax_ep.launch import init_distributed

    init_distributed(native=False)
    import jax

    rank = jax.process_index()
    out = {"rank": rank}
    res_path = f"{spec['result']}.rank{rank}.json"

    def save():
        tmp = res_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, res_path)

    try:
        _worker_body(spec, out, save)
    except BaseException as e:  # noqa: BLE001 — record it, then stop every rank
        import traceback

        traceback.print_exc()
        msg = f"{type(e).__name__}: {e}"
        oom = re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|Failed to allocate", msg)
        if "layer_s" in out:  # a later piece failed: keep the layer figure
            out["stage_error"] = ("OOM in " if oom else "failed: ") + out.get("stage", "?")
            if out.get("stage") == "expert breakdown" and not oom:
                out["stage_error"] += ": " + msg.splitlines()[0][:200]
        else:
            out["error"] = "OOM" if oom else "error: " + msg.splitlines()[0][:200]
        save()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)  # non-zero: the launcher stops the other ranks (maybe in a collective)
    save()
    return 0


def _touch(tree, s):
    """Ties ``tree`` to ``s`` (the step's loss): the next step's use of the tree
    waits for this step. An optimization barrier, not an update: an in-place
    ``.at[0].add`` on a loop-carried weight that the step also reads made XLA
    copy every weight each step (measured on 1x H200, V3 with 128 local experts:
    ~9 ms of a 31 ms layer step, the same for every impl)."""
    import jax
    return jax.lax.optimization_barrier((tree, s))[0]


@dataclasses.dataclass
class _Job:
    """One worker's job: the spec, its result dict and what every stage shares
    (mesh, configs, shapes, the timing helpers)."""
    spec: dict
    out: dict
    save: Callable
    mesh: object
    cfg: object            # moe_layer.MoEConfig
    ep_cfg: object         # jax_ep.EpConfig of the layer
    dtype: object
    n_dev: int
    T: int
    H: int
    K: int
    Fd: int
    backend: str
    impl: str
    overrides: dict
    dev: object
    gcfg: object = None    # GroupedMatmulConfig (--gmm-tiles) or None
    cap: Optional[int] = None   # padded experts' rows per expert
    multi: bool = False
    static_all: bool = False
    rep: object = None     # replicated sharding
    tok: object = None     # token sharding over (data, ep)
    n_arrays: dict = dataclasses.field(default_factory=dict)

    @property
    def N(self):
        return self.T * self.n_dev

    def agree(self, v):  # every rank must run the same number of (collective) calls
        import numpy as np
        from jax.experimental import multihost_utils
        return int(multihost_utils.broadcast_one_to_all(np.int32(v))) if self.multi else int(v)

    def n_arg(self, n, static):
        import jax
        import numpy as np
        if static:
            return n
        if n not in self.n_arrays:
            self.n_arrays[n] = jax.make_array_from_callback(
                (), self.rep, lambda _: np.asarray(n, np.int32))
        return self.n_arrays[n]

    def measure(self, fn, state, rest, steps, static, min_time=None):
        """fn(n, state, *rest) -> (state, extras); state donated and carried over calls.
        -> (seconds per step, p10, p90, compile seconds, reps, extras of the first call)."""
        import jax
        import numpy as np
        spec = self.spec
        min_time = spec["min_time"] if min_time is None else min_time
        n_lo, n_hi = steps
        holder = [state]

        def call(n):
            t0 = time.perf_counter()
            st, extra = fn(self.n_arg(n, static), holder[0], *rest)
            jax.block_until_ready((st, extra))
            holder[0] = st
            return time.perf_counter() - t0, extra

        t_c0, first = call(n_lo)
        first = jax.tree.map(np.asarray, jax.device_get(first)) if first is not None else None
        t_c1, _ = call(n_hi)
        compile_s = t_c0 + (t_c1 if static else 0.0)
        t_lo, _ = call(n_lo)
        t_hi, _ = call(n_hi)
        reps = int(math.ceil(min_time / max(t_lo + t_hi, 1e-6)))
        reps = self.agree(max(3 if t_lo + t_hi > min_time else spec["min_reps"],
                              min(reps, spec["max_reps"])))
        d = []
        for _ in range(reps):
            a, _ = call(n_lo)
            b, _ = call(n_hi)
            d.append((b - a) / (n_hi - n_lo))
        d = np.asarray(d)
        return (float(np.median(d)), float(np.percentile(d, 10)), float(np.percentile(d, 90)),
                compile_s, reps, first, holder[0])

    def rank_figures(self, vals):
        """Per-rank figures (a list of floats) of every process -> [ranks][len(vals)]."""
        import numpy as np
        from jax.experimental import multihost_utils
        v = np.asarray(vals, np.float64)[None]
        return (np.asarray(multihost_utils.process_allgather(v, tiled=True)) if self.multi
                else v).tolist()


def _make_job(spec, out, save):
    """The mesh, layer config and jax_ep config of the spec; starts the native
    runtime when the job's backend needs it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import moe_layer as ml

    n_dev = jax.device_count()
    data = spec["data"]
    if n_dev % data:
        raise SystemExit(f"--data {data} does not divide {n_dev} devices")
    R = n_dev // data
    mesh = ml.make_mesh((data, R), ("data", "ep"))
    m = spec["model"]
    dtype = jnp.dtype(spec["dtype"])
    cfg = ml.MoEConfig(d_model=m["hidden"], d_ff=m["d_ff"], num_experts=m["experts"],
                       topk=m["topk"], n_groups=m["n_groups"], topk_groups=m["topk_groups"],
                       score_func=m["score_func"], route_scale=m["route_scale"],
                       n_shared=m["n_shared"], dtype=dtype)
    T, E = spec["T"], m["experts"]
    backend, impl = spec["backend"], spec["experts_impl"]
    overrides = {k: spec[k] for k in ("capacity", "expert_alignment", "num_sms")
                 if spec.get(k) is not None}
    ep_cfg = ml.make_ep_config(cfg, T, "ep", backend, impl, **overrides)
    dev = jax.local_devices()[0]
    out.update(machine=f"{n_dev}x {dev.device_kind}", devices=n_dev, jax=jax.__version__,
               platform=dev.platform, backend=backend, L=E // R,
               capacity_rows=ep_cfg.capacity_for(R, T))
    job = _Job(spec, out, save, mesh, cfg, ep_cfg, dtype, n_dev, T, m["hidden"], m["topk"],
               m["d_ff"], backend, impl, overrides, dev)
    if backend == "native":
        _start_native(job, R)
    job.gcfg = _gmm_config(job)
    if impl == "padded":
        mean_rows = R * T * job.K / E
        job.cap = min(R * T, int(math.ceil(spec["expert_capacity_factor"] * mean_rows / 8) * 8))
        out["expert_capacity"] = job.cap
    job.multi = jax.process_count() > 1
    job.rep = NamedSharding(mesh, P())
    job.tok = NamedSharding(mesh, P(("data", "ep")))
    job.static_all = bool(spec["static_loops"])
    return job


def _start_native(job, R):
    import jax_ep
    from jax_ep.intranode import region as intranode_region

    spec = job.spec
    job.out["nvshmem_bytes"] = (spec.get("buffer_bytes")
                                or intranode_region.buffer_bytes(job.ep_cfg, R))
    kw = ({"buffer_bytes": spec["buffer_bytes"]} if spec.get("buffer_bytes")
          else {"config": job.ep_cfg})
    if not jax_ep.initialize(**kw):
        from jax_ep import runtime
        raise RuntimeError(f"native backend unavailable: {runtime.unavailable_reason()}")


def _gmm_config(job):
    """--gmm-tiles as a GroupedMatmulConfig (grouped experts only), else None."""
    spec = job.spec
    if not (spec.get("gmm_tiles") and job.impl in ("grouped", "grouped_fp8")):
        return None
    from jax_ep.gmm import GroupedMatmulConfig

    fields = {k: (tuple(v) if isinstance(v, list) else v)
              for k, v in spec["gmm_tiles"].items()}
    job.out["gmm_tiles_used"] = "; ".join(f"{k}={v}" for k, v in fields.items())
    return GroupedMatmulConfig(**fields)


def _worker_body(spec, out, save):
    import jax

    import jax_ep
    import moe_layer as ml

    job = _make_job(spec, out, save)
    params, grads0, bias, x, ct = _layer_inputs(job)
    # jax_ep_fp8_wq: the expert weights quantized once, before any timed step
    # (the layer's and the experts' stages read the same cache)
    experts_fp8 = (jax.jit(ml.quantize_experts)(params["experts"])
                   if spec["impl"] == "jax_ep_fp8_wq" else None)
    out["stage"] = "layer"
    layer_fn, (params, grads) = _layer_stage(job, params, grads0, bias, x, ct, experts_fp8)
    del grads0
    if spec.get("profile"):
        out["stage"] = "profile"
        params, grads = _profile_stage(job, layer_fn, params, grads, x, bias, ct)

    if spec["split"]:
        # ---- dispatch + combine alone (identity experts), the layer's routing
        out["stage"] = "dispatch+combine"
        idx, w = jax.jit(lambda p, b, x: ml.route(p, b, x, job.cfg)[:2],
                         out_shardings=(job.tok, job.tok))(params, bias, x)
        if not spec.get("skip_comm"):  # (else the orchestrator takes it from another job)
            _comm_stage(job, x, idx, w, ct)

        # ---- the routed expert matmuls alone, on the rows this routing dispatches
        out["stage"] = "experts"
        rows, gs, valid_rows, ct_rows = _dispatched_rows(job, x, idx, w)
        ex = params["experts"]
        del params, grads
        ex_state = _experts_stage(job, rows, gs, (ex["gate_up"], ex["down"]), ct_rows,
                                  valid_rows, experts_fp8)
        if spec.get("expert_breakdown") and job.impl == "grouped":
            save()
            out["stage"] = "expert breakdown"
            rows, ew = ex_state[0], ex_state[1]  # (the first call donated the originals)
            del ex_state
            _expert_breakdown(job, rows, gs, ew, ct_rows, valid_rows / job.n_dev)
        else:
            del ex_state
    out.pop("stage", None)
    stats = job.dev.memory_stats() or {}
    out["peak_bytes"] = stats.get("peak_bytes_in_use")
    save()
    if job.backend == "native":
        jax_ep.finalize()


def _layer_inputs(job):
    """Parameters, zero gradients, routing bias and the inputs x, ct, created on
    the devices already sharded."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import moe_layer as ml

    cfg, mesh = job.cfg, job.mesh
    key = jax.random.key(0)
    p_shapes = jax.eval_shape(lambda: ml.init_moe_params(key, cfg))
    p_shard = jax.tree.map(lambda s: NamedSharding(mesh, s), ml.param_specs(p_shapes),
                           is_leaf=lambda s: isinstance(s, P))
    params = jax.jit(lambda: ml.init_moe_params(key, cfg), out_shardings=p_shard)()
    grads0 = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), p_shapes),
                     out_shardings=p_shard)()
    bias = jax.device_put(ml.init_routing_bias(cfg), job.rep)
    N, H, dtype = job.N, job.H, job.dtype
    x, ct = jax.jit(lambda: (jax.random.normal(jax.random.key(1), (N, H), dtype),
                             jax.random.normal(jax.random.key(2), (N, H), dtype)),
                    out_shardings=(job.tok, job.tok))()
    return params, grads0, bias, x, ct


def _layer_stage(job, params, grads0, bias, x, ct, experts_fp8=None):
    """The layer's chained fwd+bwd steps, timed (``experts_fp8``: the fp8 experts'
    weights quantized earlier, ``moe_layer.quantize_experts``). -> (a call of
    its jit, the carried (params, grads))."""
    import jax
    import jax.numpy as jnp

    import moe_layer as ml

    F32 = jnp.float32
    cfg, mesh = job.cfg, job.mesh

    def layer_chain(n, state, x, bias, ct, experts_fp8):
        def loss(p, xx):
            o, aux = ml.moe_block(p, bias, xx, cfg, mesh, backend=job.backend,
                                  ep_overrides=job.overrides, expert_impl=job.impl,
                                  expert_capacity=job.cap, gmm_config=job.gcfg,
                                  experts_fp8=experts_fp8)
            return jnp.sum(o.astype(F32) * ct.astype(F32)), aux["num_dropped"]

        vg = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

        def body(i, c):
            p, g, xx, _, _ = c
            (l, dr), (gp, gx) = vg(p, xx)
            xx = (xx.astype(F32) - 1e-6 * gx.astype(F32)).astype(xx.dtype)
            return _touch(p, l), gp, xx, l, dr

        p, g = state
        p, g, _, l, dr = jax.lax.fori_loop(0, n, body, (p, g, x, jnp.zeros((), F32),
                                                        jnp.zeros((), jnp.int32)))
        return (p, g), (l, dr)

    static_all = job.static_all
    chain = jax.jit(layer_chain, static_argnums=(0,) if static_all else (), donate_argnums=(1,))

    def layer_fn(n, state, x, bias, ct):
        return chain(n, state, x, bias, ct, experts_fp8)

    med, p10, p90, comp, reps, first, state = job.measure(
        layer_fn, (params, grads0), (x, bias, ct), job.spec["steps"], static_all)
    job.out.update(layer_s=med, layer_p10_s=p10, layer_p90_s=p90, layer_compile_s=comp,
                   layer_reps=reps, loss=float(first[0]), dropped=int(first[1]),
                   tokens_per_s=job.T / med if med > 0 else None)
    stats = job.dev.memory_stats() or {}
    job.out["peak_bytes_layer"] = stats.get("peak_bytes_in_use")
    job.save()
    return layer_fn, state


def _profile_stage(job, layer_fn, params, grads, x, bias, ct):
    """--profile: the kernels of one traced call of the layer chain. -> (params, grads)."""
    import jax

    sys.path.insert(0, HERE)
    import device_trace

    n_p = job.spec["steps"][-1]
    hold = [(params, grads)]
    del params, grads

    def traced_call():
        st, extra = layer_fn(job.n_arg(n_p, job.static_all), hold[0], x, bias, ct)
        jax.block_until_ready((st, extra))
        hold[0] = st

    try:
        traced_call()   # (a compiled executable: the trace holds one call's kernels)
        job.out["profile"] = device_trace.kernel_table(traced_call, n_p)
    except Exception as e:  # noqa: BLE001 -- a failed trace must not lose the job
        job.out["profile"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    state = hold.pop()   # (the list must not keep the donated state alive)
    del traced_call
    job.save()
    return state


def _comm_stage(job, x, idx, w, ct):
    """Dispatch + combine fwd+bwd alone (identity experts), chained and timed."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_ep

    F32 = jnp.float32
    spec_t = P(("data", "ep"))
    ep_cfg = job.ep_cfg

    def per_rank_dc(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, ep_cfg)
        # fp8 dispatch: the rows return through a bf16 combine, as in the layer
        y = d.x if d.x_scales is None else d.x.astype(jnp.bfloat16)
        return jax_ep.combine(y, d, ep_cfg)

    comm = jax.shard_map(per_rank_dc, mesh=job.mesh, in_specs=(spec_t,) * 3,
                         out_specs=spec_t, check_vma=True)

    def dc_chain(n, state, idx, ct):
        def body(i, c):
            xx, ww, l_prev = c
            ii = jnp.where(l_prev > -3e38, idx, -1)  # ties the routing to the carry
            l, (gx, gw) = jax.value_and_grad(
                lambda xx, ww: jnp.sum(comm(xx, ii, ww).astype(F32) * ct.astype(F32)),
                argnums=(0, 1))(xx, ww)
            xx = (xx.astype(F32) - 1e-6 * gx.astype(F32)).astype(xx.dtype)
            return xx, ww - 1e-6 * gw, l
        xx, ww = state
        xx, ww, l = jax.lax.fori_loop(0, n, body, (xx, ww, jnp.zeros((), F32)))
        return (xx, ww), l

    dc_fn = jax.jit(dc_chain, static_argnums=(0,), donate_argnums=(1,))
    x_dc, w_dc = jax.jit(lambda a, b: (jnp.copy(a), jnp.copy(b)),
                         out_shardings=(job.tok, job.tok))(x, w)  # donated below
    med, p10, p90, comp, reps, _, _ = job.measure(dc_fn, (x_dc, w_dc), (idx, ct),
                                                  job.spec["comm_steps"], True)
    job.out.update(comm_s=med, comm_p10_s=p10, comm_p90_s=p90, comm_compile_s=comp)
    job.save()


def _dispatched_rows(job, x, idx, w):
    """The rows and group sizes this routing dispatches (fp8 dispatch: the rows
    and their scales), the valid rows over all ranks and a random cotangent of
    the rows' shape."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P

    import jax_ep

    spec_t = P(("data", "ep"))

    def per_rank_rows(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, job.ep_cfg)
        return (d.x if d.x_scales is None else (d.x, d.x_scales)), d.group_sizes

    rows, gs = jax.jit(jax.shard_map(per_rank_rows, mesh=job.mesh, in_specs=(spec_t,) * 3,
                                     out_specs=(spec_t, spec_t), check_vma=True))(x, idx, w)
    valid_rows = int(np.sum(np.asarray(multihost_utils.process_allgather(gs, tiled=True)))
                     if job.multi else np.sum(np.asarray(gs)))
    q = jax.tree.leaves(rows)[0]
    ct_rows = jax.jit(lambda: jax.random.normal(jax.random.key(3), q.shape, job.dtype),
                      out_shardings=q.sharding)()
    return rows, gs, valid_rows, ct_rows


def _experts_stage(job, rows, gs, ew, ct_rows, valid_rows, q0=None):
    """The routed expert matmuls fwd+bwd alone, chained and timed (``q0``: the
    layer's ``experts_fp8``). -> the carried (rows, ew, grad rows, grad ew)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import moe_layer as ml

    F32 = jnp.float32
    spec_t, ep_spec = P(("data", "ep")), P("ep")
    impl, cap, gcfg = job.impl, job.cap, job.gcfg

    def per_rank_experts(rows, gs, gate_up, down, ct, quantized):
        rows, scales = rows if isinstance(rows, tuple) else (rows, None)   # fp8: with scales
        y, _ = ml.routed_experts(rows, gate_up, down, gs, impl, cap, gcfg, scales, quantized)
        return jnp.sum(y.astype(F32) * ct.astype(F32)).reshape(1)

    ex_loss = jax.shard_map(per_rank_experts, mesh=job.mesh,
                            in_specs=(spec_t, spec_t, ep_spec, ep_spec, spec_t,
                                      jax.tree.map(lambda _: ep_spec, q0)),
                            out_specs=spec_t, check_vma=True)

    def ex_chain(n, state, gs, ct, q):
        def body(i, c):
            rr, ew, _, _, l_prev = c
            g_s = jnp.where(l_prev > -3e38, gs, 0)
            l, (gr, gew) = jax.value_and_grad(
                lambda rr, ew: jnp.sum(ex_loss(rr, g_s, *ew, ct, q)), argnums=(0, 1))(rr, ew)
            return _touch(rr, l), _touch(ew, l), gr, gew, l
        rr, ew, gr, gew = state
        rr, ew, gr, gew, l = jax.lax.fori_loop(0, n, body,
                                               (rr, ew, gr, gew, jnp.zeros((), F32)))
        return (rr, ew, gr, gew), l

    # zero gradients of the gradients' types (fp8 rows get a bf16 cotangent)
    grad_types = jax.eval_shape(lambda rr, ew: jax.grad(
        lambda rr, ew: jnp.sum(ex_loss(rr, gs, *ew, ct_rows, q0)), argnums=(0, 1))(rr, ew),
        rows, ew)
    gr0, gw0 = jax.jit(lambda: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), grad_types),
                       out_shardings=jax.tree.map(lambda a: a.sharding, (rows, ew)))()
    ex_fn = jax.jit(ex_chain, static_argnums=(0,) if job.static_all else (),
                    donate_argnums=(1,))
    med, p10, p90, comp, reps, _, ex_state = job.measure(
        ex_fn, (rows, ew, gr0, gw0), (gs, ct_rows, q0), job.spec["steps"], job.static_all)
    # useful FLOPs: the routed (token, expert) pairs (N * K, the router picks K
    # distinct experts), not the rows in groups, which include the
    # expert_alignment padding rows
    n_dev = job.n_dev
    pairs = job.N * job.K
    flops = 18.0 * pairs / n_dev * job.H * job.Fd  # (2F + F wide) x (fwd + 2 bwd) x 2, per device
    out = job.out
    out.update(experts_s=med, experts_p10_s=p10, experts_p90_s=p90, experts_compile_s=comp,
               valid_rows_per_rank=valid_rows / n_dev, routed_pairs_per_rank=pairs / n_dev,
               experts_tflops=flops / med / 1e12 if med > 0 else None)
    if "comm_s" in out:
        out["rest_s"] = out["layer_s"] - out["comm_s"] - med
    return ex_state


def _breakdown_setup(job, rows, gs):
    """The breakdown record: tile sizes and every rank's group-size statistics
    (and the standalone bench's, for comparison)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jax_ep.gmm.devices import device_info
    from jax_ep.gmm.tuning import tuning_for

    gcfg = job.gcfg
    C = rows.shape[0] // job.n_dev
    tuned = tuning_for(device_info().kind).default
    bm = ((gcfg.fwd if gcfg else None) or tuned.fwd).block_m
    bk = ((gcfg.dw if gcfg else None) or tuned.dw).block_k
    g_host = np.asarray(multihost_utils.process_allgather(gs, tiled=True) if job.multi
                        else jax.device_get(gs)).reshape(job.n_dev, -1)
    bd = job.out["breakdown"] = {"block_m": bm, "dw_block_k": bk, "capacity_rows": C,
                                 "group_stats": [_group_stats(g, C, bm, bk) for g in g_host]}
    try:  # the standalone bench's sizes, for comparison
        sys.path.insert(0, HERE)
        import grouped_matmul_bench as gmb

        bd["standalone"] = {k: _group_stats(gmb.group_sizes(k), gmb.M, bm, bk)
                            for k in ("uniform", "skewed")}
    except Exception as e:  # noqa: BLE001
        bd["standalone_error"] = f"{type(e).__name__}: {e}"
    return bd


def _breakdown_ops(job):
    """The breakdown's pieces as per-rank functions (``full``: every output
    varies over every mesh axis, so one out spec fits all)."""
    import jax

    import moe_layer as ml
    from jax_ep.gmm import gmm, tgmm
    from jax_ep.mesh_axes import to_vma

    all_axes = frozenset(job.mesh.axis_names)
    impl, cap, gcfg, dtype = job.impl, job.cap, job.gcfg, job.dtype

    def full(tree):  # every result varies over every mesh axis (one out spec)
        return jax.tree.map(lambda v: to_vma(v, all_axes), tree)

    def swiglu_fb(gu, dh):  # the SwiGLU elementwise part (split included), fwd + bwd
        h, vjp = jax.vjp(ml.silu_mul, gu)
        return h, vjp(dh.astype(h.dtype))[0]

    def fwd(a, w, s):  # as grouped_matmul's forward
        return gmm(a, w, s, out_dtype=a.dtype, config=gcfg)

    def dx(a, w, s):  # as grouped_matmul's bwd: dy @ w[g]^T
        return gmm(a, w, s, transpose_rhs=True, out_dtype=a.dtype, config=gcfg)

    def dw(a, b, s):  # as grouped_matmul's bwd: x[g]^T @ dy[g]
        return tgmm(a, b, s, out_dtype=dtype, config=gcfg)

    def ex_fwd(a, s, gu, d):
        return ml.routed_experts(a, gu, d, s, impl, cap, gcfg)[0]

    def ex_fb(a, s, gu, d, ct):
        y, vjp = jax.vjp(
            lambda a, gu, d: ml.routed_experts(a, gu, d, s, impl, cap, gcfg)[0], a, gu, d)
        return vjp(ct.astype(y.dtype))

    def prep(x, s, gu_w, d, dy):  # the real intermediates of one fwd+bwd
        gu = fwd(x, gu_w, s)
        dh = dx(dy, d, s)
        h, dgu = swiglu_fb(gu, dh)
        return full((gu, h, dh, dgu))

    return types.SimpleNamespace(full=full, swiglu_fb=swiglu_fb, fwd=fwd, dx=dx, dw=dw,
                                 ex_fwd=ex_fwd, ex_fb=ex_fb, prep=prep)


def _breakdown_chainer(job, full):
    """-> chained(f, specs): (jit of (n, out, *args) -> (out after n chained
    calls, None), jit of zeros of the output), one per (f, specs)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    mesh, static_all, tok = job.mesh, job.static_all, job.tok
    spec_t = P(("data", "ep"))
    chains = {}

    def chained(f, specs):
        key = (f, specs)
        if key in chains:
            return chains[key]

        def per_rank(n, o, a, *rest):
            def body(i, c):
                a_b, _ = jax.lax.optimization_barrier((a, c))
                return full(f(a_b, *rest))
            return jax.lax.fori_loop(0, n, body, o)

        def run(n, o, *args):
            o_specs = jax.tree.map(lambda _: spec_t, o)
            if static_all:
                fn = jax.shard_map(lambda o, *a: per_rank(n, o, *a), mesh=mesh,
                                   in_specs=(o_specs,) + specs, out_specs=o_specs,
                                   check_vma=True)
                return fn(o, *args), None
            fn = jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), o_specs) + specs,
                               out_specs=o_specs, check_vma=True)
            return fn(n, o, *args), None

        def zeros(*args):  # the first carried output (traced only, no compile of f)
            shapes = jax.eval_shape(jax.shard_map(
                lambda *a: full(f(*a)), mesh=mesh, in_specs=specs, out_specs=spec_t,
                check_vma=True), *args)
            return jax.jit(lambda: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype),
                                                shapes),
                           out_shardings=jax.tree.map(lambda _: tok, shapes))()

        chains[key] = (jax.jit(run, static_argnums=(0,) if static_all else (),
                               donate_argnums=(1,)), zeros)
        return chains[key]

    return chained


def _expert_breakdown(job, rows, gs, ew, dy, mean_valid):
    """--expert-breakdown: every piece of the grouped-matmul experts fwd+bwd timed
    alone on this routing's dispatched rows (``measure``: chained calls in one jit,
    traced counts, medians). Each piece is ``f(a, *rest)`` called n times in a
    fori_loop whose ``a`` passes an optimization barrier with the previous output
    (nothing hoisted, every output materialised, as in
    bench/grouped_matmul_bench.py); the output buffer is carried and donated."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    t_b0 = time.perf_counter()
    spec_t = P(("data", "ep"))
    ep_spec = P("ep")
    gate_up, down = ew
    bd = _breakdown_setup(job, rows, gs)
    o = _breakdown_ops(job)

    gs32 = jax.jit(lambda v: v.astype(jnp.int32))(gs)
    gu, h, dh, dgu = jax.jit(jax.shard_map(
        o.prep, mesh=job.mesh, in_specs=(spec_t, spec_t, ep_spec, ep_spec, spec_t),
        out_specs=(spec_t,) * 4, check_vma=True))(rows, gs32, gate_up, down, dy)

    mm = 2.0 * mean_valid * job.H * job.Fd  # one [rows, H] x [H, F] product, per device
    R_, W_ = spec_t, ep_spec
    pieces = [  # (part, op, f, args, specs, flops per device); gate_up is 2F wide
        ("gate_up", "fwd", o.fwd, (rows, gate_up, gs32), (R_, W_, R_), 2 * mm),
        ("down", "fwd", o.fwd, (h, down, gs32), (R_, W_, R_), mm),
        ("gate_up", "dx", o.dx, (dgu, gate_up, gs32), (R_, W_, R_), 2 * mm),
        ("down", "dx", o.dx, (dy, down, gs32), (R_, W_, R_), mm),
        ("gate_up", "dw", o.dw, (rows, dgu, gs32), (R_, R_, R_), 2 * mm),
        ("down", "dw", o.dw, (h, dy, gs32), (R_, R_, R_), mm),
        ("swiglu", "fwd+bwd", o.swiglu_fb, (gu, dh), (R_, R_), None),
        ("experts", "fwd", o.ex_fwd, (rows, gs32, gate_up, down), (R_, R_, W_, W_), 3 * mm),
        ("experts", "fwd+bwd (chain)", o.ex_fb, (rows, gs32, gate_up, down, dy),
         (R_, R_, W_, W_, R_), 9 * mm),
    ]
    ops = _time_pieces(job, bd, pieces, _breakdown_chainer(job, o.full))
    t = {(op["part"], op["op"]): op["ms"] for op in ops}
    bd["matmuls_ms"] = sum(v for (p_, _), v in t.items() if p_ in MATMUL_PARTS)
    bd["parts_ms"] = bd["matmuls_ms"] + t[("swiglu", "fwd+bwd")]
    bd["experts_ms"] = 1e3 * job.out["experts_s"]  # the experts column (its own chain)
    bd["wall_s"] = time.perf_counter() - t_b0
    job.save()


def _time_pieces(job, bd, pieces, chained):
    """Times every piece (slowest rank's figures), saving after each. -> bd["ops"]."""
    bd_min_time = min(job.spec["min_time"], 0.5)  # 9 pieces: keep the extra time short
    ops = []
    for part, op, f, a, specs, fl in pieces:
        run_fn, zeros_fn = chained(f, specs)
        t0 = time.perf_counter()
        med, p10, p90, comp, reps, _, _ = job.measure(run_fn, zeros_fn(*a), a, job.spec["steps"],
                                                      job.static_all, bd_min_time)
        figs = job.rank_figures([med, p10, p90])
        worst = max(figs, key=lambda r: r[0])
        ops.append({"part": part, "op": op, "ms": 1e3 * worst[0], "p10_ms": 1e3 * worst[1],
                    "p90_ms": 1e3 * worst[2], "ms_ranks": [1e3 * r[0] for r in figs],
                    "tflops": fl / worst[0] / 1e12 if fl and worst[0] > 0 else None,
                    "reps": reps, "compile_s": comp, "wall_s": time.perf_counter() - t0})
        bd["ops"] = ops
        job.save()
    return ops


def main(argv=None):
    args = parse_args(argv)
    if args.job:
        return worker(args.job)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
