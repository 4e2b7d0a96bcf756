"""ragged_all_to_all: jax_ep's kernel beside its reference and lax's, V3-train rows.

The workload of ``ep_bench.py``'s ragged row: each rank's T tokens (H bf16,
top-K of E experts, uniform routing) go once to every rank holding one of
their experts, a ragged slice per destination rank (rows ``[R * T, H]``,
block r the tokens for rank r), into a ``[R * T, H]`` buffer per rank.
Rows (µs per call; calls chained inside one jit, each call's operand
depending on the previous result; per call = median over reps of
(t(n_hi) - t(n_lo)) / (n_hi - n_lo)):

* ``jax_ep native``: the kernel (``jax_ep.initialize(ragged_bytes=...)``
  sized for this buffer), with ``--transport``;
* ``jax_ep reference``: the pure-JAX backend (XLA all_to_all of padded chunks);
* ``lax``: ``jax.lax.ragged_all_to_all``, where XLA runs it: one process (an
  axis of one GPU here; XLA's multi-process path hangs or refuses);
* ``roof``: a plain copy of as many rows as a rank receives, inside the same
  chain: what moving those bytes once through HBM costs on this GPU (the
  bound for a rank's local share; across GPUs the link is the bound).

Each native result is compared with the reference's, bit for bit (the
``bits equal`` column). With processes sharing one GPU the times are
correctness-level only (the processes time-slice the GPU)::

    python bench/ragged_bench.py                                  # one GPU, one process
    python -m jax_ep.launch -n 2 bench/ragged_bench.py            # two processes
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="T per rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--steps", default="2,22", help="n_lo,n_hi chained calls")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--transport", default="auto", choices=("auto", "p2p", "put"))
    ap.add_argument("--impls", default="native,reference,lax,roof")
    return ap.parse_args()


def _inputs(mesh, R, T, H, E, K):
    """Per rank: rows [R*T, H] bf16 (block r: the tokens for rank r, in order,
    zero-padded), buffer [R*T, H], and the four int32 [R] arguments; each
    process builds its own rank's rows only. -> (inputs, rows moved in all)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    L = E // R
    idx = np.argsort(np.random.default_rng(0).random((R, T, E)), axis=2)[..., :K]  # uniform
    to = np.stack([(idx // L == r).any(-1) for r in range(R)], 1)       # [src, dst, T]
    sizes = to.sum(-1).astype(np.int32)                                  # [src, dst]

    def rows_of(s):
        x = np.random.default_rng(1 + s).standard_normal((T, H)).astype(jnp.bfloat16)
        rows = np.zeros((R * T, H), x.dtype)
        for d in range(R):
            rows[d * T:d * T + sizes[s, d]] = x[to[s, d]]
        return rows

    sharding = NamedSharding(mesh, P("ep"))
    big = lambda fill: jax.make_array_from_callback(
        (R * R * T, H), sharding, lambda i: fill((i[0].start or 0) // (R * T)))
    offs = np.arange(R, dtype=np.int32) * T
    ints = [np.tile(offs, R), sizes.reshape(-1), np.repeat(offs, R), sizes.T.reshape(-1)]
    small = [jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i]) for a in ints]
    zeros = lambda s: np.zeros((R * T, H), jnp.bfloat16)
    return [big(rows_of), big(zeros)] + small, int(sizes.sum())


def _chain(mesh, a2a, n):
    """jit(shard_map) of n chained calls of ``a2a`` (per rank)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def body(rows, buf, io, ss, oo, rs):
        for _ in range(n):
            buf = a2a(rows, buf, io, ss, oo, rs)
            rows = rows.at[0, 0].add((buf[0, 0].astype(jnp.float32) * 0).astype(rows.dtype))
        return buf
    spec = P("ep")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))


def _time(f, ins, reps):
    import jax

    for _ in range(2):
        jax.block_until_ready(f(*ins))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*ins))
        ts.append(time.perf_counter() - t0)
    return ts


def _impls(args, recv_rows):
    """name -> per-rank ragged_all_to_all (those that can run here); ``roof``
    copies ``recv_rows`` rows instead."""
    import jax

    import jax_ep

    one = jax.process_count() == 1
    cfg = lambda be: jax_ep.RaggedConfig(backend=be, transport=args.transport)
    table = {
        "jax_ep native": lambda *a: jax_ep.ragged_all_to_all(*a, axis_name="ep",
                                                             config=cfg("native")),
        "jax_ep reference": lambda *a: jax_ep.ragged_all_to_all(*a, axis_name="ep",
                                                                config=cfg("reference")),
        "lax": lambda *a: jax.lax.ragged_all_to_all(*a, axis_name="ep"),
        "roof: copy": lambda rows, buf, *_: jax.lax.dynamic_update_slice_in_dim(
            buf, rows[:recv_rows], 0, axis=0),
    }
    want = {"native": "jax_ep native", "reference": "jax_ep reference", "lax": "lax",
            "roof": "roof: copy"}
    return {want[k]: table[want[k]] for k in args.impls.split(",")
            if k in want and (k != "lax" or one)}


def _measure(args, mesh, ins, recv_rows):
    """(name, median µs, min, max, bits equal to the reference or None) per impl."""
    import jax
    import numpy as np

    n_lo, n_hi = (int(v) for v in args.steps.split(","))
    impls = _impls(args, recv_rows)
    ref = impls.get("jax_ep reference")
    want = np.asarray(_chain(mesh, ref, 1)(*ins).addressable_shards[0].data) if ref else None
    rows = []
    for name, a2a in impls.items():
        try:
            got = np.asarray(_chain(mesh, a2a, 1)(*ins).addressable_shards[0].data)
            same = None if want is None or name.startswith("roof") else bool(
                np.array_equal(got.view(np.uint16), want.view(np.uint16)))
            if same is False:   # every rank says so (the table shows rank 0's)
                print(f"{name}: rank {jax.process_index()} differs from the reference",
                      flush=True)
            lo, hi = (_time(_chain(mesh, a2a, n), ins, args.reps) for n in (n_lo, n_hi))
            per = [(y - x) / (n_hi - n_lo) * 1e6 for x, y in zip(lo, hi)]
            rows.append((name, float(np.median(per)), min(per), max(per), same))
        except Exception as e:  # noqa: BLE001 - one failed row does not hide the rest
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append((name, float("nan"), float("nan"), float("nan"), None))
    return rows


def main():
    args = _parse_args()
    sys.path.insert(0, ROOT)
    from jax_ep.launch import init_distributed

    R0 = int(os.environ.get("JAX_EP_NUM_PROCESSES", "1"))
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    info = init_distributed(native=True, buffer_bytes=256 << 20, ragged_bytes=R0 * T * H * 2)

    import jax

    import jax_ep

    R = jax.process_count()
    log = (lambda *a: print(*a, flush=True)) if jax.process_index() == 0 else (lambda *a: None)
    if not info.native:
        log("native runtime not up:", jax_ep.runtime.unavailable_reason())
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    ins, moved = _inputs(mesh, R, T, H, E, K)
    rows = _measure(args, mesh, ins, moved // R)
    dev = jax.local_devices()[0].device_kind
    log(f"\n# ragged_all_to_all — {R} process(es), {dev}, {datetime.date.today().isoformat()}, "
        f"jax {jax.__version__}\n")
    log(f"T {T} per rank, H {H} bf16, top-{K} of {E}, uniform; {moved} rows move in all "
        f"({moved * H * 2 / R / 1e6:.1f} MB received per rank); transport {args.transport}; "
        f"per call: median over {args.reps} reps of (t(n_hi) - t(n_lo)) / (n_hi - n_lo), "
        f"steps {args.steps}\n")
    log("| impl | us per call (median) | min | max | GB/s received per rank | bits equal |")
    log("|---|---|---|---|---|---|")
    for name, mid, lo, hi, same in rows:
        gbps = moved * H * 2 / R / (mid * 1e-6) / 1e9 if mid == mid else float("nan")
        log(f"| {name} | {mid:.1f} | {lo:.1f} | {hi:.1f} | {gbps:.1f} | "
            f"{'—' if same is None else same} |")
    if info.native:
        jax_ep.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
