"""The XLA fallbacks of the grouped matmul: ``jax.lax.ragged_dot`` (tail rows
masked), and the fp8 reference (dequantize to f32, then the same at HIGHEST
precision), forward/dx and dw."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..fp8 import FP8_BLOCK
from .rows import spans_and_mask


def _acc_type(dtype):
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else None


def gmm_xla(x, w, offsets, transpose_rhs, out_dtype, precision=None):
    """``offsets``: row offsets or ``rows.FixedStarts``; rows outside every
    group are zero and their input is never used."""
    sizes, keep = spans_and_mask(offsets, x.shape[0])
    xm = jnp.where(keep, x, jnp.zeros((), x.dtype))
    kw = {} if precision is None else {"precision": precision}
    if transpose_rhs:
        dn = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [2]), ([], [])),
            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        y = lax.ragged_dot_general(xm, w, sizes, dn, preferred_element_type=_acc_type(out_dtype),
                                   **kw)
    else:
        y = lax.ragged_dot(xm, w, sizes, preferred_element_type=_acc_type(out_dtype), **kw)
    return jnp.where(keep, y, jnp.zeros((), y.dtype)).astype(out_dtype)


def tgmm_xla(x, dy, offsets, num_groups, out_dtype, precision=None):
    sizes, keep = spans_and_mask(offsets, x.shape[0])
    xm = jnp.where(keep, x, jnp.zeros((), x.dtype))
    dym = jnp.where(keep, dy, jnp.zeros((), dy.dtype))
    dn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    kw = {} if precision is None else {"precision": precision}
    out = lax.ragged_dot_general(xm, dym, sizes, dn,
                                 preferred_element_type=_acc_type(out_dtype), **kw)
    assert out.shape[0] == num_groups
    return out.astype(out_dtype)


def fp8_values(a):
    """``a`` (fp8) as f32, its fp8 rounding kept: XLA:GPU, which allows excess
    precision by default, folds an f32 -> e4m3 -> f32 convert pair into
    nothing, so a cast feeding this reference would go unrounded (the masked
    layout's dx came out 2.6% off the kernels' on an H100); the barrier keeps
    the pair apart."""
    return lax.optimization_barrier(a).astype(jnp.float32)


def dequantize_rows(x, scales):
    """``x [M, K]`` fp8, ``scales [M, K/128]`` -> f32 ``x * scales`` (per row, per 128 columns)."""
    m, k = x.shape
    xf = fp8_values(x).reshape(m, k // FP8_BLOCK, FP8_BLOCK)
    return (xf * scales.astype(jnp.float32)[..., None]).reshape(m, k)


def dequantize_blocks(w, scales):
    """``w [G, A, B]`` fp8, ``scales [G, A/128, B/128]`` -> f32 ``w * scales``
    (one scale per 128 x 128 block)."""
    g, a, b = w.shape
    wf = fp8_values(w).reshape(g, a // FP8_BLOCK, FP8_BLOCK, b // FP8_BLOCK, FP8_BLOCK)
    return (wf * scales.astype(jnp.float32)[:, :, None, :, None]).reshape(g, a, b)


def gmm_fp8_nt_xla(x, xs, v, vs, offsets, out_dtype):
    """The fp8 kernel's contract (``pallas_fp8.gmm_fp8_nt``) in XLA:
    ``out[rows of g] = (x * xs)[rows of g] @ ((v * vs)[g])^T``, dequantized to
    f32 and multiplied at HIGHEST precision; ``x [M, Kc]``, ``v [G, Nout, Kc]``
    -> ``[M, Nout]``, rows past ``offsets[-1]`` zero (their input never used)."""
    return gmm_xla(dequantize_rows(x, xs), dequantize_blocks(v, vs), offsets, True, out_dtype,
                   precision=lax.Precision.HIGHEST)


def dequantize_columns(a, scales):
    """``a [R, P]`` fp8, ``scales [P/128, R]`` -> f32 ``a * scales`` (per row, per
    128 columns; the scales stored block-major, as ``pallas_fp8_dw`` stages them)."""
    return dequantize_rows(a, scales.T)


def tgmm_fp8_nt_xla(a, a_s, c, c_s, segments, out_dtype):
    """The fp8 dw kernel's contract (``pallas_fp8_dw.tgmm_fp8_nt``) in XLA:
    ``out[g] = (a * as)[:, segment g] @ ((c * cs)[:, segment g])^T``,
    dequantized to f32 and multiplied at HIGHEST precision; ``a [Ka, P]``,
    ``c [Nc, P]`` -> ``[G, Ka, Nc]``."""
    return tgmm_xla(dequantize_columns(a, a_s).T, dequantize_columns(c, c_s).T, segments,
                    segments.shape[0] - 1, out_dtype, precision=lax.Precision.HIGHEST)
