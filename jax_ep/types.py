"""Pytree result types shared by every backend."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax

from .mesh_axes import global_sum


@dataclasses.dataclass(frozen=True)
class Handle:
    """Routing state a dispatch leaves for combine and the backward passes.

    Per rank (R ranks, T tokens per rank, K slots, C output rows). All index
    arrays are int32 and ``-1`` marks "none".

    Attributes:
      send_mask: ``[T, R]`` bool, token t is sent to rank r (``is_token_in_rank``).
      recv_local_idx: ``[R, T, K]`` local expert id each received slot picked
        (source rank s, source token t), -1 when unused/not for this rank.
      slot_row: ``[R, T, K]`` output row of each received slot (expert_major) or
        of its token (rank_major, the same for all k), -1 when not stored.
      row_src: ``[C]`` flat source ``s*T + t`` of each output row, -1 for padding
        and unused rows.
      num_ranks, num_tokens, capacity, layout: static.
      native: backend-private arrays (native backend only), else None.
      padded_tokens: static; rows :func:`jax_ep.dispatch` appended to the
        caller's tokens (one empty row when T = 0), which combine strips.
        ``num_tokens`` counts them.
      dispatch_config: static; the dispatch's :class:`EpConfig` fields that
        combine's must equal (``validate.DISPATCH_FIELDS``: name, value pairs;
        empty: unchecked).
    """

    send_mask: jax.Array
    recv_local_idx: jax.Array
    slot_row: jax.Array
    row_src: jax.Array
    native: Any = None
    num_ranks: int = 0
    num_tokens: int = 0
    capacity: int = 0
    layout: str = "expert_major"
    padded_tokens: int = 0
    dispatch_config: tuple = ()


jax.tree_util.register_dataclass(
    Handle,
    data_fields=["send_mask", "recv_local_idx", "slot_row", "row_src", "native"],
    meta_fields=["num_ranks", "num_tokens", "capacity", "layout", "padded_tokens",
                 "dispatch_config"],
)


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """Result of :func:`jax_ep.dispatch`, per rank.

    Attributes:
      x: ``[C, H]`` received rows, dtype of the input (or fp8-e4m3 when fp8).
        expert_major: grouped by local expert (groups in expert order, each
        starting at a multiple of ``expert_alignment``, rows inside a group
        ordered by (source rank, source token)). rank_major: one row per
        (source rank, source token) that picked this rank, in that order.
        Rows past the valid ones are zero.
      x_scales: ``[C, H/128]`` f32 dequantisation scales when ``x`` is fp8,
        else None.
      group_sizes: ``[L]`` int32 (expert_major): rows of each local expert
        group, rounded up to ``expert_alignment`` (clamped to C), so groups tile
        ``x`` contiguously: ``jax.lax.ragged_dot(d.x, w, d.group_sizes)``.
        None for rank_major.
      weights: ``[C]`` f32 (expert_major): routing weight of each row's
        (token, expert) pair; 0 on padding rows. A token that names one
        expert in several of its slots reaches it once, with the sum of
        those slots' weights (dense-MoE math). None for rank_major.
      topk_idx: ``[C, K]`` int32 (rank_major): local expert id of each slot,
        -1 when that slot went to another rank, was unused, or repeats an
        earlier slot's expert. None for expert_major.
      topk_weights: ``[C, K]`` f32 (rank_major): weights of those slots (0
        where topk_idx is -1; the first of repeated slots carries their sum).
        None for expert_major.
      num_valid: int32 ``[1]``, rows of ``x`` that hold data (padding
        excluded). Shape ``[1]`` (not a scalar) so that a ``shard_map`` can
        return it with ``out_specs=P(axes)``, giving one count per device.
      num_dropped: int32 ``[1]``, (token, expert) pairs this rank lost:
        expert ids outside ``[-1, E)`` in its own input, plus received pairs
        that did not fit in C. :attr:`total_dropped` is the global count.
      handle: :class:`Handle` for combine and the backward passes.
    """

    x: jax.Array
    x_scales: Optional[jax.Array]
    group_sizes: Optional[jax.Array]
    weights: Optional[jax.Array]
    topk_idx: Optional[jax.Array]
    topk_weights: Optional[jax.Array]
    num_valid: jax.Array
    num_dropped: jax.Array
    handle: Handle

    @property
    def total_dropped(self) -> jax.Array:
        """int32 scalar: ``num_dropped`` summed over every device of the mesh
        (a ``psum`` over the manual axes of the enclosing ``shard_map``), the same on
        every device, so ``out_specs=P()`` returns it. Call it inside the
        ``shard_map``; it costs one scalar all-reduce (none when unused)."""
        return global_sum(self.num_dropped[0])


jax.tree_util.register_dataclass(
    Dispatched,
    data_fields=["x", "x_scales", "group_sizes", "weights", "topk_idx", "topk_weights",
                 "num_valid", "num_dropped", "handle"],
    meta_fields=[],
)
