"""The grouped matmul's three operations without a VJP rule (forward, dx,
dw), each run by the kernel ``select`` plans for it."""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from .._ffi import to_vma, vma_of
from .config import GroupedMatmulConfig
from .select import plan


def gmm(x, w, group_sizes, *, transpose_rhs: bool = False,
        config: Optional[GroupedMatmulConfig] = None, out_dtype=None, row_groups=None):
    """Forward grouped matmul without a VJP rule.

    ``transpose_rhs=False``: ``x [M, K]``, ``w [G, K, N]`` -> ``[M, N]``.
    ``transpose_rhs=True``: ``x [M, N]``, ``w [G, K, N]`` -> ``[M, K]``
    (``x[rows of g] @ w[g]^T``; used for dx). Rows past ``sum(group_sizes)``
    are zero and their input is never used. ``row_groups``: the groups at fixed
    starts instead (``rows.FixedStarts``, sizes its own); rows outside every
    group are then not written by the kernels (zero on XLA).
    """
    cfg = config if config is not None else GroupedMatmulConfig()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    op = "dx" if transpose_rhs else "fwd"
    off = offsets(group_sizes, x.shape[0]) if row_groups is None else row_groups
    out = plan(cfg, op, x, w, w.shape[0], out_dtype).run(x, w, off, op, out_dtype,
                                                         cfg.interpret)
    return to_vma(out, vma_of(x) | vma_of(w) | vma_of(group_sizes))


def tgmm(x, dy, group_sizes, *, config: Optional[GroupedMatmulConfig] = None,
         out_dtype=None):
    """Ragged-contraction grouped matmul: ``out[g] = x[rows of g]^T @ dy[rows of g]``.

    ``x [M, K]``, ``dy [M, N]``, ``group_sizes [G]`` -> ``[G, K, N]`` (zero for
    empty groups); rows past ``sum(group_sizes)`` are never used.
    """
    cfg = config if config is not None else GroupedMatmulConfig()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    off = offsets(group_sizes, x.shape[0])
    out = plan(cfg, "dw", x, dy, group_sizes.shape[0], out_dtype).run(
        x, dy, off, "dw", out_dtype, cfg.interpret)
    return to_vma(out, vma_of(x) | vma_of(dy) | vma_of(group_sizes))


def offsets(group_sizes, m):
    """int32 ``[G+1]``: group g is rows ``[off[g], off[g+1])``, clipped to ``[0, m]``."""
    gs = jnp.clip(group_sizes.astype(jnp.int32), 0, m)   # clip first: no int32 overflow
    ends = jnp.minimum(jnp.cumsum(gs), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]).astype(jnp.int32)
