"""Forward+backward step time of the DeepSeek-V3-style MoE layer, native vs XLA.

Runs ``examples/moe_layer.py``'s block (router, shared expert, routed SwiGLU
experts through jax_ep dispatch -> ragged_dot -> combine) with
``backend="native"`` (jax_ep's CUDA/NVSHMEM kernels) beside the very same layer
with ``backend="reference"``, which is XLA's dense all_to_all path (static
capacity, per-rank dedup). Under the launcher, one process per GPU::

    python -m jax_ep.launch -n 2 bench/moe_layer_step.py
    python -m jax_ep.launch -n 2 bench/moe_layer_step.py --tokens 4096 --dtype bfloat16 \\
        --iters 50 --inner 4 --json bench/results/moe_layer_step.json

Default shapes are DeepSeek-V3's: H=7168, 256 routed experts of width 2048,
top-8 with 8 groups / best 4, one shared expert, 4096 tokens per GPU, bf16.

What is timed, per backend (medians over ``--iters`` calls after ``--warmup``):

* ``layer``: one jitted call computing the loss ``sum(out * ct)`` and its
  gradient wrt all parameters and the input. With ``--inner k`` the call runs k
  chained steps in a ``fori_loop`` (the input of step i+1 depends on step i's
  input gradient) and the time is divided by k, which removes the ~200 us
  host overhead of a multi-process dispatch from the per-step figure.
* ``d+c``: the same kind of call on dispatch -> combine alone (identity
  experts, the layer's routing), forward + backward; ``share`` is d+c / layer.

A CPU smoke run (tiny shapes, reference only) works too::

    python bench/moe_layer_step.py --platform cpu --backends reference --tokens 64 \\
        --hidden 64 --experts 8 --topk 2 --d-ff 32 --n-groups 1 --topk-groups 1
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="MoE layer fwd+bwd: jax_ep native vs XLA all_to_all")
    p.add_argument("--backends", default="native,reference",
                   help="comma list of jax_ep backends to time (default native,reference)")
    p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--cpu-devices", type=int, default=2,
                   help="fake CPU devices for a single-process --platform cpu run")
    p.add_argument("--data", type=int, default=1, help="data axis size (ep = devices / data)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--n-groups", type=int, default=8)
    p.add_argument("--topk-groups", type=int, default=4)
    p.add_argument("--n-shared", type=int, default=1)
    p.add_argument("--route-scale", type=float, default=2.5)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--capacity", type=int, default=None,
                   help="EpConfig.capacity (rows per rank; default: dropless worst case)")
    p.add_argument("--expert-alignment", type=int, default=1)
    p.add_argument("--num-sms", type=int, default=None)
    p.add_argument("--buffer-bytes", type=int, default=None,
                   help="NVSHMEM symmetric buffer per process (jax_ep.initialize(buffer_bytes))")
    p.add_argument("--experts-impl", choices=("padded", "ragged_dot"), default="padded",
                   help="routed-expert matmuls: padded = batched einsum over a fixed number of "
                        "rows per expert (default; XLA's ragged_dot may expand to a dense "
                        "[L, C, H] problem at these sizes); ragged_dot = jax.lax.ragged_dot")
    p.add_argument("--expert-capacity-factor", type=float, default=2.0,
                   help="padded experts: rows per local expert = factor * R*T*K/E "
                        "(rounded up to 8); overflow is dropped and counted")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--inner", type=int, default=1, help="chained steps per timed call")
    p.add_argument("--no-comm", action="store_true", help="skip the dispatch+combine-only timing")
    p.add_argument("--json", default=None, help="also write the results here (process 0)")
    return p.parse_args(argv)


if __name__ == "__main__":
    _ARGS = parse_args()
    if (_ARGS.platform == "cpu" and "JAX_EP_NUM_PROCESSES" not in os.environ):
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (
                flags + f" --xla_force_host_platform_device_count={_ARGS.cpu_devices}").strip()

try:
    import jax_ep  # noqa: E402
except ImportError:
    sys.path.insert(0, ROOT)
    import jax_ep  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import moe_layer as ml  # noqa: E402

F32 = jnp.float32


def _median_time(fn, args, warmup, iters):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    ts = np.asarray(ts)
    return float(np.median(ts)), float(np.percentile(ts, 10)), float(np.percentile(ts, 90))


def _scalar_sum(tree):
    return sum(jnp.sum(a.astype(F32)) for a in jax.tree.leaves(tree))


def main(argv=None):
    args = _ARGS if (argv is None and "_ARGS" in globals()) else parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    from jax_ep.launch import init_distributed

    native_ok, native_err = False, None
    info = init_distributed(native=False,
                            platform=None if args.platform == "auto" else args.platform)
    if "native" in backends:
        try:
            kw = {} if args.buffer_bytes is None else {"buffer_bytes": args.buffer_bytes}
            jax_ep.initialize(**kw)
            native_ok = jax_ep.is_initialized()
            if not native_ok:
                from jax_ep import runtime
                native_err = runtime.unavailable_reason()
        except Exception as e:  # report, keep timing the other backends
            native_err = f"{type(e).__name__}: {e}"
    is_main = jax.process_index() == 0
    say = print if is_main else (lambda *a, **k: None)

    n_dev = jax.device_count()
    if n_dev % args.data:
        raise SystemExit(f"--data {args.data} does not divide {n_dev} devices")
    mesh = ml.make_mesh((args.data, n_dev // args.data), ("data", "ep"))
    dtype = jnp.dtype(args.dtype)
    cfg = ml.MoEConfig(d_model=args.hidden, d_ff=args.d_ff, num_experts=args.experts,
                       topk=args.topk, n_groups=args.n_groups, topk_groups=args.topk_groups,
                       score_func="sigmoid", route_scale=args.route_scale,
                       n_shared=args.n_shared, dtype=dtype)
    N = args.tokens * n_dev
    tok = NamedSharding(mesh, P(("data", "ep")))
    overrides = {"expert_alignment": args.expert_alignment}
    if args.capacity is not None:
        overrides["capacity"] = args.capacity
    if args.num_sms is not None:
        overrides["num_sms"] = args.num_sms

    R_ep = n_dev // args.data
    expert_cap = None
    if args.experts_impl == "padded":
        mean_rows = R_ep * args.tokens * args.topk / args.experts
        expert_cap = min(R_ep * args.tokens,
                         int(math.ceil(args.expert_capacity_factor * mean_rows / 8) * 8))

    # parameters and inputs created on the devices, already sharded
    key = jax.random.key(0)
    p_shapes = jax.eval_shape(lambda: ml.init_moe_params(key, cfg))
    p_shard = jax.tree.map(lambda s: NamedSharding(mesh, s), ml.param_specs(p_shapes),
                           is_leaf=lambda s: isinstance(s, P))
    params = jax.jit(lambda: ml.init_moe_params(key, cfg), out_shardings=p_shard)()
    bias = jax.device_put(ml.init_routing_bias(cfg), NamedSharding(mesh, P()))
    x, ct = jax.jit(lambda: (jax.random.normal(jax.random.key(1), (N, args.hidden), dtype),
                             jax.random.normal(jax.random.key(2), (N, args.hidden), dtype)),
                    out_shardings=(tok, tok))()

    say(f"# MoE layer fwd+bwd — {n_dev} x {jax.devices()[0].device_kind} "
        f"({jax.process_count()} process(es)), mesh data={args.data} x ep={n_dev // args.data}\n"
        f"T={args.tokens} tokens/GPU, H={args.hidden}, E={args.experts} "
        f"({args.experts // (n_dev // args.data)}/GPU), top-{args.topk} "
        f"(groups {args.n_groups}/{args.topk_groups}), d_ff={args.d_ff}, "
        f"shared={args.n_shared}, {args.dtype}; experts: {args.experts_impl}"
        f"{f' ({expert_cap} rows/expert)' if expert_cap else ''}; "
        f"medians of {args.iters} calls after "
        f"{args.warmup} warm-up, {args.inner} step(s) per call\n")
    if native_err:
        say(f"native backend unavailable: {native_err}\n")

    rows, outs = [], {}
    for be in backends:
        if be == "native" and not native_ok:
            rows.append({"backend": be, "error": native_err})
            continue

        # every array is an argument: multi-process jit cannot close over global arrays
        def loss(p, x, bias, ct, be=be):
            out, aux = ml.moe_block(p, bias, x, cfg, mesh, backend=be, ep_overrides=overrides,
                                    expert_impl=args.experts_impl, expert_capacity=expert_cap)
            return jnp.sum(out.astype(F32) * ct.astype(F32)), (out, aux["num_dropped"])

        grad_fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

        def steps(p, x, bias, ct, grad_fn=grad_fn):
            def body(i, carry):
                x, acc = carry
                (l, _), (gp, gx) = grad_fn(p, x, bias, ct)
                x = (x.astype(F32) - 1e-6 * gx.astype(F32)).astype(x.dtype)
                return x, acc + l + 1e-9 * _scalar_sum(gp)
            return jax.lax.fori_loop(0, args.inner, body, (x, jnp.zeros((), F32)))

        step = jax.jit(steps)
        once = jax.jit(lambda *a, grad_fn=grad_fn: grad_fn(*a)[0])
        (l, (out, dropped)) = once(params, x, bias, ct)
        outs[be] = (float(l), out)
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, x, bias, ct))
        compile_s = time.perf_counter() - t0
        med, p10, p90 = _median_time(step, (params, x, bias, ct), args.warmup, args.iters)
        row = {"backend": be, "layer_ms": 1e3 * med / args.inner,
               "layer_p10_ms": 1e3 * p10 / args.inner, "layer_p90_ms": 1e3 * p90 / args.inner,
               "compile_s": compile_s, "dropped": int(dropped), "loss": float(l)}

        if not args.no_comm:
            idx, w = jax.jit(lambda p, b, x: ml.route(p, b, x, cfg)[:2])(params, bias, x)
            ep_cfg = ml.make_ep_config(cfg, args.tokens, "ep", be, **overrides)
            spec = P(("data", "ep"))

            def per_rank(x, idx, w, ep_cfg=ep_cfg):
                d = jax_ep.dispatch(x, idx, w, ep_cfg)
                return jax_ep.combine(d.x, d, ep_cfg)

            comm = jax.shard_map(per_rank, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                                 check_vma=True)

            def comm_steps(x, idx, w, ct, comm=comm):
                def body(i, carry):
                    x, acc = carry
                    l, (gx, gw) = jax.value_and_grad(
                        lambda x, w: jnp.sum(comm(x, idx, w).astype(F32) * ct.astype(F32)),
                        argnums=(0, 1))(x, w)
                    x = (x.astype(F32) - 1e-6 * gx.astype(F32)).astype(x.dtype)
                    return x, acc + l + jnp.sum(gw)
                return jax.lax.fori_loop(0, args.inner, body, (x, jnp.zeros((), F32)))

            cstep = jax.jit(comm_steps)
            cmed, _, _ = _median_time(cstep, (x, idx, w, ct), args.warmup, args.iters)
            row["comm_ms"] = 1e3 * cmed / args.inner
            row["share"] = row["comm_ms"] / row["layer_ms"]
        row["tokens_per_s_per_gpu"] = args.tokens / (row["layer_ms"] * 1e-3)
        rows.append(row)

    # agreement of the backends (same layer, same inputs)
    if len(outs) >= 2:
        names = list(outs)
        a, b = outs[names[0]][1], outs[names[1]][1]
        diff = jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(F32) - b.astype(F32))))(a, b)
        scale = jax.jit(lambda a: jnp.max(jnp.abs(a.astype(F32))))(b)
        say(f"{names[0]} vs {names[1]}: max |out diff| = {float(diff):.3g} "
            f"(max |out| = {float(scale):.3g}); loss {outs[names[0]][0]:.6g} vs "
            f"{outs[names[1]][0]:.6g}\n")

    say("| backend | layer fwd+bwd (ms) | p10–p90 (ms) | dispatch+combine fwd+bwd (ms) "
        "| d+c share | tokens/s per GPU | dropped | compile (s) |")
    say("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            say(f"| {r['backend']} | — | — | — | — | — | — | unavailable |")
            continue
        comm = f"{r['comm_ms']:.3f}" if "comm_ms" in r else "—"
        share = f"{100 * r['share']:.1f}%" if "share" in r else "—"
        say(f"| {r['backend']}{' (XLA all_to_all)' if r['backend'] == 'reference' else ''} "
            f"| {r['layer_ms']:.3f} | {r['layer_p10_ms']:.3f}–{r['layer_p90_ms']:.3f} "
            f"| {comm} | {share} | {r['tokens_per_s_per_gpu']:,.0f} | {r['dropped']} "
            f"| {r['compile_s']:.1f} |")
    ok = {r["backend"]: r for r in rows if "error" not in r}
    if "native" in ok and "reference" in ok:
        say(f"\nnative speed-up over XLA all_to_all: layer "
            f"{ok['reference']['layer_ms'] / ok['native']['layer_ms']:.2f}x"
            + (f", dispatch+combine {ok['reference']['comm_ms'] / ok['native']['comm_ms']:.2f}x"
               if "comm_ms" in ok["native"] and "comm_ms" in ok["reference"] else ""))
    if args.json and is_main:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "devices": n_dev,
                       "device_kind": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    if native_ok:
        jax_ep.finalize()
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
