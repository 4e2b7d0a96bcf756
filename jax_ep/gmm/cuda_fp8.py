"""The fp8 grouped matmul's CUDA kernels (``cc/gmm/``): the forward / dx
(``fp8_nt.cu``, XLA FFI target ``jax_ep_gmm_fp8_nt``), the contract of
:func:`pallas_fp8.gmm_fp8_nt`,

``out[rows of g] = (x · xs)[rows of g] @ ((v · vs)[g])^T``

and dw (``fp8_dw.cu``, ``jax_ep_gmm_fp8_dw``), the contract of
:func:`pallas_fp8_dw.tgmm_fp8_nt`. Both are built the way DeepGEMM builds its
SM90 fp8 GEMMs rather than through Pallas: one producer thread issues the TMA
loads, two consumer warpgroups zero the tile's f32 sum once per tile and
promote each 128-wide k-step's WGMMA product, the forward with one FMA per
register and dw with a multiply and an FMA, each rounding as its Pallas
kernel does. The Pallas kernel's producer runs its index maps on four warps
and its consumers select the sum away on every tile's first step: that
kernel is bound by instruction issue. The forward's row tiles are 256 rows (``NT_TILE_ROWS``:
each group's weight tile read once per 256 rows, where 128-row tiles left the
kernel waiting on L2); each row's products and promotions are the Pallas
kernels', so the same bits (the GPU tests compare them). Needs the native
extension (``jax_ep._C``) and a Hopper GPU.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import extension
from .._ffi import result_type
from ..mesh_axes import to_vma, vma_of
from .pallas_common import max_row_tiles, row_tile_table
from .pallas_fp8 import check_fp8_nt
from .pallas_fp8_dw import check_fp8_dw

TARGET = "jax_ep_gmm_fp8_nt"
DW_TARGET = "jax_ep_gmm_fp8_dw"
NT_TILE_ROWS = 256   # the forward's row tiles (cc/gmm/fp8_nt.cu kRows, which checks it)


def _no_extension() -> Optional[str]:
    """Why the CUDA kernels cannot run here at all (None: the extension is loaded)."""
    if extension.load() is None:
        return f"the CUDA kernel needs the native extension: {extension.error()}"
    return None


def check_fp8_nt_cuda(x, xs, v, vs) -> Optional[str]:
    """None if the CUDA kernel runs these operands, else why not (also the
    kernel's int32 indexing: the weight's rows ``G * Nout``, and the output
    tiles, ``pallas_common.max_row_tiles`` row tiles by ``Nout / 128``, below
    2^30)."""
    err = _no_extension() or check_fp8_nt(x, xs, v, vs)   # v [G, Nout, Kc] past it
    if err is not None:
        return err
    g, n = v.shape[0], v.shape[1]
    tiles = max_row_tiles(x.shape[0], g, NT_TILE_ROWS) * (n // 128)
    if g * n >= 2 ** 31 or tiles >= 2 ** 30:   # 2^30: a CTA's next tile index stays in int32
        return (f"G * Nout ({g} * {n}) must fit in int32 and the output tiles ({tiles}) "
                "stay below 2^30")
    return None


def gmm_fp8_nt_cuda(x, xs, v, vs, offsets, *, out_dtype=None, num_sms: int = 0,
                    tma_store: bool = False):
    """``[M, Nout]`` in ``out_dtype`` (bfloat16 default, or float32); ``x [M,
    Kc]`` e4m3, ``xs [M, Kc/128]`` f32, ``v [G, Nout, Kc]`` e4m3, ``vs [G,
    Nout/128, Kc/128]`` f32, ``offsets`` int32 ``[G+1]`` (``ops.offsets``);
    rows past ``offsets[-1]`` are zero. ``num_sms``: CTAs (0: one per SM).
    ``tma_store``: a bf16 result's 64-row blocks inside one group go out by
    TMA from a shared-memory copy of the tile, the ring one stage shorter
    (the same bits; ``select.fp8_tma_store`` picks it by the contraction's
    length)."""
    err = check_fp8_nt_cuda(x, xs, v, vs)
    if err is not None:
        raise ValueError(f"gmm_fp8_nt_cuda: {err}")
    out_dtype = _out_dtype("gmm_fp8_nt_cuda", out_dtype)
    m = x.shape[0]
    table = pair_one_block_tiles(*row_tile_table(offsets, m, NT_TILE_ROWS))
    xs_t = xs.astype(jnp.float32).T                                  # a tile's scales: one run
    return _call(TARGET, (m, v.shape[1]), out_dtype,
                 (x, xs_t, v, vs.astype(jnp.float32), *table[1:], table[0]), num_sms,
                 tile_rows=np.int32(NT_TILE_ROWS), tma_store=np.int32(bool(tma_store)))


def pair_one_block_tiles(counts, rs, lo, hi, grp):
    """The forward kernel's row-tile table with its one-block tiles paired:
    ``row_tile_table``'s ``(counts, start, lo, hi, group)`` -> ``(counts,
    start, lo, hi, group, partner)``.

    A group tile whose stored rows lie in its first 64-row block (a group of
    at most 64 rows, or a group's last rows) keeps one consumer warpgroup
    busy and the other idle. Such tiles are paired in table order: the
    first of a pair gets ``partner`` = the second's index, and the second
    leaves the tiles the kernel walks (moved past ``counts``, where the
    partner index finds it), so one CTA tile runs both blocks, one per
    consumer, each against its own group's weight (``cc/gmm/fp8_nt.cu``).
    Each row's products and promotions are unchanged: the same bits."""
    n = rs.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    lone = (idx < counts[0]) & (lo >= rs) & (hi <= rs + 64)
    rank = jnp.cumsum(lone.astype(jnp.int32)) - 1
    first = lone & (rank % 2 == 0) & (rank + 1 < jnp.sum(lone))
    second = lone & (rank % 2 == 1)
    by_rank = jnp.zeros((n,), jnp.int32).at[jnp.where(lone, rank, n)].set(idx, mode="drop")
    partner = jnp.where(first, by_rank[jnp.minimum(rank + 1, n - 1)], -1)
    # the tiles walked (group tiles, then the tail) first in table order, the seconds after
    walked = idx < counts[0] + counts[1]
    order = jnp.argsort(jnp.where(walked & ~second, 0, jnp.where(second, 1, 2)) * n + idx)
    where = jnp.zeros((n,), jnp.int32).at[order].set(idx)      # a tile's new index
    partner = partner[order]
    partner = jnp.where(partner >= 0, where[jnp.maximum(partner, 0)], -1)
    counts = jnp.stack([counts[0] - jnp.sum(second), counts[1]]).astype(jnp.int32)
    return (counts, rs[order], lo[order], hi[order], grp[order], partner.astype(jnp.int32))


def check_fp8_dw_cuda(a, a_s, c, c_s, segments=None) -> Optional[str]:
    """None if the CUDA dw kernel runs these operands, else why not."""
    return _no_extension() or check_fp8_dw(a, a_s, c, c_s, segments)


def tgmm_fp8_nt_cuda(a, a_s, c, c_s, segments, *, out_dtype=None, num_sms: int = 0):
    """``[G, Ka, Nc]`` in ``out_dtype`` (bfloat16 default, or float32): dw in
    the form of :func:`pallas_fp8_dw.tgmm_fp8_nt` (``a [Ka, P]``, ``as [P/128,
    Ka]``, ``c [Nc, P]``, ``cs [P/128, Nc]``, ``segments`` int32 ``[G+1]``,
    multiples of 128: ``fp8_columns.dw_operands``)."""
    err = check_fp8_dw_cuda(a, a_s, c, c_s, segments)
    if err is not None:
        raise ValueError(f"tgmm_fp8_nt_cuda: {err}")
    out_dtype = _out_dtype("tgmm_fp8_nt_cuda", out_dtype)
    shape = (segments.shape[0] - 1, a.shape[0], c.shape[0])
    return _call(DW_TARGET, shape, out_dtype,
                 (a, a_s.astype(jnp.float32), c, c_s.astype(jnp.float32),
                  segments.astype(jnp.int32)), num_sms)


def _out_dtype(fn, out_dtype):
    out_dtype = jnp.dtype(out_dtype or jnp.bfloat16)
    if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"{fn}: writes bfloat16 or float32, not {out_dtype}")
    return out_dtype


def _call(target, shape, out_dtype, ops, num_sms, **attrs):
    """The FFI call (typed attributes ``num_sms`` and ``attrs``), its operands
    and result varying over the union of their mesh axes (inside
    ``shard_map(check_vma=True)``)."""
    axes = frozenset().union(*(vma_of(a) for a in ops))
    ops = tuple(to_vma(a, axes) for a in ops)
    out = result_type(shape, out_dtype, vma=axes)
    return jax.ffi.ffi_call(target, out)(*ops, num_sms=np.int32(num_sms), **attrs)
