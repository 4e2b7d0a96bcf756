"""A MaxText-style sparse MoE layer whose expert-parallel exchange is a ragged all-to-all.

The layer does what MaxText's sparse ``RoutedMoE`` path does with expert
parallelism: route (softmax, top-k, renormalised), sort the (token, expert)
pairs by expert, send each rank the rows of its experts with
``ragged_all_to_all`` into a worst-case buffer, sort the received rows by
local expert, run the SwiGLU experts as grouped matmuls
(``jax_ep.grouped_matmul``), undo the local sort, send the rows back with a
second ``ragged_all_to_all`` and undo the expert sort, weighting each pair.

It is written against ``jax.lax.ragged_all_to_all``'s API; the one line
below (``from jax_ep import ragged_all_to_all``) moves it onto jax_ep's,
which runs on CPU (the reference backend) and, after
``jax_ep.initialize(ragged_bytes=...)``, on jax_ep's kernel.

CPU (default; 8 fake devices, ep=8, reference backend)::

    python examples/ragged_moe.py --steps 3

One GPU, comparing the loss with lax's own ragged_all_to_all::

    python examples/ragged_moe.py --platform gpu --backend native --compare-lax

Several processes (one GPU each, or sharing GPUs)::

    python -m jax_ep.launch -n 2 examples/ragged_moe.py --backend native
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("auto", "reference", "native"), default="auto",
                   help="jax_ep backend of ragged_all_to_all (RaggedConfig.backend)")
    p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: gpu with --backend native or under the launcher on GPUs, else "
                        "cpu with 8 fake devices")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="tokens per device")
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--d-ff", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-lax", action="store_true",
                   help="also run every step with jax.lax.ragged_all_to_all (where XLA runs "
                        "it: GPUs, one process) and compare the losses")
    return p.parse_args(argv)


def _want_gpu(args) -> bool:
    if args.platform != "auto":
        return args.platform == "gpu"
    return args.backend == "native" or os.environ.get("JAX_EP_PLATFORM") == "gpu"


def configure_platform(args) -> None:
    """Before jax is imported: 8 fake CPU devices unless GPUs are wanted."""
    if _want_gpu(args) or "JAX_EP_NUM_PROCESSES" in os.environ:
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


if __name__ == "__main__":
    _ARGS = parse_args()
    configure_platform(_ARGS)

try:
    import jax_ep  # noqa: E402
except ImportError:  # running from a source checkout without `pip install`
    sys.path.insert(0, os.path.dirname(HERE))
    import jax_ep  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

# The one line that moves this layer from XLA's collective to jax_ep's
# (it was: from jax.lax import ragged_all_to_all).
from jax_ep import ragged_all_to_all  # noqa: E402

F32 = jnp.float32


def init_params(key, d_model: int, d_ff: int, experts: int):
    """Router ``gate [H, E]`` and SwiGLU experts ``wi_0, wi_1 [E, H, F]``, ``wo [E, F, H]``."""
    k = jax.random.split(key, 4)
    s_in, s_ff = d_model ** -0.5, d_ff ** -0.5
    return {"gate": s_in * jax.random.normal(k[0], (d_model, experts), F32),
            "wi_0": s_in * jax.random.normal(k[1], (experts, d_model, d_ff), F32),
            "wi_1": s_in * jax.random.normal(k[2], (experts, d_model, d_ff), F32),
            "wo": s_ff * jax.random.normal(k[3], (experts, d_ff, d_model), F32)}


def route(x, gate, topk: int):
    """-> (weights [T, K] f32, summing to 1 per token; expert ids [T, K])."""
    probs = jax.nn.softmax(jnp.dot(x.astype(F32), gate), axis=-1)
    w, idx = jax.lax.top_k(probs, topk)
    return w / jnp.sum(w, axis=-1, keepdims=True), idx


def _excl_cumsum(v, axis=-1):
    return jnp.cumsum(v, axis=axis) - v


def exchange_params(group_sizes, axis: str):
    """The ragged_all_to_all arguments of the dispatch, from every rank's rows
    per expert (MaxText's ``get_all_to_all_params``) -> (forward args, return
    args, rows per (source rank, local expert) ``[R, L]`` received here)."""
    R, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    every = jax.lax.all_gather(group_sizes, axis)               # [R, E]
    L = every.shape[1] // R
    per = every.reshape(R, R, L).sum(-1)                         # [src, dst] rows
    sent, got = per[r], per[:, r]
    fwd = (_excl_cumsum(sent), sent, _excl_cumsum(per, axis=0)[r], got)
    back = (_excl_cumsum(got), got, _excl_cumsum(per, axis=1)[:, r], sent)
    local = jax.lax.dynamic_slice_in_dim(every, r * L, L, axis=1)  # [R, L]
    return fwd, back, local


def local_permute(rows, local):
    """Rows received by (source rank, local expert) -> grouped by local expert
    (rows past the received ones last) -> (sorted rows, permutation, group sizes [L])."""
    R, L = local.shape
    ends = jnp.cumsum(local.reshape(-1))
    i = jnp.arange(rows.shape[0], dtype=ends.dtype)
    block = jnp.searchsorted(ends, i, side="right")
    expert = jnp.where(block < R * L, block % L, L)
    perm = jnp.argsort(expert, stable=True)
    return rows[perm], perm, jnp.sum(local, axis=0).astype(jnp.int32)


def experts(x, gs, wi_0, wi_1, wo):
    """SwiGLU of each local expert over its rows (grouped matmuls; tail rows 0)."""
    h = jax.nn.silu(jax_ep.grouped_matmul(x, wi_0, gs)) * jax_ep.grouped_matmul(x, wi_1, gs)
    return jax_ep.grouped_matmul(h.astype(x.dtype), wo, gs)


def moe_per_rank(x, gate, wi_0, wi_1, wo, *, axis: str, topk: int, a2a, config):
    """One rank's tokens ``x [T, H]`` through the layer (inside jax.shard_map)."""
    T, H = x.shape
    E = gate.shape[1]
    R = jax.lax.axis_size(axis)
    w, idx = route(x, gate, topk)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)                  # pairs sorted by expert
    sorted_x = x[order // topk]
    group_sizes = jnp.zeros((E,), jnp.int32).at[flat].add(1)
    fwd, back, local = exchange_params(group_sizes, axis)
    kw = dict(axis_name=axis, **({"config": config} if config is not None else {}))
    buffer = jnp.zeros((R * T * topk, H), x.dtype)          # the worst case, as MaxText
    received = a2a(sorted_x, buffer, *fwd, **kw)
    rows, perm, gs = local_permute(received, local)
    y = experts(rows, gs, wi_0, wi_1, wo)
    y = jnp.zeros_like(y).at[perm].set(y)                    # back to arrival order
    home = a2a(y, jnp.zeros((T * topk, H), y.dtype), *back, **kw)
    pairs = jnp.zeros_like(home).at[order].set(home).reshape(T, topk, H)
    return jnp.einsum("tk,tkh->th", w, pairs.astype(F32)).astype(x.dtype)


def moe_layer(params, x, mesh, topk: int, a2a=None, config=None, axis: str = "ep"):
    """The layer on global arrays: tokens ``x [N, H]`` split over ``axis``,
    experts ``[E, ...]`` sharded over it, the router replicated. ``a2a``:
    the ragged_all_to_all to use (default: this module's, jax_ep's)."""
    a2a = ragged_all_to_all if a2a is None else a2a
    cfg = config if a2a is jax_ep.ragged_all_to_all else None
    body = lambda x, g, w0, w1, wo: moe_per_rank(x, g, w0, w1, wo, axis=axis, topk=topk,
                                                 a2a=a2a, config=cfg)
    ex = P(axis)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P(), ex, ex, ex), out_specs=P(axis))
    return f(x, params["gate"], params["wi_0"], params["wi_1"], params["wo"])


def moe_dense(params, x, topk: int):
    """The same layer without expert parallelism: every token through its top-k
    experts by dense einsums (the oracle for tests)."""
    w, idx = route(x, params["gate"], topk)
    g = jnp.einsum("nh,ehf->nef", x, params["wi_0"])
    u = jnp.einsum("nh,ehf->nef", x, params["wi_1"])
    y = jnp.einsum("nef,efh->neh", jax.nn.silu(g) * u, params["wo"])   # [N, E, H]
    picked = jnp.take_along_axis(y, idx[:, :, None], axis=1)            # [N, K, H]
    return jnp.einsum("nk,nkh->nh", w, picked.astype(F32)).astype(x.dtype)


def make_step(mesh, topk: int, lr: float, a2a=None, config=None):
    """A jitted SGD step on ``mean((layer(x) - target)^2)`` -> (params, loss)."""
    def loss(params, x, target):
        y = moe_layer(params, x, mesh, topk, a2a=a2a, config=config)
        return jnp.mean(jnp.square(y.astype(F32) - target.astype(F32)))

    @jax.jit
    def step(params, x, target):
        value, grads = jax.value_and_grad(loss)(params, x, target)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), value

    return step


def make_mesh(n: int, axis: str = "ep"):
    """A 1-D mesh of n devices with an Auto axis (jit places the arrays)."""
    return jax.make_mesh((n,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))


def _setup(args):
    """-> (mesh, params, x, target, RaggedConfig) on every device of the job."""
    n = jax.device_count()
    if args.experts % n:
        raise SystemExit(f"--experts {args.experts} must divide over the {n} devices")
    mesh = make_mesh(n)
    shard = lambda spec: NamedSharding(mesh, spec)
    params = jax.jit(lambda: init_params(jax.random.key(args.seed), args.d_model, args.d_ff,
                                         args.experts),
                     out_shardings={"gate": shard(P()), "wi_0": shard(P("ep")),
                                    "wi_1": shard(P("ep")), "wo": shard(P("ep"))})()
    rng = np.random.default_rng(args.seed)
    shape = (n * args.tokens, args.d_model)
    data = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    x, target = (jax.make_array_from_callback(shape, shard(P("ep")), lambda i, a=a: a[i])
                 for a in data)
    return mesh, params, x, target, jax_ep.RaggedConfig(backend=args.backend)


def train(args, verbose: bool = True) -> dict:
    """``args.steps`` SGD steps -> {"losses": [...], "lax_losses": [...] or None}."""
    say = print if verbose and jax.process_index() == 0 else (lambda *a, **k: None)
    mesh, params, x, target, cfg = _setup(args)
    say(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, ep={jax.device_count()}, "
        f"{args.experts} experts, top-{args.topk}, {args.tokens} tokens per device")
    step = make_step(mesh, args.topk, args.lr, config=cfg)
    lax_step = (make_step(mesh, args.topk, args.lr, a2a=jax.lax.ragged_all_to_all)
                if args.compare_lax else None)
    res = {"losses": [], "lax_losses": [] if lax_step else None}
    p_ep, p_lax = params, params
    for i in range(args.steps):
        p_ep, loss = step(p_ep, x, target)
        res["losses"].append(float(loss))
        line = f"step {i}: loss {float(loss):.6f}"
        if lax_step:
            p_lax, loss_lax = lax_step(p_lax, x, target)
            res["lax_losses"].append(float(loss_lax))
            line += f"  lax {float(loss_lax):.6f}"
        say(line)
    if lax_step:
        diff = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(res["losses"], res["lax_losses"]))
        say(f"losses equal to lax's: {res['losses'] == res['lax_losses']} (largest relative "
            f"difference {diff:.3g})")
    return res


def main(argv=None) -> int:
    args = _ARGS if (argv is None and "_ARGS" in globals()) else parse_args(argv)
    if "JAX_EP_NUM_PROCESSES" in os.environ or _want_gpu(args):
        from jax_ep.launch import init_distributed
        # the ragged region: the dispatch buffer, R * T * K rows of d_model f32
        n = int(os.environ.get("JAX_EP_NUM_PROCESSES", "1"))
        info = init_distributed(native=args.backend != "reference",
                                ragged_bytes=n * args.tokens * args.topk * args.d_model * 4)
        if args.backend == "native" and not info.native:
            raise SystemExit("--backend native: the jax_ep native runtime did not start")
    res = train(args)
    return 0 if all(np.isfinite(res["losses"])) else 1


if __name__ == "__main__":
    sys.exit(main())
