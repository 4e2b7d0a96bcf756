"""The XLA fallback of the grouped matmul: ``jax.lax.ragged_dot`` (tail rows masked)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _row_mask(offsets, m):
    return (jnp.arange(m, dtype=jnp.int32) < offsets[-1])[:, None]


def _acc_type(dtype):
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else None


def gmm_xla(x, w, offsets, transpose_rhs, out_dtype):
    m = x.shape[0]
    keep = _row_mask(offsets, m)
    xm = jnp.where(keep, x, jnp.zeros((), x.dtype))
    sizes = jnp.diff(offsets)
    if transpose_rhs:
        dn = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [2]), ([], [])),
            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        y = lax.ragged_dot_general(xm, w, sizes, dn,
                                   preferred_element_type=_acc_type(out_dtype))
    else:
        y = lax.ragged_dot(xm, w, sizes, preferred_element_type=_acc_type(out_dtype))
    return jnp.where(keep, y, jnp.zeros((), y.dtype)).astype(out_dtype)


def tgmm_xla(x, dy, offsets, num_groups, out_dtype):
    m = x.shape[0]
    keep = _row_mask(offsets, m)
    xm = jnp.where(keep, x, jnp.zeros((), x.dtype))
    dym = jnp.where(keep, dy, jnp.zeros((), dy.dtype))
    dn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    out = lax.ragged_dot_general(xm, dym, jnp.diff(offsets), dn,
                                 preferred_element_type=_acc_type(out_dtype))
    assert out.shape[0] == num_groups
    return out.astype(out_dtype)
