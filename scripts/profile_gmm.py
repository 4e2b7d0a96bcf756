"""One call of each grouped-matmul op at V3 per-rank shapes, for a profiler.

    ncu --clock-control none --section SpeedOfLight ... python scripts/profile_gmm.py [ops]

ops (comma list, default "dw_up,fwd_up,dense_dw_up"): dw_up / dw_down (x[g]^T @ dy[g]),
fwd_up / fwd_down, dx_up, dense_dw_up (x^T @ dy over all rows, cuBLAS). Each op
runs once to compile and once more, then the device is synchronised: the
profiler sees every kernel twice (filter with --launch-skip / -k). Uniform
group sizes (128 groups of 256 rows), random bf16 data made on the host
(no XLA random kernels for the profiler to replay: session 7's first try spent
its whole time limit on them).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_ep.gmm import gmm, tgmm  # noqa: E402

G, M = 128, 32768
PROJ = {"up": (7168, 4096), "down": (2048, 7168)}


def main(ops):
    gs = jnp.full((G,), M // G, jnp.int32)
    rng = np.random.default_rng(0)

    def normal(shape):
        return jax.device_put(rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16))

    for op in ops:
        kind, proj = op.rsplit("_", 1)
        k, n = PROJ[proj]
        if kind in ("dw", "dense_dw"):
            a, b = normal((M, k)), normal((M, n))
            fn = (jax.jit(lambda a, b: tgmm(a, b, gs, out_dtype=jnp.bfloat16)) if kind == "dw"
                  else jax.jit(lambda a, b: jnp.dot(a.T, b, preferred_element_type=jnp.float32
                                                    ).astype(jnp.bfloat16)))
        elif kind in ("fwd", "dx"):
            a, b = normal((M, k if kind == "fwd" else n)), normal((G, k, n))
            fn = jax.jit(lambda a, b, t=(kind == "dx"): gmm(a, b, gs, transpose_rhs=t))
        else:
            raise SystemExit(f"unknown op {op}")
        for _ in range(2):
            jax.block_until_ready(fn(a, b))
        print(f"{op}: done", flush=True)


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "dw_up,fwd_up,dense_dw_up").split(","))
