"""The public grouped matmul (``custom_vjp``): the bf16/f16/f32 path here, the
fp8 path in ``fp8``; the operations without a VJP rule live in ``ops``."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from .._ffi import to_vma, vma_of
from ..fp8 import WEIGHT_LAYOUTS
from . import fp8 as _fp8
from . import rows
from .config import GroupedMatmulConfig
from .ops import gmm, tgmm

__all__ = ["grouped_matmul", "gmm", "tgmm"]


def grouped_matmul(x, w, group_sizes, *, x_scales=None, w_scales=None, w_layout: str = "gkn",
                   w_transposed=None, preferred_element_type=None,
                   config: Optional[GroupedMatmulConfig] = None,
                   impl: Optional[str] = None):
    """Grouped matmul ``out[rows of g] = x[rows of g] @ w[g]``; tail rows zero.

    Args:
      x: ``[M, K]`` rows grouped contiguously by group, starting at row 0.
        Rows at or past ``sum(group_sizes)`` may hold anything (NaN/Inf
        included); they never influence any result or gradient.
        Or ``[G, C, K]``, the masked layout: group ``g`` is ``x[g,
        :group_sizes[g]]`` (sizes clipped to ``C``); its other rows may hold
        anything. bf16/f16/f32, or float8_e4m3fn with ``x_scales``.
      w: ``[G, K, N]`` one matrix per group (``w_layout="gkn"``), or ``[G, N,
        K]`` (``"gnk"``). bf16/f16/f32, or float8_e4m3fn with ``w_scales``.
      group_sizes: ``[G]`` integer, on the device (never read on the host),
        non-negative; ``sum(group_sizes) <= M`` (groups running past row ``M``
        are cut at ``M``).
      x_scales: fp8 path: ``[M, K/128]`` (masked layout: ``[G, C, K/128]``)
        float32, f32 or UE8M0 (power-of-two) values, ``x[r, c] * x_scales[r, c
        // 128]`` the value: what fp8 dispatch and ``quantize_activations`` give.
      w_scales: fp8 path: float32 ``[G, K/128, N/128]`` (``"gkn"``) or ``[G,
        N/128, K/128]`` (``"gnk"``), one per 128 x 128 block
        (``jax_ep.quantize_weights``). Give both scales or neither.
      w_layout: ``"gkn"`` (default) or ``"gnk"``, the contraction contiguous
        (DeepGEMM's and torch's expert weights). The fp8 kernel takes the
        weight K-major: with ``"gkn"`` the forward transposes ``w`` (XLA fuses
        that into the quantization when both are in one jit), with ``"gnk"``
        dx does. The bf16 path transposes a ``"gnk"`` weight.
      w_transposed: fp8 path: ``(q, scales)``, the same weights in the other
        layout (``jax_ep.quantize_weights(w_master, layout=<the other>)``,
        e.g. made once per optimizer step), used where the kernel wants that
        layout instead of transposing ``w`` in every call. No gradient flows
        into it (the gradient reaches the weights through ``w``).
      preferred_element_type: output dtype (default ``x.dtype``; fp8: bf16);
        accumulation is always f32.
      config: a :class:`GroupedMatmulConfig` (default ``GroupedMatmulConfig()``).
      impl: overrides ``config.impl`` (``"auto"|"pallas"|"xla"``). fp8: ``"xla"``
        is the dequantizing reference, which ``"auto"`` also runs where the fp8
        kernels cannot (``M``, masked ``G * C``, not a multiple of 8 or < 128).

    Returns:
      ``[M, N]`` in ``preferred_element_type`` (else ``x.dtype``; fp8: bf16);
      rows past ``sum(group_sizes)`` are zero. fp8: ``Σ_k (x·xs)(w·ws)`` in f32.
      Masked layout: ``[G, C, N]``; rows at or past ``group_sizes[g]`` are not
      written by the kernels (unspecified; zero on the XLA path) and their
      input rows get zero gradient.

    Gradients (``jax.custom_vjp``): ``dx``, ``dw``; for fp8 operands the
    cotangent of the dequantized value (f32 for ``w``, ``dy``'s dtype for
    ``x``), none for the scales (``jax_ep.gmm`` docstring, "fp8"); first order
    only there: a second-order one reaching fp8 values raises a ``TypeError``.
    """
    cfg = config if config is not None else GroupedMatmulConfig()
    if impl is not None:
        cfg = dataclasses.replace(cfg, impl=impl)
    x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes)
    if _fp8.is_fp8_call(x, w, x_scales, w_scales):
        return _fp8_call(x, w, group_sizes, x_scales, w_scales, w_layout, w_transposed,
                         preferred_element_type, cfg)
    if w_transposed is not None:
        raise ValueError("grouped_matmul: w_transposed is the fp8 path's (an fp8 w with "
                         "w_scales); drop it for bf16/f16/f32 weights")
    if w_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"grouped_matmul: w_layout must be 'gkn' or 'gnk', got {w_layout!r}")
    if w_layout == "gnk" and w.ndim == 3:
        w = jnp.swapaxes(w, 1, 2)
    if x.ndim not in (2, 3) or w.ndim != 3:
        raise ValueError(f"expected x [M, K] (or [G, C, K], the masked layout) and w [G, K, N], "
                         f"got {x.shape} and {w.shape}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"contracting dims differ: x {x.shape}, w {w.shape}")
    group_sizes = _check_groups(group_sizes, w.shape[0])
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    x, c = rows.flatten_masked(x, w.shape[0])
    # shard_map(check_vma=True): every operand varies over the union of axes;
    # pcast's transpose (a psum) then reduces dw for a replicated w.
    axes = vma_of(x) | vma_of(w) | vma_of(group_sizes)
    x, w, group_sizes = (to_vma(a, axes) for a in (x, w, group_sizes))
    return rows.unflatten(_gmm_vjp(x, w, group_sizes, cfg, out_dtype, c), c)


def _fp8_call(x, w, group_sizes, x_scales, w_scales, w_layout, w_transposed,
              preferred_element_type, cfg):
    """:func:`grouped_matmul`'s fp8 path: the operands checked, then ``fp8``."""
    x_scales = None if x_scales is None else jnp.asarray(x_scales)
    w_scales = None if w_scales is None else jnp.asarray(w_scales)
    out_dtype = jnp.dtype(preferred_element_type or jnp.bfloat16)
    x, x_scales, c = _fp8.flatten_masked(x, x_scales, w)
    _fp8.check_operands(x, x_scales, w, w_scales, w_layout, out_dtype)
    w_t = _fp8.check_transposed(w, w_layout, w_transposed)
    y = _fp8.grouped_matmul_fp8(x, x_scales, w, w_scales, _check_groups(group_sizes, w.shape[0]),
                                w_layout=w_layout, out_dtype=out_dtype, cfg=cfg, w_t=w_t, c=c)
    return rows.unflatten(y, c)


def _check_groups(group_sizes, groups: int):
    """``group_sizes`` checked against the weight's ``groups``, as int32."""
    if group_sizes.shape != (groups,):
        raise ValueError(
            f"grouped_matmul: group_sizes has shape {group_sizes.shape} but w has "
            f"{groups} groups (w [G, K, N], group_sizes [G]). Under jax_ep.dispatch the groups are "
            "the local experts of EpConfig.axis_name: that axis must be the one w's experts "
            "are sharded over (E / its size experts per device)")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integer, got {group_sizes.dtype}")
    return group_sizes.astype(jnp.int32)


# c: None (contiguous groups), or the masked layout's C rows per group (x
# flattened to [G·C, K]).
def _forward(x, w, group_sizes, cfg, out_dtype, c):
    return gmm(x, w, group_sizes, config=cfg, out_dtype=out_dtype,
               row_groups=rows.of_layout(group_sizes, c))


_gmm_vjp = functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))(_forward)


def _gmm_vjp_fwd(x, w, group_sizes, cfg, out_dtype, c):
    return _forward(x, w, group_sizes, cfg, out_dtype, c), (x, w, group_sizes)


def _gmm_vjp_bwd(cfg, out_dtype, c, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)   # cotangent in the compute dtype (f32 accumulation inside)
    b = rows.backward_rows(group_sizes, c)   # masked: rows outside the groups get none
    dy = b.clean(dy)
    dx = b.clean(gmm(dy, w, group_sizes, transpose_rhs=True, config=cfg, out_dtype=x.dtype,
                     row_groups=b.row_groups))
    dw = tgmm(b.clean(x), dy, b.dw_groups, config=cfg, out_dtype=w.dtype)
    axes = vma_of(x) | vma_of(w)
    return to_vma(dx, axes), to_vma(dw, axes), None


_gmm_vjp.defvjp(_gmm_vjp_fwd, _gmm_vjp_bwd)
