"""The public grouped matmul (``custom_vjp``) and its three operations."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from .._ffi import to_vma, vma_of
from .config import GroupedMatmulConfig
from .select import plan


def grouped_matmul(x, w, group_sizes, *, preferred_element_type=None,
                   config: Optional[GroupedMatmulConfig] = None,
                   impl: Optional[str] = None):
    """Grouped matmul ``out[rows of g] = x[rows of g] @ w[g]``; tail rows zero.

    Args:
      x: ``[M, K]`` rows grouped contiguously by group, starting at row 0.
        Rows at or past ``sum(group_sizes)`` may hold anything (NaN/Inf
        included); they never influence any result or gradient.
      w: ``[G, K, N]`` one matrix per group.
      group_sizes: ``[G]`` integer, on the device (never read on the host),
        non-negative; ``sum(group_sizes) <= M`` (groups running past row ``M``
        are cut at ``M``).
      preferred_element_type: output dtype (default ``x.dtype``); accumulation
        is always f32.
      config: a :class:`GroupedMatmulConfig` (default ``GroupedMatmulConfig()``).
      impl: shorthand overriding ``config.impl`` (``"auto"|"pallas"|"xla"``).

    Returns:
      ``[M, N]`` in ``preferred_element_type or x.dtype``; rows past
      ``sum(group_sizes)`` are zero.
    """
    cfg = config if config is not None else GroupedMatmulConfig()
    if impl is not None:
        cfg = dataclasses.replace(cfg, impl=impl)
    x = jnp.asarray(x)
    w = jnp.asarray(w)
    group_sizes = jnp.asarray(group_sizes)
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"expected x [M, K] and w [G, K, N], got {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"contracting dims differ: x {x.shape}, w {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"grouped_matmul: group_sizes has shape {group_sizes.shape} but w has "
            f"{w.shape[0]} groups (w [G, K, N], group_sizes [G]). Under jax_ep.dispatch the groups are "
            "the local experts of EpConfig.axis_name: that axis must be the one w's experts "
            "are sharded over (E / its size experts per device)")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integer, got {group_sizes.dtype}")
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    # shard_map(check_vma=True): every operand varies over the union of axes;
    # pcast's transpose (a psum) then reduces dw for a replicated w.
    axes = vma_of(x) | vma_of(w) | vma_of(group_sizes)
    x, w, group_sizes = (to_vma(a, axes) for a in (x, w, group_sizes))
    return _gmm_vjp(x, w, group_sizes, cfg, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_vjp(x, w, group_sizes, cfg, out_dtype):
    return gmm(x, w, group_sizes, config=cfg, out_dtype=out_dtype)


def _gmm_vjp_fwd(x, w, group_sizes, cfg, out_dtype):
    return gmm(x, w, group_sizes, config=cfg, out_dtype=out_dtype), (x, w, group_sizes)


def _gmm_vjp_bwd(cfg, out_dtype, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)   # cotangent in the compute dtype (f32 accumulation inside)
    dx = gmm(dy, w, group_sizes, transpose_rhs=True, config=cfg, out_dtype=x.dtype)
    dw = tgmm(x, dy, group_sizes, config=cfg, out_dtype=w.dtype)
    axes = vma_of(x) | vma_of(w)
    return to_vma(dx, axes), to_vma(dw, axes), None


_gmm_vjp.defvjp(_gmm_vjp_fwd, _gmm_vjp_bwd)


def gmm(x, w, group_sizes, *, transpose_rhs: bool = False,
        config: Optional[GroupedMatmulConfig] = None, out_dtype=None):
    """Forward grouped matmul without a VJP rule.

    ``transpose_rhs=False``: ``x [M, K]``, ``w [G, K, N]`` -> ``[M, N]``.
    ``transpose_rhs=True``: ``x [M, N]``, ``w [G, K, N]`` -> ``[M, K]``
    (``x[rows of g] @ w[g]^T``; used for dx). Rows past ``sum(group_sizes)``
    are zero and their input is never used.
    """
    cfg = config if config is not None else GroupedMatmulConfig()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    op = "dx" if transpose_rhs else "fwd"
    offsets = _offsets(group_sizes, x.shape[0])
    out = plan(cfg, op, x, w, w.shape[0], out_dtype).run(x, w, offsets, op, out_dtype,
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
    offsets = _offsets(group_sizes, x.shape[0])
    out = plan(cfg, "dw", x, dy, group_sizes.shape[0], out_dtype).run(
        x, dy, offsets, "dw", out_dtype, cfg.interpret)
    return to_vma(out, vma_of(x) | vma_of(dy) | vma_of(group_sizes))


def _offsets(group_sizes, m):
    """int32 ``[G+1]``: group g is rows ``[off[g], off[g+1])``, clipped to ``[0, m]``."""
    gs = jnp.clip(group_sizes.astype(jnp.int32), 0, m)   # clip first: no int32 overflow
    ends = jnp.minimum(jnp.cumsum(gs), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]).astype(jnp.int32)
