"""Routing shared by every backend: the metadata of docs/semantics.md (§2-§5) as pure JAX.

Both backends compute the same handle, group sizes, counts and per-row
routing weights from these functions; they differ only in the ``exchange``
they pass (``x [R, T, W]``: slice r goes to rank r, the result's slice s came
from rank s) and in how the rows themselves move (XLA all_to_all in
``jax_ep.intranode.reference``, the CUDA kernels in ``jax_ep.intranode.native``
and ``jax_ep.internode.native``).

Every function runs per rank inside ``jax.shard_map``.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from .config import EpConfig
from .fp8 import F32, FP8
from .types import Handle

Exchange = Callable[[jax.Array, EpConfig], jax.Array]


def xla_all_to_all(x, cfg: EpConfig):
    """x [R, ...] -> [R, ...]: row r goes to rank r; result row s came from rank s.

    fp8 travels as its bits (not every XLA backend has fp8 collectives)."""
    if x.dtype == FP8:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint8)
        return jax.lax.bitcast_convert_type(jax.lax.all_to_all(bits, cfg.axis_name, 0, 0), FP8)
    return jax.lax.all_to_all(x, cfg.axis_name, 0, 0)


def excl_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis) - x


def invalid_ids(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """Slots whose id lies outside ``[-1, E)``: dropped and counted (semantics §2)."""
    return (topk_idx < -1) | (topk_idx >= num_experts)


def sanitize_topk(topk_idx: jax.Array, num_experts: int):
    """-> (idx with invalid and repeated ids set to -1, number of invalid ids).

    Ids outside [-1, E) are dropped and counted. A repeated id inside one
    token's top-k is routed once (its first slot); later copies act as -1.
    ``merge_duplicate_weights`` moves their weights onto that first slot."""
    invalid = invalid_ids(topk_idx, num_experts)
    idx = jnp.where(invalid, -1, topk_idx)
    K = idx.shape[1]
    earlier = jnp.tril(jnp.ones((K, K), bool), -1)  # [k, j]: j < k
    dup = jnp.any((idx[:, :, None] == idx[:, None, :]) & earlier[None], axis=2)
    idx = jnp.where(dup & (idx >= 0), -1, idx)
    return idx, jnp.sum(invalid, dtype=jnp.int32)


def merge_duplicate_weights(topk_idx: jax.Array, topk_weights: jax.Array, num_experts: int):
    """Dense-MoE weights for rows that name one expert in several slots.

    ``w'[t, k] = sum_j [idx[t, j] == idx[t, k]] w[t, j]`` (j ascending) on the first slot
    naming a valid expert (``[0, E)``), 0 on its repeats and on -1 / invalid
    slots. Plain differentiable jnp: the gradient of every duplicate slot is
    the gradient of the merged one, ``<d_out, f_e(x)>``, as in a dense MoE.
    Rows without repeats keep their weights bit for bit."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    K = topk_idx.shape[1]
    same = (topk_idx[:, :, None] == topk_idx[:, None, :]) & valid[:, :, None]  # [T, k, j]
    earlier = jnp.tril(jnp.ones((K, K), bool), -1)  # [k, j]: j < k
    first = valid & ~jnp.any(same & earlier[None], axis=2)
    repeated = jnp.sum(same, axis=2) > 1
    merged = jnp.zeros(topk_weights.shape, topk_weights.dtype)
    for j in range(K):   # slots ascending (semantics §2): the same bits on every backend
        merged = merged + jnp.where(same[:, :, j], topk_weights[:, None, j], 0)
    w = jnp.where(repeated, merged, topk_weights)
    return jnp.where(first, w, jnp.zeros((), w.dtype))


def layout_counts(topk_idx, cfg: EpConfig, R: int):
    """``get_dispatch_layout`` computed locally: (tokens per rank [R], tokens per
    expert [E], is_token_in_rank [T, R]); invalid ids count nowhere, a token once
    per rank."""
    E = cfg.num_experts
    L = E // R
    idx, _ = sanitize_topk(topk_idx, E)
    onehot_e = jnp.any(idx[:, :, None] == jnp.arange(E)[None, None], axis=1)  # [T, E]
    in_rank = jnp.any(onehot_e.reshape(-1, R, L), axis=2)  # [T, R]
    return (jnp.sum(in_rank, axis=0, dtype=jnp.int32),
            jnp.sum(onehot_e, axis=0, dtype=jnp.int32),
            in_rank)

def route(topk_idx, cfg: EpConfig, R: int, exchange: Exchange):
    """Exchange routing metadata -> (handle, group_sizes [L] or None, num_valid,
    num_dropped); see ``Backend.route``."""
    T, K = topk_idx.shape
    E = cfg.num_experts
    L = E // R
    C = cfg.capacity_for(R, T)
    idx, num_invalid = sanitize_topk(topk_idx, E)
    dest = jnp.where(idx >= 0, idx // L, -1)  # [T, K]
    ranks = jnp.arange(R, dtype=jnp.int32)
    to_r = dest[None] == ranks[:, None, None]  # [R, T, K]
    send_mask = jnp.any(to_r, axis=2).T  # [T, R]
    send_local = jnp.where(to_r, idx[None] - ranks[:, None, None] * L, -1)
    recv_local_idx = exchange(send_local.astype(jnp.int32), cfg)  # [R(src), T, K]
    valid = recv_local_idx >= 0

    if cfg.layout == "expert_major":
        a = cfg.expert_alignment
        onehot = (recv_local_idx[..., None] == jnp.arange(L)).any(axis=2)  # [R, T, L]
        onehot = onehot.reshape(R * T, L).astype(jnp.int32)
        counts = jnp.sum(onehot, axis=0)
        aligned = (counts + a - 1) // a * a
        start = excl_cumsum(aligned, 0)
        pair_row = start[None] + excl_cumsum(onehot, 0)  # [R*T, L]
        l_safe = jnp.maximum(recv_local_idx, 0).reshape(R * T, K)
        row = jnp.take_along_axis(pair_row, l_safe, axis=1).reshape(R, T, K)
        stored = valid & (row < C)
        slot_row = jnp.where(stored, row, -1)
        num_dropped_recv = jnp.sum(valid & ~stored, dtype=jnp.int32)
        num_valid = jnp.sum(stored, dtype=jnp.int32)
        group_sizes = jnp.clip(start + aligned, 0, C) - jnp.clip(start, 0, C)
    else:
        present = jnp.any(valid, axis=2)  # [R, T]
        pos = excl_cumsum(present.reshape(-1).astype(jnp.int32), 0).reshape(R, T)
        ok = present & (pos < C)
        slot_row = jnp.broadcast_to(jnp.where(ok, pos, -1)[..., None], (R, T, K))
        num_dropped_recv = jnp.sum(valid & ~ok[..., None], dtype=jnp.int32)
        num_valid = jnp.sum(ok, dtype=jnp.int32)
        group_sizes = None
        stored = ok[..., None] & (jnp.arange(K) == 0)  # one writer per row

    target = jnp.where(stored, slot_row, C).reshape(-1)  # C = out of bounds, dropped
    src_of_slot = jnp.broadcast_to(jnp.arange(R * T, dtype=jnp.int32).reshape(R, T, 1), (R, T, K))
    row_src = jnp.full((C,), -1, jnp.int32).at[target].set(
        src_of_slot.reshape(-1), mode="drop")
    handle = Handle(send_mask=send_mask, recv_local_idx=recv_local_idx,
                    slot_row=slot_row.astype(jnp.int32), row_src=row_src, native=None,
                    num_ranks=R, num_tokens=T, capacity=C, layout=cfg.layout)
    return handle, group_sizes, num_valid, num_invalid + num_dropped_recv


def send_rows(x, handle: Handle, cfg: EpConfig, exchange: Exchange):
    """x [T, W] -> received [R*T, W] (source-major), zero where not sent."""
    mask = handle.send_mask.T[:, :, None]  # [R, T, 1]
    send = jnp.where(mask, x[None], jnp.zeros((), x.dtype))
    recv = exchange(send, cfg)
    return recv.reshape(-1, x.shape[1])


def dispatch_weights(topk_weights, handle: Handle, cfg: EpConfig, exchange: Exchange):
    """``[T, K]`` f32 -> ``[C]`` (expert_major) or ``[C, K]`` (rank_major)."""
    R, T, K = handle.recv_local_idx.shape
    recv = send_rows(topk_weights, handle, cfg, exchange).reshape(R, T, K)
    local = handle.recv_local_idx >= 0
    recv = jnp.where(local, recv, 0.0)
    C = handle.capacity
    if handle.layout == "expert_major":
        target = jnp.where(local & (handle.slot_row >= 0), handle.slot_row, C)
        return jnp.zeros((C,), F32).at[target.reshape(-1)].set(recv.reshape(-1), mode="drop")
    src = handle.row_src
    rows = recv.reshape(R * T, K)[jnp.maximum(src, 0)]
    return jnp.where((src >= 0)[:, None], rows, 0.0)

def return_weights(d_recv_w, handle: Handle, cfg: EpConfig, exchange: Exchange):
    """Transpose of :func:`dispatch_weights` -> ``[T, K]`` f32."""
    R, T, K = handle.recv_local_idx.shape
    ok = (handle.recv_local_idx >= 0) & (handle.slot_row >= 0)
    row = jnp.maximum(handle.slot_row, 0)
    if handle.layout == "expert_major":
        g = d_recv_w[row]
    else:
        g = d_recv_w[row, jnp.arange(K)[None, None, :]]
    g = jnp.where(ok, g, 0.0).astype(F32)  # [R(src), T, K]
    back = exchange(g, cfg)  # [R(expert rank), T, K]
    out = back[0]
    for r in range(1, R):
        out = out + back[r]
    return out


class XlaRouter:
    """A :class:`jax_ep.backend.Router`: ``route``, ``dispatch_weights`` and
    ``return_weights`` over XLA's all_to_all (``exchange``). Both backends hold
    one (``backend.router``) and differ only in how the rows move."""

    @staticmethod
    def exchange(x, cfg: EpConfig):
        return xla_all_to_all(x, cfg)

    def route(self, topk_idx, cfg: EpConfig, R: int):
        return route(topk_idx, cfg, R, self.exchange)

    def dispatch_weights(self, topk_weights, handle: Handle, cfg: EpConfig):
        return dispatch_weights(topk_weights, handle, cfg, self.exchange)

    def return_weights(self, d_recv_w, handle: Handle, cfg: EpConfig):
        return return_weights(d_recv_w, handle, cfg, self.exchange)
