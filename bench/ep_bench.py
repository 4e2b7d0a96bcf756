"""jax_ep benchmark: V3-train dispatch / combine on 2 GPUs (one process each).

    python bench/ep_bench.py --nproc 2 [--out DIR] [--quick]
    python bench/ep_bench.py --transport peer_memory [--out DIR]   # one process, every GPU

Spawns the worker processes itself (with --transport peer_memory it runs one
process that drives every GPU: the peer-memory transport, no NVSHMEM; its
files are named <date>-h200x<N>-1proc.* so they sit beside the multi-process
ones). Per-op device time: a chain of N
data-dependent calls inside one jit, timed N=10 and N=30 (median of >= 20
runs each after warm-up); per op = (t30 - t10) / 20, which cancels the fixed
launch/host overhead of a multi-process jit call. Reports µs and GB/s two
ways: DeepEP's (bytes received incl. local rows / time) and link bytes per
direction / time as a % of the bidirectional ceiling measured in the same run.
Writes <date>-h200x<nproc>.{md,json,png} into --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
_INIT_TIMEOUT_S = 90  # jax.distributed start-up (the default 300 s wasted a GPU run)
# jax.lax.ragged_all_to_all runs multi-process only through XLA's NCCL
# send/recv fallback, which this flag allows (without it: "RaggedAllToAll
# fallback to NCCL is not allowed"). It runs in a job of its own, under a
# deadline: the fallback has been seen to hang, and the flag must not touch
# the other rows.
_RAGGED_XLA_FLAGS = "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"
_RAGGED_TIMEOUT_S = 150  # it hung past 240 s on 2x H200 (jax 0.11.2)


def _free_port():
    sys.path.insert(0, ROOT)
    from jax_ep.launch import free_port  # imports jax, but never creates a backend here

    return free_port()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--quick", action="store_true", help="sweep up to T=4096 only")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--skip-ref", action="store_true", help="native ops only (iteration)")
    ap.add_argument("--only-fp8", action="store_true", help="fp8 dispatch ops only (iteration)")
    ap.add_argument("--no-ragged", action="store_true", help="skip the ragged_all_to_all row")
    ap.add_argument("--transport", choices=("nvshmem", "peer_memory"), default="nvshmem",
                    help="peer_memory: one process drives every GPU (no launcher)")
    ap.add_argument("--worker", type=int, default=-1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ragged-only", default="", help=argparse.SUPPRESS)  # worker: row -> this file
    ap.add_argument("--ragged-row", default="", help=argparse.SUPPRESS)   # worker: row <- this file
    args = ap.parse_args()
    if args.worker >= 0:
        return worker(args)
    if args.transport == "peer_memory":  # one process, no jax.distributed: run it here
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
        os.environ.update(NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1")
        args.worker, args.no_ragged = 0, True
        return worker(args)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    env.pop("XLA_FLAGS", None)
    flags = ["--" + f.replace("_", "-") for f in ("quick", "no_sweep", "skip_ref", "only_fp8")
             if getattr(args, f)]
    extra = []
    if not (args.no_ragged or args.skip_ref or args.only_fp8):
        row_file = os.path.join(args.out, ".ragged_row.json")
        os.makedirs(args.out, exist_ok=True)
        _run_job(args, ["--ragged-only", row_file], dict(env, XLA_FLAGS=_RAGGED_XLA_FLAGS),
                 _RAGGED_TIMEOUT_S, row_file)
        extra = ["--ragged-row", row_file]
    return _run_job(args, flags + extra, env, None)


def _run_job(args, flags, env, timeout, row_file=None):
    """Runs the worker processes; a job that dies while the workers connect (a
    taken coordinator port) is started once more on a new port. With a timeout,
    a job past it is killed and row_file records that."""
    rc = 0
    for attempt in range(2):
        cmd = [sys.executable, __file__, "--nproc", str(args.nproc), "--out", args.out,
               "--port", str(_free_port())] + flags
        t0 = time.monotonic()
        procs = [subprocess.Popen(cmd + ["--worker", str(r)], env=env) for r in range(args.nproc)]
        rc = 0
        try:
            for p in procs:
                rc |= p.wait(timeout=None if timeout is None
                             else max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()
            with open(row_file, "w") as f:
                json.dump({"us": None, "note": f"hung: killed after {timeout} s ({_RAGGED_XLA_FLAGS})"}, f)
            print(f"ep_bench: ragged_all_to_all job killed after {timeout} s", flush=True)
            return 1
        if rc == 0 or time.monotonic() - t0 > _INIT_TIMEOUT_S + 30:
            break
        print(f"ep_bench: job failed during start-up (rc={rc}); retrying on a new port", flush=True)
    return rc


_N0, _N1 = 10, 30   # chained calls of the two timed chains: per op = (t30 - t10) / 20


def _dep(x, o):
    # data dependence of the next call on this one's output, at ~no cost
    return x.at[0, 0].add((o.reshape(-1)[0] * 0).astype(x.dtype))


class _Bench:
    """One worker's mesh and timing helpers (rank, EP size R, the backends)."""

    def __init__(self, args, rank, single, mesh, log):
        from jax.sharding import PartitionSpec as P

        from jax_ep.intranode import native, reference

        self.args, self.rank, self.single, self.mesh, self.log = args, rank, single, mesh, log
        self.R = args.nproc
        self.spec = P("ep")
        self.native, self.reference = native, reference

    def glob(self, arr):
        import jax
        import numpy as np
        from jax.sharding import NamedSharding

        arr = np.asarray(arr)
        return jax.make_array_from_callback(arr.shape, NamedSharding(self.mesh, self.spec),
                                            lambda i: arr[i])

    @staticmethod
    def timed(fn_n, ins, reps):
        """median seconds of one jitted call (after warm-up)."""
        import jax
        import numpy as np

        out = fn_n(*ins)
        jax.block_until_ready(out)
        out = fn_n(*ins)
        jax.block_until_ready(out)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn_n(*ins))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    def per_op(self, build, ins, reps=20):
        """build(n) -> per-rank fn doing n chained ops. -> (us per op, us of n=10 / 10)."""
        import jax

        fs = {}
        for n in (_N0, _N1):
            fs[n] = jax.jit(jax.shard_map(build(n), mesh=self.mesh,
                                          in_specs=(self.spec,) * len(ins), out_specs=self.spec))
        t0 = self.timed(fs[_N0], ins, reps)
        t1 = self.timed(fs[_N1], ins, reps)
        return (t1 - t0) / (_N1 - _N0) * 1e6, t0 / _N0 * 1e6

    def routing(self, T, K, E, seed):
        import numpy as np

        rng = np.random.default_rng(seed)
        idx = np.argsort(rng.random((self.R * T, E)), axis=1)[:, :K].astype(np.int32)  # uniform, distinct
        return idx

    @staticmethod
    def cfg_for(T, H, K, E, layout, backend, num_sms=None, **kw):
        from jax_ep.config import EpConfig

        backend = backend if backend in ("native", "reference") else "reference"
        return EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                        backend=backend, num_sms=num_sms, **kw)

    def route_stats(self, T, H, K, E, layout, idx):
        """(received rows incl. local, link rows per direction) on rank 0 (numpy)."""
        import numpy as np

        R = self.R
        L = E // R
        dest = idx.reshape(R, T, K) // L
        sent = np.zeros((R, T, R), bool)
        for r in range(R):
            sent[:, :, r] = (dest == r).any(-1)
        recv_tokens = sent[:, :, 0].sum()          # (s, t) pairs arriving at rank 0
        link_rows = sent[1:, :, 0].sum()           # from the other rank(s)
        if layout == "expert_major":
            recv_rows = (dest == 0).sum()
        else:
            recv_rows = recv_tokens
        return int(recv_rows), int(recv_tokens), int(link_rows)


def _build_route(R, cfg, bk):
    import jax.numpy as jnp

    def build(n):
        def f(x, i):
            acc = jnp.zeros((), jnp.int32)
            for _ in range(n):
                h = bk.router.route(i + acc, cfg, R)[0]
                # always 0, but not provably so: keeps the routes chained
                acc = acc + jnp.where(h.slot_row.reshape(-1)[0] < -5, 1, 0)
            return x[:1] + acc.astype(x.dtype)
        return f
    return build


def _build_dispatch(R, cfg, bk):
    def build(n):
        def f(x, i):
            h = bk.router.route(i, cfg, R)[0]
            for _ in range(n):
                o = bk.dispatch_rows(x, None, h, cfg)[0]
                x = _dep(x, o)
            return x
        return f
    return build


def _build_dispatch_fp8(R, cfg, bk):
    import jax.numpy as jnp

    def build(n):
        def f(x, i):
            h = bk.router.route(i, cfg, R)[0]
            for _ in range(n):
                o = bk.dispatch_rows_fp8(x, h, cfg)[0]
                x = _dep(x, o.reshape(-1)[:1].astype(jnp.float32))
            return x
        return f
    return build


def _build_combine(R, cfg, bk):
    import jax.numpy as jnp

    def build(n):
        def f(x, i):
            h = bk.router.route(i, cfg, R)[0]
            y = bk.dispatch_rows(x, None, h, cfg)[0]
            w = (jnp.ones((h.capacity,), jnp.float32) * 0.5
                 if cfg.layout == "expert_major" else None)
            o = x
            for _ in range(n):
                o = bk.combine_rows(y, w, h, cfg)
                y = _dep(y, o)
            return o
        return f
    return build


def _build_combine_bwd(R, cfg, bk, bwd):
    """Backward of expert_major combine for d_out g [T, H] through ``bwd``."""
    import jax
    import jax.numpy as jnp

    def build(n):
        def f(x, i):
            h = bk.router.route(i, cfg, R)[0]
            y = bk.dispatch_rows(x, None, h, cfg)[0]
            w = jnp.ones((h.capacity,), jnp.float32) * 0.5
            g = x
            for _ in range(n):
                # the barrier keeps XLA from computing only the
                # elements dep() reads (slices pushed through the math)
                dy, dw = jax.lax.optimization_barrier(bwd(g, y, w, h, cfg))
                g = _dep(_dep(g, dy), dw)
            return g
        return f
    return build


def _build_roundtrip(R, cfg, bk):
    import jax.numpy as jnp

    def build(n):
        def f(x, i):
            h = bk.router.route(i, cfg, R)[0]
            w = (jnp.ones((h.capacity,), jnp.float32) * 0.5
                 if cfg.layout == "expert_major" else None)
            for _ in range(n):
                y = bk.dispatch_rows(x, None, h, cfg)[0]
                x = bk.combine_rows(y, w, h, cfg)
            return x
        return f
    return build


def _build_roundtrip_route(R, cfg, bk):
    """The whole API round trip: route (layout + metadata exchange) every
    iteration, made to depend on the previous output."""
    import jax.numpy as jnp

    def build(n):
        def f(x, i):
            w = None
            for _ in range(n):
                bump = (x[0, 0] > 1e30).astype(jnp.int32)  # 0, not provably
                h = bk.router.route(i + bump, cfg, R)[0]
                y = bk.dispatch_rows(x, None, h, cfg)[0]
                x = bk.combine_rows(y, w, h, cfg)
            return x
        return f
    return build


def _build_ragged_a2a(R, E):
    import jax
    import jax.numpy as jnp

    def build(n):
        def f(x, i):
            # token rows to each rank, deduplicated, as ragged_all_to_all
            L = E // R
            dest = i // L
            T_ = x.shape[0]
            send = jnp.stack([(dest == r).any(-1) for r in range(R)], 0)  # [R, T]
            order = jnp.argsort(~send, axis=1, stable=True)
            sizes = send.sum(1).astype(jnp.int32)
            rows = jnp.concatenate([x[order[r]] for r in range(R)], 0)
            in_off = jnp.arange(R, dtype=jnp.int32) * T_
            recv_sizes = jax.lax.all_to_all(sizes[:, None], "ep", 0, 0)[:, 0]
            out_off = jax.lax.all_to_all((jnp.arange(R, dtype=jnp.int32) * T_)[:, None],
                                         "ep", 0, 0)[:, 0]
            buf = jnp.zeros((R * T_, x.shape[1]), x.dtype)
            for _ in range(n):
                buf = jax.lax.ragged_all_to_all(rows, buf, in_off, sizes, out_off,
                                                recv_sizes, axis_name="ep")
                rows = _dep(rows, buf)
            return buf[:T_]
        return f
    return build


def _op_builder(b, kind, cfg, bk, E):
    """build(n) of one op kind: a per-rank fn doing n chained calls."""
    R = b.R
    if kind == "route":
        return _build_route(R, cfg, bk)
    if kind == "dispatch":
        return _build_dispatch(R, cfg, bk)
    if kind == "dispatch_fp8":
        return _build_dispatch_fp8(R, cfg, bk)
    if kind == "combine":
        return _build_combine(R, cfg, bk)
    if kind in ("combine_bwd", "combine_bwd_xla"):
        # the backend's (native: fused into the dispatch kernel), or "_xla": the
        # reference math (dispatch of g, then [C, H] f32 temporaries in XLA) over
        # this backend's dispatch, as api._combine_bwd did before
        bwd = (bk.combine_backward if kind == "combine_bwd" else
               lambda *a, bk=bk: b.reference.ReferenceBackend.combine_backward(bk, *a))
        return _build_combine_bwd(R, cfg, bk, bwd)
    if kind == "roundtrip":
        return _build_roundtrip(R, cfg, bk)
    if kind == "roundtrip_route":
        return _build_roundtrip_route(R, cfg, bk)
    if kind == "ragged_a2a":
        return _build_ragged_a2a(R, E)
    raise ValueError(f"unknown op kind {kind!r}")


def _bench_config(b, T, H, K, E, ops, seed=0, reps=20):
    """Times every op at one shape. -> ({op: (us, us of n=10 / 10) or (None, error)}, idx)."""
    import jax.numpy as jnp
    import numpy as np

    idx = b.routing(T, K, E, seed)
    x = (np.random.default_rng(seed + 1).standard_normal((b.R * T, H))).astype(np.float32)
    xb = b.glob(x.astype(jnp.bfloat16))
    gidx = b.glob(idx)
    out = {}
    for op in ops:
        kind, layout, be = op[:3]
        skip = op[3] if len(op) > 3 else 0
        sms = op[4] if len(op) > 4 else None
        assert not (op[5] if len(op) > 5 else ()), "op[5] (environment knobs) is gone"
        cfg_kw = dict(op[6]) if len(op) > 6 else {}  # EpConfig fields, e.g. zero_tail, tuning
        cfg = b.cfg_for(T, H, K, E, layout, be, sms, **cfg_kw)
        bk = b.native.BACKEND if be == "native" else b.reference.BACKEND
        try:
            build = _op_builder(b, kind, cfg, bk, E)
            with b.native.debug_skip(skip):  # the breakdown rows: test build only
                us, us_naive = b.per_op(build, [xb, gidx], reps)
            out[op] = (us, us_naive)
            b.log(f"  T={T} {kind:12s} {layout:12s} {be:9s} skip={skip} sms={sms} {us:9.1f} us/op (n10/10: {us_naive:.1f})")
        except Exception as e:  # noqa: BLE001
            out[op] = (None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            b.log(f"  T={T} {kind} {layout} {be}: FAILED {out[op][1]}")
    return out, idx


def _start_worker(args):
    """jax.distributed (one process per GPU) or every GPU here (peer memory),
    then the jax_ep runtime. -> _Bench."""
    import jax

    rank = args.worker
    single = args.transport == "peer_memory"
    if single:
        args.nproc = len(jax.devices())
    else:
        jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.nproc,
                                   process_id=rank, local_device_ids=[rank],
                                   initialization_timeout=_INIT_TIMEOUT_S)
    sys.path.insert(0, ROOT)
    import jax_ep

    # the default buffer either way (the rings wrap at any EP), as the
    # multi-process run uses
    ok = jax_ep.initialize(symmetric_memory="peer_memory" if single else "auto")
    mesh = jax.make_mesh((args.nproc,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    log(f"devices={jax.devices()} native={ok} jax={jax.__version__}")
    return _Bench(args, rank, single, mesh, log)


def _ceilings(b, T, H, K, E):
    """Transfer ceilings (GB/s per direction) of one bf16 [T, H] per direction."""
    import numpy as np

    nbytes = T * H * 2  # one V3-train bf16 [T, H] per direction
    src = b.glob(np.random.default_rng(5).integers(0, 255, (b.R * nbytes,), dtype=np.uint8))
    tok = b.glob(np.zeros((b.R, ), np.int32))
    cfg0 = b.cfg_for(T, H, K, E, "rank_major", "native")
    ceil = {}
    for mode, name in [] if b.args.only_fp8 else [(0, "sm_write_both"), (1, "ce_copy_both"), (2, "ce_copy_one_way"),
                       (3, "sm_write_one_way")]:
        def build(n, mode=mode):
            def f(s, t):
                for _ in range(n):
                    t = b.native.bench_transfer(s, t, cfg0, mode)
                return t
            return f
        try:
            us, _ = b.per_op(build, [src, tok])
            ceil[name] = nbytes / (us * 1e-6) / 1e9
            b.log(f"ceiling {name}: {us:.1f} us for {nbytes/1e6:.1f} MB -> {ceil[name]:.1f} GB/s per direction")
        except Exception as e:  # noqa: BLE001
            ceil[name] = None
            b.log(f"ceiling {name}: FAILED {e}")
    return ceil


def _v3_ops(args):
    """The V3-train table's ops: (kind, layout, backend[, skip, num_sms, (), EpConfig fields])."""
    from jax_ep.config import KernelTuning

    ops = [("route", "rank_major", "reference"), ("route", "rank_major", "native"),
           ("roundtrip_route", "rank_major", "native"),
           ("roundtrip_route", "rank_major", "reference"),
           ("dispatch", "rank_major", "native"), ("dispatch", "expert_major", "native"),
           ("combine", "rank_major", "native"), ("combine", "expert_major", "native"),
           ("roundtrip", "rank_major", "native"), ("roundtrip", "expert_major", "native"),
           # expert_major with the tail past the last group zeroed (EpConfig.zero_tail;
           # the default leaves it unspecified), and the combine backward: native
           # fused vs the XLA-materialised reference math over the native dispatch
           ("dispatch", "expert_major", "native", 0, None, (), (("zero_tail", True),)),
           ("combine_bwd", "expert_major", "native"), ("combine_bwd_xla", "expert_major", "native"),
           ("combine_bwd", "expert_major", "reference"),
           ("dispatch_fp8", "rank_major", "native"),
           ("dispatch", "rank_major", "reference"), ("dispatch", "expert_major", "reference"),
           ("combine", "rank_major", "reference"),
           ("roundtrip", "rank_major", "reference"), ("roundtrip", "expert_major", "reference"),
           ("dispatch_fp8", "rank_major", "reference"),
           # breakdown (native.debug_skip, test build only): 1 = no data sent (flags + local work only),
           # 2 = sends only (no receive-side gather / reduce), 3 = flags only
           ("dispatch", "rank_major", "native", 1), ("dispatch", "rank_major", "native", 2),
           ("dispatch", "rank_major", "native", 3),
           ("combine", "rank_major", "native", 1), ("combine", "rank_major", "native", 2),
           ("combine", "rank_major", "native", 3),
           ("dispatch_fp8", "rank_major", "native", 1), ("dispatch_fp8", "rank_major", "native", 2),
           # fewer SMs (cfg.num_sms), leaving the rest to overlapped compute
           ("dispatch", "rank_major", "native", 0, 32), ("combine", "rank_major", "native", 0, 32),
           ("dispatch", "rank_major", "native", 0, 64), ("combine", "rank_major", "native", 0, 64)]
    # other chunk sizes (EpConfig.tuning; defaults: dispatch 8 tokens = one per
    # sender warp, combine 4 = two warps per row)
    chunk = lambda **kw: (("tuning", KernelTuning(**kw)),)
    ops += [("dispatch", "rank_major", "native", 0, None, (), chunk(dispatch_chunk=4)),
            ("combine", "rank_major", "native", 0, None, (), chunk(combine_chunk=8)),
            ("combine", "rank_major", "native", 0, None, (), chunk(combine_chunk=2)),
            ("roundtrip", "rank_major", "native", 0, None, (), chunk(combine_chunk=8))]
    if args.skip_ref:
        ops = [o for o in ops if o[2] == "native"]
    if args.only_fp8:
        ops = [o for o in ops if o[0] == "dispatch_fp8" and o[2] == "native"]
    return ops


def _v3_row(b, op, us, extra, idx, T, H, K, E, bidir):
    """One V3-train table row: the op's label, time and GB/s (both ways)."""
    kind, layout, be = op[:3]
    skip = op[3] if len(op) > 3 else 0
    sms = op[4] if len(op) > 4 else None
    if skip:
        kind = f"{kind} [skip={skip}: " + {1: "no data sent", 2: "send only", 3: "flags only"}[skip] + "]"
    if sms:
        kind = f"{kind} [num_sms={sms}]"
    if len(op) > 6:
        kind = f"{kind} [" + " ".join(f"EpConfig.{k_}={v_}" for k_, v_ in op[6]) + "]"
    row = {"op": kind, "layout": layout, "backend": be, "us": us,
           "note": extra if us is None else f"n10/10={extra:.1f}us"}
    if us is not None and kind.split()[0] != "route" and not skip:
        recv_rows, recv_tokens, link_rows = b.route_stats(T, H, K, E, layout, idx)
        base = kind.split()[0]
        bpr = H * (1 if base == "dispatch_fp8" else 2) + (H // 128 * 4 if base == "dispatch_fp8" else 0)
        base = "roundtrip" if base == "roundtrip_route" else base
        if base in ("dispatch", "dispatch_fp8", "ragged_a2a", "combine_bwd", "combine_bwd_xla"):
            recv_b, link_b = recv_rows * bpr, link_rows * bpr
        elif base == "combine":
            recv_b, link_b = recv_tokens * bpr, link_rows * bpr
        else:  # round trip: both
            recv_b, link_b = (recv_rows + recv_tokens) * bpr, 2 * link_rows * bpr
        row["deepep_GBps"] = recv_b / (us * 1e-6) / 1e9
        row["link_GBps"] = link_b / (us * 1e-6) / 1e9
        row["pct_of_bidir_ceiling"] = 100 * row["link_GBps"] / bidir
    return row


def _ragged_only(b, ragged_op, T, H, K, E):
    """The ragged_all_to_all job (its own XLA_FLAGS): one row to a file."""
    import jax_ep

    res, _ = _bench_config(b, T, H, K, E, [ragged_op], reps=5)  # ~90 ms a call single-process
    if b.rank == 0:
        us, note = res[ragged_op]
        with open(b.args.ragged_only, "w") as f:
            json.dump({"us": us, "note": note + f" ({_RAGGED_XLA_FLAGS})"
                       if us is None else note}, f)
    jax_ep.finalize()
    return 0


def _read_ragged_row(path):
    """The row measured by the job before this one (see _RAGGED_XLA_FLAGS)."""
    try:
        with open(path) as f:
            rr = json.load(f)
        return (rr["us"], rr["note"])
    except (OSError, ValueError, KeyError) as e:
        return (None, f"no result from the ragged_all_to_all job ({e})")


def worker(args):
    import jax

    b = _start_worker(args)   # (puts ROOT on sys.path: jax_ep imports after it)
    import jax_ep

    R = b.R
    results = {"machine": f"{R}x {jax.local_devices()[0].device_kind}"
               + (", one process (peer memory)" if b.single else ", one process per GPU (NVSHMEM)"),
               "nproc": R, "suffix": "-1proc" if b.single else "",
               "date": datetime.date.today().isoformat(),
               "jax": jax.__version__, "rows": [], "sweep": []}
    T, H, K, E = 4096, 7168, 8, 256
    ragged_op = ("ragged_a2a", "rank_major", "xla")
    if args.ragged_only:
        return _ragged_only(b, ragged_op, T, H, K, E)

    # ---- ceilings -------------------------------------------------------------
    ceil = _ceilings(b, T, H, K, E)
    results["ceilings_GBps_per_direction"] = ceil
    bidir = max([v for k, v in ceil.items() if v and k.endswith("both")] or [275.0])

    # ---- V3-train table ----------------------------------------------------------
    ops = _v3_ops(args)
    b.log("V3-train T=4096 H=7168 K=8 E=256 bf16, uniform routing")
    res, idx = _bench_config(b, T, H, K, E, ops)
    if args.ragged_row:
        res[ragged_op] = _read_ragged_row(args.ragged_row)
    for op, (us, extra) in res.items():
        results["rows"].append(_v3_row(b, op, us, extra, idx, T, H, K, E, bidir))

    if b.rank == 0:  # the table now, the sweep appended later (a cut-short run keeps it)
        write_outputs(results, args.out, bidir, quiet=True)

    # ---- sweep over T --------------------------------------------------------------
    Ts = [] if args.no_sweep else [128, 256, 512, 1024, 2048, 4096] + ([] if args.quick else [8192])
    for Tn in Ts:
        sops = [("dispatch", "rank_major", "native"), ("combine", "rank_major", "native"),
                ("roundtrip", "rank_major", "native"), ("roundtrip", "rank_major", "reference")]
        r2, _ = _bench_config(b, Tn, H, K, E, sops, reps=10)
        for op, (us, _) in r2.items():
            results["sweep"].append({"T": Tn, "op": op[0], "layout": op[1], "backend": op[2], "us": us})

    if b.rank == 0:
        write_outputs(results, args.out, bidir)
    jax_ep.finalize()
    return 0


def write_outputs(results, out_dir, bidir, quiet=False):
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{results['date']}-h200x{results['nproc']}"
                        f"{results.get('suffix', '')}")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    L = [f"# jax_ep benchmark — {results['machine']}, {results['date']} (jax {results['jax']})", "",
         "V3-train: T=4096 tokens/rank, H=7168, top-8 of 256 experts, uniform random routing, bf16.",
         "Per-op time = (t(30 chained calls) - t(10 chained calls)) / 20, each chain one jit call, medians of 20 runs (sweep: 10).",
         "DeepEP GB/s = bytes received incl. local rows / time; link GB/s = bytes crossing NVLink per direction / time.",
         "", "## Ceilings measured in this run (GB/s per direction, 58.7 MB per direction)", ""]
    for k, v in results["ceilings_GBps_per_direction"].items():
        L.append(f"- {k}: {'n/a' if v is None else f'{v:.1f}'}")
    L += [f"- bidirectional ceiling used for %: {bidir:.1f}", "",
          "## V3-train", "", "| op | layout | backend | µs | DeepEP GB/s | link GB/s | % bidir ceiling | note |",
          "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        us = "—" if r["us"] is None else f"{r['us']:.1f}"
        g = lambda k: f"{r[k]:.0f}" if k in r else "—"
        L.append(f"| {r['op']} | {r['layout']} | {r['backend']} | {us} | {g('deepep_GBps')} | "
                 f"{g('link_GBps')} | {g('pct_of_bidir_ceiling')} | {r['note']} |")
    L += ["", "## Sweep over T (rank_major, µs per op)", "", "| T | op | backend | µs |", "|---|---|---|---|"]
    for r in results["sweep"]:
        L.append(f"| {r['T']} | {r['op']} | {r['backend']} | {'—' if r['us'] is None else f'{r[chr(117)+chr(115)]:.1f}'} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(L) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        keys = sorted({(r["op"], r["backend"]) for r in results["sweep"]})
        for k in keys:
            pts = [(r["T"], r["us"]) for r in results["sweep"]
                   if (r["op"], r["backend"]) == k and r["us"] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{k[0]} ({k[1]})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank T (H=7168, top-8 of 256, bf16, rank_major)")
        ax.set_ylabel("µs per op")
        ax.set_title(f"jax_ep on {results['machine']}, {results['date']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=120)
    except Exception as e:  # noqa: BLE001
        print(f"plot failed: {e}")
    if not quiet:
        print("\n".join(L))


if __name__ == "__main__":
    sys.exit(main())
