"""The fp8 dw kernel's operands: the rows of ``x`` and ``dy`` regrouped so
that each group starts on a 128-row block (the gaps zero), cast per column
per 128 rows, and transposed (dw contracts the rows; fp8 WGMMA reads K-major
operands only). ``pallas_fp8_dw`` multiplies them. On a CUDA device with the
native extension one kernel per operand does it (``cuda_quant``), elsewhere
XLA, with the same bits."""
from __future__ import annotations

import jax.numpy as jnp

from ..fp8 import FP8_BLOCK, column_blocks_cast
from . import cuda_quant
from .ops import offsets as row_offsets
from .xla import dequantize_rows


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


def regroup_index(offsets, seg, p: int):
    """(``src [P]``, ``valid [P]``): regrouped row ``seg[g] + i`` is source row
    ``offsets[g] + i`` for ``i < size of g``; the others are not valid (the
    rows of :func:`block_table`'s blocks)."""
    b_src, count = block_table(offsets, seg, p)
    i = jnp.arange(FP8_BLOCK, dtype=jnp.int32)
    src = (b_src[:, None] + i).reshape(p)
    valid = (i < count[:, None]).reshape(p)
    return jnp.clip(src, 0, offsets[-1] - 1), valid


def regroup(x, index):
    """``x``'s rows at ``index`` (:func:`regroup_index`), zero where not valid
    (a select: rows past the groups' end may hold NaN and are never read)."""
    src, valid = index
    return jnp.where(valid[:, None], x[jnp.maximum(src, 0)], jnp.zeros((), x.dtype))


def cast_columns_t(rows, scale_format: str = "f32"):
    """Regrouped ``rows [P, C]`` -> (``q [C, P]`` e4m3, ``scales [P/128, C]``
    f32): cast per column per 128 rows, ``q`` transposed."""
    q, s = column_blocks_cast(rows, scale_format)
    return q.T, s


def block_table(offsets, seg, p: int):
    """(``src [P/128]``, ``count [P/128]``) int32: regrouped block ``b`` holds
    source rows ``src[b] .. src[b] + count[b] - 1`` (``count`` 0: none; a
    block never straddles two groups, whose segments are whole blocks)."""
    g_count = offsets.shape[0] - 1
    start = jnp.arange(p // FP8_BLOCK, dtype=jnp.int32) * FP8_BLOCK
    g = jnp.searchsorted(seg[1:], start, side="right", method="compare_all").astype(jnp.int32)
    gc = jnp.minimum(g, g_count - 1)
    i0 = start - seg[gc]
    size = offsets[gc + 1] - offsets[gc]
    count = jnp.where(g < g_count, jnp.clip(size - i0, 0, FP8_BLOCK), 0)
    return (offsets[gc] + i0).astype(jnp.int32), count.astype(jnp.int32)


def dw_operands(x, xs, dy, group_sizes, impl: str = "auto"):
    """dw's operands for ``pallas_fp8_dw.tgmm_fp8_nt``: ``x [M, K]`` e4m3 with
    its row scales ``xs [M, K/128]`` (regrouped as fp8 and dequantized inside
    the cast: one byte per element moves), ``dy [M, N]`` -> ``(a [K, P], as
    [P/128, K], c [N, P], cs [P/128, N], segments [G+1])``. ``impl``:
    ``"native"`` the column kernel (``cuda_quant``; the program must then be
    lowered for CUDA), ``"xla"`` XLA's passes,
    ``"auto"`` the kernel where the program is lowered for CUDA and the
    extension can cast these operands, else XLA."""
    m = x.shape[0]
    off = row_offsets(group_sizes, m)
    seg = segments(off)
    p = padded_length(m, group_sizes.shape[0])

    def xla(x, xs, dy):
        index = regroup_index(off, seg, p)
        a, a_s = cast_columns_t(dequantize_rows(regroup(x, index), regroup(xs, index)))
        return (a, a_s, *cast_columns_t(regroup(dy, index)))

    def native(x, xs, dy):
        blocks = block_table(off, seg, p)
        return (*cuda_quant.cast_columns_t(x, xs, blocks, p),
                *cuda_quant.cast_columns_t(dy, None, blocks, p))

    ops = cuda_quant.by_impl("dw_operands", impl, lambda: cuda_quant.columns_unavailable(x, dy),
                             native, xla, x, xs, dy)
    return (*ops, seg)
