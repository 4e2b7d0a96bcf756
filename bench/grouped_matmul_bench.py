"""Benchmark jax_ep.grouped_matmul on one GPU at DeepSeek-V3 per-rank shapes.

    python bench/grouped_matmul_bench.py [--sweep] [--no-xla] [--reps 20]

G=128 experts, M=32768 rows (~256 per expert), bf16:
  up   projection x [M, 7168] @ w [G, 7168, 4096]
  down projection x [M, 2048] @ w [G, 2048, 7168]
for uniform and skewed (Zipf-like, a quarter of the experts empty) group sizes
and for the forward, dx (= dy @ w[g]^T) and dw (= x[g]^T @ dy[g]).

Timing: each op is chained n times inside one jit (a fori_loop whose input
passes through an optimization barrier with the previous output, so nothing is
hoisted or skipped and every output is fully materialised); per-call time =
(t(n2) - t(n1)) / (n2 - n1), median over --reps repetitions after warm-up.
TF/s counts useful FLOPs 2 * sum(group_sizes) * K * N. "dense" is the same-M
dense matmul of the same shape (x @ w[0], dy @ w[0]^T, x^T @ dy) in the same
run; ratio = grouped TF/s / dense TF/s. For uniform sizes an "xla batched"
row times XLA's batched matmul over [G, M/G] rows per group, the padded
layer's expert matmuls, which stream the same weights (at --rows 8192 the
kernels the V3 layer runs at T 128). The XLA (jax.lax.ragged_dot) rows
are ~100x slower: they use --xla-reps repetitions of 1 vs 2 calls
(--no-xla skips them).

--sweep additionally times a few tile configurations per op (uniform sizes),
to pick GroupedMatmulConfig defaults; --sweep-small times a few targeted ones
(SWEEP_SMALL: the 1-warpgroup forward/dx and dw kernels). Sweep rows use the same timing method as the main
rows (same n1/n2, --sweep-reps repetitions), so they are directly comparable.

Prints one markdown table; writes it to $OUT/grouped_matmul.md when OUT is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from jax_ep import gmm as gm_mod  # noqa: E402
from jax_ep.gmm import GroupedMatmulConfig  # noqa: E402
from jax_ep.gmm.select import op_tiles  # noqa: E402

G, M = 128, 32768
PROJ = {"up": (7168, 4096), "down": (2048, 7168)}

SWEEP = {
    "fwd": [(128, 128, 64, 5, 0), (128, 128, 64, 4, 4), (128, 128, 64, 5, 2),
            (128, 128, 64, 4, 8), (64, 256, 64, 4, 4), (128, 256, 64, 3, 2), (192, 128, 64, 4, 4),
            (128, 128, 128, 3, 4)],
    "dw": [(128, 128, 64, 4, 4), (128, 128, 64, 4, 1), (128, 128, 64, 2, 4),
           (64, 256, 64, 4, 4), (128, 256, 64, 3, 2), (128, 128, 128, 2, 4)],
}
SWEEP["dx"] = SWEEP["fwd"]

# --sweep-small: a few targeted configs (op -> [(tiles, config kwargs, dists)]);
# one GPU run with --no-xla --sweep-small should take ~90 s.
# Configurations measured slower and deleted, with their numbers: docs/decisions.md.
# The lists hold the next targeted configurations.
SWEEP_SMALL = {"fwd": [], "dx": [], "dw": []}


LAYER_GROUPS = 112   # "layer" sizes: the groups that fit M rows


def group_sizes(kind, seed=0):
    """``[G]`` int32 rows per group, summing to at most M: ``"uniform"`` (M / G
    each), ``"layer"`` (the V3 layer's groups at EP 1, T 4096, 128 experts:
    routed rows ~N(256, 15.5), as its router gives at initialization, 222-305,
    each padded by dispatch to a multiple of 64, so 256 or 320 rows; the
    first LAYER_GROUPS of them, about 32000 rows, the rest empty), else
    skewed."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        s = np.full(G, M // G)
    elif kind == "layer":
        routed = np.clip(np.rint(rng.normal(256, 15.5, G)), 1, None)
        s = (np.ceil(routed / 64) * 64).astype(np.int64)
        s[LAYER_GROUPS:] = 0
        if s.sum() > M:
            raise ValueError(f"group_sizes('layer'): its groups need {s.sum()} rows, M is {M} "
                             "(the V3 layer's rows: run without --rows / --scale)")
    else:   # Zipf-like (exponent 1.2), a quarter of the groups empty, sum = M
        p = 1.0 / np.arange(1, G + 1) ** 1.2
        rng.shuffle(p)
        p[rng.permutation(G)[: G // 4]] = 0
        s = np.floor(p / p.sum() * M).astype(np.int64)
        s[np.argmax(s)] += M - s.sum()
    return s.astype(np.int32)


def real_row_mask(sizes, real):
    """[M] bool: the first ``real`` rows of every group (the rest of the group
    and the tail are zero in the layer: the dispatch's 64-row alignment pads
    each expert's ~8 routed rows at T 128 with zeros)."""
    off = np.concatenate([[0], np.cumsum(sizes)])
    mask = np.zeros(M, bool)
    for a, b in zip(off[:-1], off[1:]):
        mask[a:min(b, a + real)] = True
    return mask


def chained(fn):
    """jit of: n sequential calls of fn(a) (a = the first operand), returns the last output
    (an array or a pytree of them).

    ``n`` is a traced argument, so t(n1) and t(n2) run the SAME executable (a
    while loop): with a static trip count XLA inlines a 1-trip loop, which made
    the old (1, 3) sweep rows incomparable with the (2, 6) main rows.
    """
    def run(n, a, *rest):
        out0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, a, *rest))

        def body(_, carry):
            a, out = carry
            a, _ = lax.optimization_barrier((a, out))
            return a, fn(a, *rest)

        return lax.fori_loop(0, n, body, (a, out0))[1]
    return jax.jit(run)


def _one_rep(fn, args, n1, n2):
    """A warmed-up timer of ``fn``: each call times n1 and n2 chained calls
    and returns the seconds per call, (t(n2) - t(n1)) / (n2 - n1)."""
    f = chained(fn)
    f1 = lambda *a: f(jnp.int32(n1), *a)
    f2 = lambda *a: f(jnp.int32(n2), *a)
    jax.block_until_ready(f1(*args))
    jax.block_until_ready(f2(*args))

    def rep():
        t0 = time.perf_counter()
        jax.block_until_ready(f1(*args))
        t1 = time.perf_counter()
        jax.block_until_ready(f2(*args))
        t2 = time.perf_counter()
        return ((t2 - t1) - (t1 - t0)) / (n2 - n1)
    return rep


def per_call_ms(fn, args, n1, n2, reps):
    rep = _one_rep(fn, args, n1, n2)
    return float(np.median([rep() for _ in range(reps)])) * 1e3


def paired_ms(fn_a, args_a, fn_b, args_b, n1, n2, reps):
    """``fn_a`` and ``fn_b`` timed alternately, rep by rep, so both see the
    same clocks (a GPU's clock moves with its power and heat between runs):
    -> (median ms of a, median ms of b, the per-rep ratios b / a)."""
    rep_a, rep_b = _one_rep(fn_a, args_a, n1, n2), _one_rep(fn_b, args_b, n1, n2)
    pairs = [(rep_a(), rep_b()) for _ in range(reps)]
    a, b = (np.array(v) for v in zip(*pairs))
    return float(np.median(a)) * 1e3, float(np.median(b)) * 1e3, b / a


def ops(cfg):
    """op -> (grouped fn(a, *rest), dense fn(a, *rest), operands builder)."""
    hi = jax.lax.Precision.DEFAULT
    return {
        "fwd": (lambda x, w, gs: gm_mod.gmm(x, w, gs, config=cfg),
                lambda x, w0: jnp.dot(x, w0, precision=hi)),
        "dx": (lambda dy, w, gs: gm_mod.gmm(dy, w, gs, transpose_rhs=True, config=cfg),
               lambda dy, w0: jnp.dot(dy, w0.T, precision=hi)),
        "dw": (lambda x, dy, gs: gm_mod.tgmm(x, dy, gs, config=cfg),
               lambda x, dy: jnp.dot(x.T, dy, precision=hi)),
    }


def batched(op):
    """XLA's batched matmul over [G, M/G] rows per group (uniform sizes only):
    the padded layer's expert matmuls (``moe_layer_step --impls xla_padded``),
    streaming the same weights as the grouped row."""
    def rows(a):
        return a.reshape(G, -1, a.shape[1])
    return {
        "fwd": lambda x, w: jnp.einsum("gmk,gkn->gmn", rows(x), w).reshape(-1, w.shape[2]),
        "dx": lambda dy, w: jnp.einsum("gmn,gkn->gmk", rows(dy), w).reshape(-1, w.shape[1]),
        "dw": lambda x, dy: jnp.einsum("gmk,gmn->gkn", rows(x), rows(dy)),
    }[op]


def operands(op, x, w, dy, gs):
    if op == "fwd":
        return (x, w, gs), (x, w[0])
    if op == "dx":
        return (dy, w, gs), (dy, w[0])
    return (x, dy, gs), (x, dy)


def _parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--n1", type=int, default=2)
    ap.add_argument("--n2", type=int, default=6)
    ap.add_argument("--no-xla", action="store_true", help="skip the jax.lax.ragged_dot rows")
    ap.add_argument("--xla-reps", type=int, default=2)
    ap.add_argument("--sweep", action="store_true", help="also time a few tile configurations")
    ap.add_argument("--sweep-small", action="store_true",
                    help="also time a few targeted configurations (SWEEP_SMALL)")
    ap.add_argument("--sweep-reps", type=int, default=5)
    ap.add_argument("--sweep-ops", default=None,
                    help="the ops whose --sweep-small rows run (default: --ops)")
    ap.add_argument("--proj", default="up,down")
    ap.add_argument("--dist", default="uniform,skewed")
    ap.add_argument("--ops", default="fwd,dx,dw")
    ap.add_argument("--impl", default="pallas", help="implementation of the main rows")
    ap.add_argument("--rows", type=int, default=None,
                    help="M, the rows of all groups (default 32768; 8192: 64 per group)")
    ap.add_argument("--real-rows", type=int, default=None,
                    help="random data only in the first N rows of each group, zeros in the "
                         "rest (the layer at T 128: --rows 8192 --real-rows 8); the standalone "
                         "gains of small tiles on all-random rows did not carry into the layer")
    ap.add_argument("--scale", type=int, default=1,
                    help="divide M, K, N by this (smoke tests on CPU)")
    return ap.parse_args()


def _apply_shape_args(args):
    """--rows and --scale set the module's M and PROJ shapes."""
    global M
    if args.rows:
        M = args.rows
    if args.scale > 1:
        M //= args.scale
        for p_, (k_, n_) in list(PROJ.items()):
            PROJ[p_] = (k_ // args.scale, n_ // args.scale)


@dataclasses.dataclass
class _Case:
    """One (projection, group sizes, op) row group: its operands and its dense baseline."""
    proj: str
    dist: str
    op: str
    gfn: Callable
    g_args: tuple
    flops: float
    dense_tf: float


def _emit(rows, row):
    rows.append(row)
    print("# |", " | ".join(rows[-1]), "|", flush=True)


def _main_row(args, pallas, c: _Case, rows):
    # the tiles the main row asks for (small groups: the small-group tiles)
    main_tiles = str(op_tiles(pallas, c.op, c.g_args[0], c.g_args[1], G).astuple())
    try:
        ms = per_call_ms(c.gfn, c.g_args, args.n1, args.n2, args.reps)
        tf = c.flops / ms / 1e9
        row = (c.proj, c.dist, c.op, args.impl, main_tiles, f"{ms:.3f}",
               f"{tf:.0f}", f"{c.dense_tf:.0f}", f"{tf / c.dense_tf:.2f}")
    except Exception as e:  # noqa: BLE001
        row = (c.proj, c.dist, c.op, args.impl, main_tiles,
               f"FAILED {type(e).__name__}: {str(e)[:80]}", "", f"{c.dense_tf:.0f}", "")
    _emit(rows, row)


def _sweep_rows(args, c: _Case, rows):
    sweep = []
    if args.sweep and c.dist == "uniform":
        sweep += [(t, {}) for t in SWEEP[c.op]]
    if args.sweep_small and c.op in (args.sweep_ops or args.ops).split(","):
        sweep += [(t, kw) for t, kw, dists in SWEEP_SMALL.get(c.op, ()) if c.dist in dists]
    if not sweep:
        return
    # every sweep row's output against the main row's (rel. Frobenius)
    main_out = jnp.asarray(jax.jit(c.gfn)(*c.g_args), jnp.float32)
    for tiles, kw in sweep:
        cfg = GroupedMatmulConfig(impl="pallas", **{c.op: tiles}, **kw)
        label = "pallas (sweep" + "".join(f", {a}={v}" for a, v in kw.items()) + ")"
        try:
            # same method as the main rows (n1, n2), fewer reps
            ms = per_call_ms(ops(cfg)[c.op][0], c.g_args, args.n1, args.n2, args.sweep_reps)
            out = jnp.asarray(jax.jit(ops(cfg)[c.op][0])(*c.g_args), jnp.float32)
            err = float(jnp.linalg.norm(out - main_out) / jnp.linalg.norm(main_out))
            label += f" err {err:.1e}"
            r = (f"{ms:.3f}", f"{c.flops / ms / 1e9:.0f}",
                 f"{c.flops / ms / 1e9 / c.dense_tf:.2f}")
        except Exception as e:  # noqa: BLE001
            r = (f"FAILED {type(e).__name__}: {str(e)[:60]}", "", "")
        _emit(rows, (c.proj, c.dist, c.op, label, str(tiles), r[0], r[1],
                     f"{c.dense_tf:.0f}", r[2]))


def _batched_row(args, c: _Case, rows):
    ms = per_call_ms(batched(c.op), c.g_args[:2], args.n1, args.n2, args.reps)
    tf = c.flops / ms / 1e9
    _emit(rows, (c.proj, c.dist, c.op, "xla batched (padded layer)", "-", f"{ms:.3f}",
                 f"{tf:.0f}", f"{c.dense_tf:.0f}", f"{tf / c.dense_tf:.2f}"))


def _ragged_dot_row(args, xla, c: _Case, rows):
    xfn = ops(xla)[c.op][0]
    try:
        ms = per_call_ms(xfn, c.g_args, 1, 2, args.xla_reps)
        tf = c.flops / ms / 1e9
        row = (c.proj, c.dist, c.op, "xla ragged_dot", "-", f"{ms:.3f}",
               f"{tf:.1f}", f"{c.dense_tf:.0f}", f"{tf / c.dense_tf:.3f}")
    except Exception as e:  # noqa: BLE001
        row = (c.proj, c.dist, c.op, "xla ragged_dot", "-",
               f"FAILED {type(e).__name__}: {str(e)[:80]}", "", f"{c.dense_tf:.0f}", "")
    _emit(rows, row)


def _proj_rows(args, pallas, xla, proj, key, dense_cache, rows):
    """Every row of one projection: each group-size distribution, each op."""
    k, n = PROJ[proj]
    kx, kw, kd = jax.random.split(jax.random.fold_in(key, k), 3)
    x = x0 = jax.random.normal(kx, (M, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (G, k, n), jnp.bfloat16) * (1.0 / np.sqrt(k))).astype(jnp.bfloat16)
    dy = dy0 = jax.random.normal(kd, (M, n), jnp.bfloat16)
    for dist in args.dist.split(","):
        sizes = group_sizes(dist)
        gs = jnp.asarray(sizes)
        if args.real_rows is not None:   # the layer's groups: real rows, then zeros
            keep = jnp.asarray(real_row_mask(sizes, args.real_rows))[:, None]
            x = jnp.where(keep, x0, jnp.zeros((), x0.dtype))
            dy = jnp.where(keep, dy0, jnp.zeros((), dy0.dtype))
        flops = 2.0 * float(sizes.sum()) * k * n
        for op in args.ops.split(","):
            g_args, d_args = operands(op, x, w, dy, gs)
            gfn, dfn = ops(pallas)[op]
            if (proj, op) not in dense_cache:    # same shapes for every dist
                dense_cache[proj, op] = per_call_ms(dfn, d_args, args.n1, args.n2, args.reps)
            dense_tf = 2.0 * M * k * n / dense_cache[proj, op] / 1e9
            c = _Case(proj, dist, op, gfn, g_args, flops, dense_tf)
            _main_row(args, pallas, c, rows)
            _sweep_rows(args, c, rows)
            if dist == "uniform" and M % G == 0:
                _batched_row(args, c, rows)
            if not args.no_xla:
                _ragged_dot_row(args, xla, c, rows)


def _table(args, dev, rows, t_start):
    head = ("proj", "sizes", "op", "impl", "tiles (bm,bn,bk,stages,band)", "ms/call",
            "TF/s", "dense TF/s", "ratio")
    lines = [f"Grouped matmul, {dev.device_kind}, jax {jax.__version__}: G={G}, M={M}, bf16, "
             + (f"random data in the first {args.real_rows} rows of each group, "
                if args.real_rows is not None else "")
             + f"median of {args.reps} (xla: {args.xla_reps}), "
             f"{time.perf_counter() - t_start:.0f} s total", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main():
    args = _parse_args()
    _apply_shape_args(args)
    dev = jax.devices()[0]
    print(f"# device: {dev.device_kind}, jax {jax.__version__}", flush=True)
    pallas = GroupedMatmulConfig(impl=args.impl)
    xla = GroupedMatmulConfig(impl="xla")
    rows = []
    dense_cache = {}
    key = jax.random.key(0)
    t_start = time.perf_counter()
    for proj in args.proj.split(","):
        _proj_rows(args, pallas, xla, proj, key, dense_cache, rows)

    table = _table(args, dev, rows, t_start)
    print()
    print(table)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "grouped_matmul.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
