"""The fp8 dw kernel's operands: the rows of ``x`` (or ``dy``) regrouped so
that each group starts on a 128-row block (the gaps zero), cast per column
per 128 rows, and transposed (dw contracts the rows; fp8 WGMMA reads K-major
operands only). ``pallas_fp8_dw`` multiplies them."""
from __future__ import annotations

import jax.numpy as jnp

from ..fp8 import FP8_BLOCK, column_blocks_cast


def padded_length(m: int, groups: int) -> int:
    """Static length ``P`` of the regrouped rows: each group rounded up to 128
    rows adds at most 127, so ``P >= m + 127 G`` (rounded up to 128) holds any
    ``group_sizes``."""
    return -(-(m + (FP8_BLOCK - 1) * groups) // FP8_BLOCK) * FP8_BLOCK


def segments(offsets):
    """int32 ``[G+1]``: group ``g``'s first regrouped row, the groups' sizes
    (``offsets``: ``ops.offsets``) rounded up to 128 and summed."""
    sizes = jnp.diff(offsets.astype(jnp.int32))
    padded = (sizes + (FP8_BLOCK - 1)) // FP8_BLOCK * FP8_BLOCK
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded)]).astype(jnp.int32)


def regroup_rows(x, offsets, seg, p: int):
    """``[P, C]``: regrouped row ``seg[g] + i`` is ``x[offsets[g] + i]`` for ``i
    < size of g``; every other row is zero (a select: rows past the groups'
    end may hold NaN and are never read)."""
    g_count = offsets.shape[0] - 1
    pos = jnp.arange(p, dtype=jnp.int32)
    # compare_all: one fused elementwise kernel ([P, G] compares), not a loop
    g = jnp.searchsorted(seg[1:], pos, side="right", method="compare_all").astype(jnp.int32)
    gc = jnp.minimum(g, g_count - 1)
    i = pos - seg[gc]
    valid = (g < g_count) & (i < offsets[gc + 1] - offsets[gc])
    src = jnp.clip(offsets[gc] + i, 0, x.shape[0] - 1)
    return jnp.where(valid[:, None], x[src], jnp.zeros((), x.dtype))


def cast_columns_t(x, offsets, seg, p: int, scale_format: str = "f32"):
    """``x [M, C]`` -> (``q [C, P]`` e4m3, ``scales [P/128, C]`` f32): the rows
    regrouped (:func:`regroup_rows`), cast per column per 128 rows, ``q``
    transposed."""
    q, s = column_blocks_cast(regroup_rows(x, offsets, seg, p), scale_format)
    return q.T, s
