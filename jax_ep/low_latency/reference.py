"""Low-latency reference backend: the semantics in pure JAX.

An XLA all_to_all of a dense ``[R, L * Tmax, H]`` buffer per op; the send half
does everything and the receive half returns its result (same values as the
native kernels, no overlap). Runs anywhere, CPU included.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..fp8 import F32, fp8_cast
from .config import LowLatencyConfig
from .types import LowLatencyDispatched, LowLatencyHandle, LowLatencyPending


def _exchange(buf, cfg: LowLatencyConfig):
    """``[R, ...]`` block r to rank r; returns ``[R(source), ...]``."""
    return jax.lax.all_to_all(buf, cfg.axis_name, 0, 0, tiled=True)


def _after(x, after):
    """``x``, available to XLA only once ``after`` is computed (an optimization
    barrier, an edge without data; the reference has no state between calls,
    so the edge only keeps both backends' programs alike)."""
    if after is None:
        return x
    return jax.lax.optimization_barrier((x, after))[0]


def _dispatch(x, idx, slot, per_expert, cfg: LowLatencyConfig, R: int, fp8: bool,
              scale_format: str) -> LowLatencyDispatched:
    E, L, Tm = cfg.num_experts, cfg.num_experts // R, cfg.max_tokens_per_rank
    # send buffer [E * Tm, W]: expert e's block (rank e // L, local e % L), row slot
    T, K = idx.shape
    dest = jnp.where(slot >= 0, idx * Tm + slot, E * Tm).reshape(-1)
    src = jnp.repeat(jnp.arange(T), K)

    def place(rows):
        buf = jnp.zeros((E * Tm + 1,) + rows.shape[1:], rows.dtype).at[dest].set(rows[src])
        recv = _exchange(buf[:-1].reshape(R, L * Tm, *rows.shape[1:]), cfg)
        recv = recv.reshape(R, L, Tm, *rows.shape[1:]).swapaxes(0, 1)   # [L, R, Tm, ...]
        return recv.reshape(L, R * Tm, *rows.shape[1:])

    src_count = _exchange(per_expert.reshape(R, L), cfg).T          # [L, R]
    block_row, valid = _block_rows(src_count, Tm)

    def pack(blocks):   # [L, R * Tm, ...] per-source blocks -> packed, zero past count
        rows = jnp.take_along_axis(blocks, block_row.reshape(block_row.shape + (1,) *
                                                              (blocks.ndim - 2)), axis=1)
        return jnp.where(valid.reshape(valid.shape + (1,) * (blocks.ndim - 2)), rows,
                         jnp.zeros((), blocks.dtype))

    if fp8:
        q, s = fp8_cast(x, scale_format=scale_format)
        recv_x, recv_s = pack(place(q)), pack(place(s))
    else:
        recv_x, recv_s = pack(place(x)), None
    return LowLatencyDispatched(x=recv_x, x_scales=recv_s, count=jnp.sum(src_count, axis=1),
                                src_count=src_count,
                                handle=LowLatencyHandle(slot=slot, src_count=src_count,
                                                        num_ranks=R, max_tokens=Tm))


def _block_rows(src_count, Tm: int):
    """For each packed row ``p`` of expert ``l`` (``[L, R * Tm]``): the row of
    the per-source blocks ``[L, R * Tm]`` (source ``s``'s rows at ``s * Tm``)
    it comes from, and whether ``p < count[l]``."""
    L, R = src_count.shape
    n = jnp.clip(src_count.astype(jnp.int32), 0, Tm)
    end = jnp.cumsum(n, axis=1)                                      # [L, R]
    p = jnp.arange(R * Tm, dtype=jnp.int32)
    s = jax.vmap(lambda e: jnp.searchsorted(e, p, side="right"))(end)   # [L, R * Tm]
    valid = s < R
    s = jnp.minimum(s, R - 1)
    start = jnp.take_along_axis(end - n, s, axis=1)
    return jnp.where(valid, s * Tm + p[None, :] - start, 0), valid


def _packed_rows(src_count, Tm: int):
    """For each row ``b = s * Tm + j`` of the per-source blocks ``[L, R * Tm]``:
    its packed row (the rows of earlier sources, plus ``j``) and whether ``j <
    src_count[l, s]``."""
    L, R = src_count.shape
    n = jnp.clip(src_count.astype(jnp.int32), 0, Tm)
    j = jnp.arange(Tm, dtype=jnp.int32)
    start = (jnp.cumsum(n, axis=1) - n)[:, :, None]                  # [L, R, 1]
    valid = j[None, None, :] < n[:, :, None]
    return (jnp.where(valid, start + j, 0).reshape(L, R * Tm),
            valid.reshape(L, R * Tm))


def _combine(y, idx, w, slot, src_count, cfg: LowLatencyConfig, R: int, Tm: int):
    E, L = cfg.num_experts, cfg.num_experts // R
    H = y.shape[2]
    # packed rows back to per-source blocks (rows past a block's count: zero, never read)
    packed, valid = _packed_rows(src_count, Tm)
    y = jnp.where(valid[..., None], jnp.take_along_axis(y, packed[..., None], axis=1),
                  jnp.zeros((), y.dtype))
    back = y.reshape(L, R, Tm, H).swapaxes(0, 1).reshape(R, L * Tm, H)
    back = _exchange(back, cfg).reshape(E * Tm, H)                  # [e * Tm + slot]
    out = jnp.zeros((idx.shape[0], H), F32)
    for k in range(idx.shape[1]):   # fixed order: k ascending
        ok = (slot[:, k] >= 0)[:, None]
        row = back[jnp.where(slot[:, k] >= 0, idx[:, k] * Tm + slot[:, k], 0)].astype(F32)
        out = out + jnp.where(ok, w[:, k:k + 1] * row, F32(0))
    return out.astype(y.dtype)


class ReferenceBackend:
    """A :class:`jax_ep.backend.LowLatencyBackend` in pure JAX."""

    name = "reference"

    def unavailable(self, cfg: LowLatencyConfig):
        return None   # runs anywhere

    def dispatch_send(self, x, idx, slot, per_expert, cfg: LowLatencyConfig, R: int, fp8: bool,
                      scale_format: str, after=None) -> LowLatencyPending:
        d = _dispatch(_after(x, after), idx, slot, per_expert, cfg, R, fp8, scale_format)
        return LowLatencyPending(token=None, arrays=(), result=d, meta=("dispatch",))

    def dispatch_recv(self, pending: LowLatencyPending) -> LowLatencyDispatched:
        return pending.result

    def combine_send(self, y, idx, w, handle: LowLatencyHandle, cfg: LowLatencyConfig, R: int,
                     after=None) -> LowLatencyPending:
        out = _combine(_after(y, after), idx, w, handle.slot, handle.src_count, cfg, R,
                       handle.max_tokens)
        return LowLatencyPending(token=None, arrays=(), result=out, meta=("combine",))

    def combine_recv(self, pending: LowLatencyPending) -> jax.Array:
        return pending.result


BACKEND = ReferenceBackend()
