"""Per-kernel device time of one step, measured with CUPTI (one process, one GPU).

Where a step's time goes, kernel by kernel, without host noise: each step is
jitted and run ``--iters`` times under CUPTI (``jax.experimental.mosaic.gpu.
profiler.measure``); kernels of the same name are summed per step and the
medians over the iterations printed, beside the sum of all kernels (the gaps
between dependent kernels are not in it: compare with the chained-step benches).

    python -m jax_ep.launch -n 1 bench/kernel_breakdown.py ll          # V3-decode LL round trip

``ll``: low_latency_dispatch (fp8) + low_latency_combine (bf16), T 128, E 256,
top-8, H 7168 (every expert local at R = 1), under ``ll_transport`` "auto" and
"put". (A ``layer`` mode, the V3 layer's fwd+bwd under CUPTI, ran past its
150 s limit without a table and was removed; the layer's
pieces are timed by ``bench/moe_layer_step.py --expert-breakdown``.)
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def short(name):
    """A readable kernel name: the jax_ep kernel's own name inside a mangled one
    (``..._ZN6jax_ep..ll_dispatch_send_kernelILi2ELb0EE..``), else the first 90 chars."""
    import re
    m = re.search(r"\d+((?:ll|gmm|intranode|internode|layout|ring)[a-z0-9_]*_kernel)(I[^E]*E)?",
                  name)
    return m.group(1) + (m.group(2) or "") if m else name[:90]


def table(title, iters_timings, top):
    import numpy as np
    per = collections.defaultdict(list)     # name -> per-iteration sums (µs)
    counts = {}
    for it in iters_timings:
        sums = collections.Counter()
        n = collections.Counter()
        for name, ms in it:
            sums[name] += 1e3 * ms
            n[name] += 1
        for name in sums:
            per[name].append(sums[name])
            counts[name] = n[name]
    rows = sorted(((float(np.median(v)), k) for k, v in per.items()), reverse=True)
    total = float(np.median([sum(1e3 * ms for _, ms in it) for it in iters_timings]))
    print(f"\n### {title}: {len(iters_timings[0])} kernels per step, sum {total:.1f} µs "
          f"(median of {len(iters_timings)})\n")
    print("| kernel | launches | µs per step | share |")
    print("|---|---|---|---|")
    for us, k in rows[:top]:
        print(f"| `{short(k)}` | {counts[k]} | {us:.1f} | {us / max(total, 1e-9):.0%} |")
    if len(rows) > top:
        rest = sum(u for u, _ in rows[top:])
        print(f"| ({len(rows) - top} more) | | {rest:.1f} | {rest / max(total, 1e-9):.0%} |")
    sys.stdout.flush()


def run_ll(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.mosaic.gpu import profiler
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_ep
    from jax_ep.config import EpConfig
    from jax_ep.launch import init_distributed

    T, H, E, K = args.tokens or 128, 7168, 256, 8
    cfgs = {t: EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                        backend="native", ll_transport=t) for t in ("auto", "put")}
    info = init_distributed(native=True, low_latency=cfgs["auto"])
    if not info.native:
        print("native runtime not up:", jax_ep.runtime.unavailable_reason())
        return 1
    R = jax.process_count()
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    idx = np.argsort(rng.random((R * T, E)), axis=1)[:, :K].astype(np.int32)
    x = rng.standard_normal((R * T, H)).astype(jnp.bfloat16)
    w = rng.random((R * T, K)).astype(np.float32)
    y = rng.standard_normal((E, R * T, H), dtype=np.float32).astype(jnp.bfloat16)
    sh = NamedSharding(mesh, P("ep"))
    ins = [jax.make_array_from_callback(a.shape, sh, lambda i, a=a: a[i]) for a in (x, idx, w, y)]

    for tr, cfg in cfgs.items():
        def rt(x, i, w, y, cfg=cfg):
            d = jax_ep.low_latency_dispatch(x, i, cfg)
            yy = jax.lax.optimization_barrier((y, d.count))[0]
            return jax_ep.low_latency_combine(yy, i, w, d.handle, cfg), d.x

        def disp(x, i, w, y, cfg=cfg):
            return jax_ep.low_latency_dispatch(x, i, cfg).x

        for name, f in (("round trip", rt), ("dispatch", disp)):
            g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 4,
                                      out_specs=P("ep")))
            _, t = profiler.measure(g, aggregate=False, iterations=args.iters)(*ins)
            table(f"LL {name}, ll_transport {tr}, R {R}, T {T}", t, args.top)
    jax_ep.finalize()
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("ll",))
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    return run_ll(args)


if __name__ == "__main__":
    sys.exit(main())
