"""Low-latency (decode) mode: per-op device time, the hook's overlap, graphs on/off.

One process per GPU (NVSHMEM), V3-decode shapes by default (T 128 tokens per
rank, H 7168, E 256, top-8, fp8 dispatch with f32 scales, bf16 combine)::

    python -m jax_ep.launch -n 2 bench/low_latency_bench.py            # graphs off
    python -m jax_ep.launch -n 2 bench/low_latency_bench.py --graphs   # XLA command buffers on

``--graphs`` sets ``--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL`` (and
a minimum graph size of 1) before JAX starts, so XLA captures the jax_ep
custom calls into CUDA graphs; the table says which mode ran.

Rows (µs per step; a step is chained n times inside one jit, each step's input
depending on the previous step's output; per step = median over reps of
(t(n_hi) - t(n_lo)) / (n_hi - n_lo), which cancels the per-call host costs):

* ``ll dispatch`` (fp8), ``ll combine`` (bf16; one dispatch before the chain
  gives its handle), ``ll round trip`` (both); the experts' output y is a
  fixed input (no stand-in compute over the [L, R*Tmax, H] layout);
* ``xla round trip``: the reference backend (XLA all_to_all of the dense
  [R, L*Tmax, H] buffers), same semantics;
* ``normal round trip``: jax_ep.dispatch + combine (expert_major, fp8) at the
  same T, the training-mode kernels;
* ``compute X``: the stand-in compute block alone (``--matmuls`` bf16
  [T, H] @ [H, H] products);
* ``hooked``: dispatch send, compute, dispatch receive, combine send, compute,
  combine receive (the compute depends on neither; where XLA places it is
  XLA's choice); beside ``sequential`` (round trip, then 2 compute blocks that
  depend on its output): the hook hides the transfer when hooked ~ 2 X + the
  kernels' own time.

Rank 0 prints one markdown table.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRAPH_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


def _parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--matmuls", type=int, default=4, help="[T,H]@[H,H] products per compute block")
    ap.add_argument("--graphs", action="store_true", help="XLA command buffers on (custom calls too)")
    ap.add_argument("--steps", default="10,110", help="n_lo,n_hi chained steps")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-normal", action="store_true", help="skip the normal-mode row")
    ap.add_argument("--ll-transport", default="auto", choices=("auto", "p2p", "put"),
                    help="EpConfig.ll_transport of the low-latency ops (put: NVSHMEM puts to "
                         "every rank, the own one included)")
    return ap.parse_args()


@dataclasses.dataclass
class _Bench:
    """What every row's step needs: the arguments, the three configs, the mesh
    and the global inputs (x, idx, w, mm, y)."""
    args: argparse.Namespace
    ll_cfg: object
    ref_cfg: object
    nrm_cfg: object
    mesh: object
    spec: object
    log: Callable
    ins: list = dataclasses.field(default_factory=list)


# jax is imported inside the functions: --graphs sets XLA_FLAGS before JAX starts.
def _dep(x, o):   # the next step depends on this one's output, at ~no cost
    import jax.numpy as jnp
    return x.at[0, 0].add((o.reshape(-1)[0].astype(jnp.float32) * 0).astype(x.dtype))


def _dequant(d):
    import jax.numpy as jnp
    return (d.x.astype(jnp.float32) * jnp.repeat(d.x_scales, 128, axis=-1)).astype(jnp.bfloat16)


def _compute(z, mm, matmuls):
    import jax.numpy as jnp
    for _ in range(matmuls):
        z = (z @ mm).astype(jnp.bfloat16)
    return z


def _expert_out(d, y):
    import jax
    return jax.lax.optimization_barrier((y, d.count))[0]


def _ll_round(x, i, w, y, cfg):
    import jax_ep
    d = jax_ep.low_latency_dispatch(x, i, cfg)
    return jax_ep.low_latency_combine(_expert_out(d, y), i, w, d.handle, cfg)


def _global_inputs(b: _Bench, R, T, H, E, K):
    """x [R*T, H], idx [R*T, K], w [R*T, K], mm [R*H, H], y [E, R*T, H], sharded on ep."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    rng = np.random.default_rng(0)
    idx = np.argsort(rng.random((R * T, E)), axis=1)[:, :K].astype(np.int32)   # uniform, distinct
    x = rng.standard_normal((R * T, H)).astype(jnp.bfloat16)
    w = rng.random((R * T, K)).astype(np.float32)
    m = (rng.standard_normal((R * H, H)) / np.sqrt(H)).astype(jnp.bfloat16)

    def glob(a):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, NamedSharding(b.mesh, b.spec), lambda i: a[i])

    # The experts' output: a fixed bf16 [L, R*Tmax, H] input, ordered after the
    # dispatch by an optimization barrier (no work). An elementwise stand-in over
    # the whole layout would dominate: it has E*Tmax rows (32768 at V3-decode)
    # of which T*K (1024) hold tokens; real experts (a masked grouped GEMM) read
    # only those.
    L = E // R
    y_host = rng.standard_normal((R * L, R * T, H), dtype=np.float32).astype(jnp.bfloat16)
    return [glob(a) for a in (x, idx, w, m, y_host)]


def _step_fns(b: _Bench):
    """(name, prologue or None, step): a step is step(x, i, w, mm, y, pre)."""
    import jax
    import jax.numpy as jnp

    import jax_ep

    args, ll_cfg, ref_cfg, nrm_cfg = b.args, b.ll_cfg, b.ref_cfg, b.nrm_cfg

    def compute(z, mm):
        return _compute(z, mm, args.matmuls)

    yield "ll dispatch (fp8)", None, lambda x, i, w, mm, y, h: _dep(
        x, jax_ep.low_latency_dispatch(x, i, ll_cfg).x.view(jnp.uint8))

    def one_dispatch(x, i, w, mm, y):
        return jax_ep.low_latency_dispatch(x, i, ll_cfg)

    def combine_only(x, i, w, mm, y, d):
        return jax_ep.low_latency_combine(
            jax.lax.optimization_barrier((y, x))[0], i, w, d.handle, ll_cfg)
    yield "ll combine (bf16)", one_dispatch, combine_only
    yield "ll round trip", None, lambda x, i, w, mm, y, h: _ll_round(x, i, w, y, ll_cfg)
    yield "xla round trip (reference)", None, lambda x, i, w, mm, y, h: _ll_round(
        x, i, w, y, ref_cfg)
    if not args.no_normal:
        def normal(x, i, w, mm, y, h):
            d = jax_ep.dispatch(x, i, w, nrm_cfg)
            return jax_ep.combine(_dequant(d), d, nrm_cfg)
        yield "normal round trip (fp8, expert_major; dequant of its [C, H])", None, normal
    yield (f"compute X ({args.matmuls} matmuls)", None,
           lambda x, i, w, mm, y, h: compute(x, mm))

    def sequential(x, i, w, mm, y, h):   # the compute strictly after the round trip
        d = jax_ep.low_latency_dispatch(x, i, ll_cfg)
        out = jax_ep.low_latency_combine(_expert_out(d, y), i, w, d.handle, ll_cfg)
        z = compute(compute(_dep(x, out), mm), mm)
        return out + z * 0
    yield "sequential (round trip + 2 X)", None, sequential

    def hooked(x, i, w, mm, y, h):
        p = jax_ep.low_latency_dispatch_send(x, i, ll_cfg)
        z = compute(x, mm)
        d = jax_ep.low_latency_dispatch_recv(p)
        q = jax_ep.low_latency_combine_send(_expert_out(d, y), i, w, d.handle, ll_cfg)
        z = compute(z, mm)
        return jax_ep.low_latency_combine_recv(q) + z * 0
    yield "hooked (send, X, recv) x 2", None, hooked


def _chain(b: _Bench, pre, fn, n):
    import jax

    def body(x, i, w, mm, y):
        h = pre(x, i, w, mm, y) if pre is not None else None
        for _ in range(n):
            o = fn(x, i, w, mm, y, h)
            x = _dep(x, o)
        return x
    return jax.jit(jax.shard_map(body, mesh=b.mesh, in_specs=(b.spec,) * 5, out_specs=b.spec))


def _timed(b: _Bench, f):
    import jax
    for _ in range(2):
        jax.block_until_ready(f(*b.ins))
    ts = []
    for _ in range(b.args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*b.ins))
        ts.append(time.perf_counter() - t0)
    return ts


def _measure(b: _Bench, n_lo, n_hi):
    """(name, median, min, max) µs per step of every row; NaNs for a failed one."""
    import numpy as np
    rows = []
    for name, pre, fn in _step_fns(b):
        try:
            f_lo, f_hi = _chain(b, pre, fn, n_lo), _chain(b, pre, fn, n_hi)
            lo, hi = _timed(b, f_lo), _timed(b, f_hi)
            per = [(y - x) / (n_hi - n_lo) * 1e6 for x, y in zip(lo, hi)]
            rows.append((name, float(np.median(per)), float(np.min(per)), float(np.max(per))))
        except Exception as e:  # noqa: BLE001 - one failed row does not hide the rest
            rows.append((name, float("nan"), float("nan"), float("nan")))
            b.log(f"{name}: {type(e).__name__}: {str(e)[:400]}")
    return rows


def _print_table(b: _Bench, rows, R, T, H, E, K, n_lo, n_hi):
    import jax
    args, log = b.args, b.log
    dev = jax.local_devices()[0].device_kind
    log(f"\n# Low-latency decode bench — {R}x {dev}, {datetime.date.today().isoformat()}, "
        f"command buffers {'ON' if args.graphs else 'off'}, ll_transport {args.ll_transport}\n")
    log(f"T {T} per rank, H {H}, E {E}, top-{K}; fp8 dispatch (f32 scales), bf16 combine; "
        f"jax {jax.__version__}; per step: median over {args.reps} reps of "
        f"(t({n_hi}) - t({n_lo})) / {n_hi - n_lo}, chained steps in one jit\n")
    log("| op | us per step (median) | min | max |")
    log("|---|---|---|---|")
    for name, mid, lo, hi in rows:
        log(f"| {name} | {mid:.1f} | {lo:.1f} | {hi:.1f} |")


def main():
    args = _parse_args()
    if args.graphs:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + GRAPH_FLAGS).strip()

    sys.path.insert(0, ROOT)
    from jax_ep.config import EpConfig
    from jax_ep.launch import init_distributed

    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    ll_cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, backend="native",
                      ll_transport=args.ll_transport)
    info = init_distributed(native=True, low_latency=ll_cfg)

    import jax
    from jax.sharding import PartitionSpec as P

    import jax_ep

    R = jax.process_count()
    rank = jax.process_index()
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    if not info.native:
        log("native runtime not up:", jax_ep.runtime.unavailable_reason())
        return 1
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    ref_cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, backend="reference")
    nrm_cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, backend="native",
                       fp8_dispatch=True)
    b = _Bench(args, ll_cfg, ref_cfg, nrm_cfg, mesh, P("ep"), log)
    b.ins = _global_inputs(b, R, T, H, E, K)
    n_lo, n_hi = (int(v) for v in args.steps.split(","))
    rows = _measure(b, n_lo, n_hi)
    _print_table(b, rows, R, T, H, E, K, n_lo, n_hi)
    jax_ep.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
