"""One call of each grouped-matmul op at V3 per-rank shapes, for a profiler.

    ncu --clock-control none --section SpeedOfLight ... python scripts/profile_gmm.py [ops]

ops (comma list, default "dw_up,fwd_up,dense_dw_up"): dw_up / dw_down (x[g]^T @ dy[g]),
fwd_up / fwd_down, dx_up, dense_dw_up (x^T @ dy over all rows, cuBLAS), bmm_up /
bmm_down (XLA's batched matmul of the padded layer, x [G, M/G, K] @ w [G, K, N]),
fp8_up / fp8_down (the fp8 kernel ``gmm_fp8_nt`` of the module $FP8_MODULE,
default ``jax_ep.gmm.pallas_fp8``: a variant can be profiled beside it);
fp8dw_up / fp8dw_down (the fp8 dw kernel ``tgmm_fp8_nt`` of $FP8_DW_MODULE,
default ``jax_ep.gmm.pallas_fp8_dw``, on operands as ``fp8_columns`` lays
them out: rows per group a multiple of 128);
an op may end in ``:rows`` (e.g. ``fwd_up:8192``, 64 rows per group: the V3
layer at T 128), default 32768. Each op
runs once to compile and once more, then the device is synchronised: the
profiler sees every kernel twice (filter with --launch-skip / -k). Uniform
group sizes (128 groups of 256 rows), random bf16 data made on the host
(no XLA random kernels for the profiler to replay: a first try spent
its whole time limit on them).
"""
from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_ep.gmm import gmm, tgmm  # noqa: E402
from jax_ep.gmm.ops import offsets  # noqa: E402

G, M = 128, 32768
PROJ = {"up": (7168, 4096), "down": (2048, 7168)}


def e4m3(rng, shape):
    """Random e4m3 values, made on the host."""
    return jax.device_put(rng.standard_normal(shape, np.float32).astype(ml_dtypes.float8_e4m3fn))


def scales(rng, shape):
    """Random positive f32 scales, made on the host."""
    return jax.device_put(rng.uniform(0.5, 2.0, shape).astype(np.float32))


def fp8_operands(rng, m, k, n, gs):
    """((x e4m3 [m, k], its scales [m, k/128]), (v e4m3 [G, n, k], scales, group
    offsets))."""
    return ((e4m3(rng, (m, k)), scales(rng, (m, k // 128))),
            (e4m3(rng, (G, n, k)), scales(rng, (G, n // 128, k // 128)), offsets(gs, m)))


def fp8_dw_operands(rng, m, k, n):
    """((a e4m3 [k, m], its scales [m/128, k]), (c e4m3 [n, m], scales, segments)):
    dw of uniform groups whose rows need no regrouping (m / G rows each)."""
    seg = jnp.arange(G + 1, dtype=jnp.int32) * (m // G)
    return ((e4m3(rng, (k, m)), scales(rng, (m // 128, k))),
            (e4m3(rng, (n, m)), scales(rng, (m // 128, n)), seg))


def kernel_of(env, default, name):
    """``fn(a, b) = name(*a, *b)`` of the module ``$env`` (default ``default``)."""
    fn = getattr(importlib.import_module(os.environ.get(env, default)), name)
    return lambda a, b: fn(*a, *b)


def main(ops):
    rng = np.random.default_rng(0)

    def normal(shape):
        return jax.device_put(rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16))

    for op in ops:
        op, _, rows = op.partition(":")
        m = int(rows) if rows else M
        gs = jnp.full((G,), m // G, jnp.int32)
        kind, proj = op.rsplit("_", 1)
        k, n = PROJ[proj]
        if kind in ("dw", "dense_dw"):
            a, b = normal((m, k)), normal((m, n))
            fn = (jax.jit(lambda a, b, gs=gs: tgmm(a, b, gs, out_dtype=jnp.bfloat16))
                  if kind == "dw"
                  else jax.jit(lambda a, b: jnp.dot(a.T, b, preferred_element_type=jnp.float32
                                                    ).astype(jnp.bfloat16)))
        elif kind in ("fwd", "dx"):
            a, b = normal((m, k if kind == "fwd" else n)), normal((G, k, n))
            fn = jax.jit(lambda a, b, t=(kind == "dx"), gs=gs: gmm(a, b, gs, transpose_rhs=t))
        elif kind == "fp8":
            a, b = fp8_operands(rng, m, k, n, gs)
            fn = jax.jit(kernel_of("FP8_MODULE", "jax_ep.gmm.pallas_fp8", "gmm_fp8_nt"))
        elif kind == "fp8dw":
            if (m // G) % 128:
                raise SystemExit(f"{op}: fp8dw needs rows per group a multiple of 128")
            a, b = fp8_dw_operands(rng, m, k, n)
            fn = jax.jit(kernel_of("FP8_DW_MODULE", "jax_ep.gmm.pallas_fp8_dw",
                                       "tgmm_fp8_nt"))
        elif kind == "bmm":
            a, b = normal((G, m // G, k)), normal((G, k, n))
            fn = jax.jit(lambda a, b: jnp.einsum("gmk,gkn->gmn", a, b))
        else:
            raise SystemExit(f"unknown op {op}")
        for _ in range(2):
            jax.block_until_ready(fn(a, b))
        print(f"{op}: done", flush=True)


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "dw_up,fwd_up,dense_dw_up").split(","))
