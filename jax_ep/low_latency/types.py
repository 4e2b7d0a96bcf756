"""Pytrees of the low-latency ops: handle, dispatch result, and the pending op
between a send half and its receive half (the hook)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LowLatencyHandle:
    """What :func:`low_latency_dispatch` leaves for :func:`low_latency_combine`.

    Attributes:
      slot: ``[T, K]`` int32, pair ``(t, topk_idx[t, k])``'s row among this
        source's rows of that expert (its packed row on the expert's rank:
        ``slot`` plus the rows of earlier sources, ``src_count``); -1 for
        unused slots, invalid ids and repeats of an expert already named by
        the token.
      info: ``[L, R * Tmax]`` int32 (native backend): ``t * K + k`` of each
        received row at its source, at the row's packed row (where combine
        sends the row back); None with the reference backend.
      src_count: ``[L, R]`` int32: rows per (local expert, source rank), where
        combine finds each source's rows in the packed layout.
      num_ranks, max_tokens: static R and Tmax.
    """

    slot: jax.Array
    info: Optional[jax.Array] = None
    src_count: Optional[jax.Array] = None
    num_ranks: int = 0
    max_tokens: int = 0


jax.tree_util.register_dataclass(LowLatencyHandle, data_fields=["slot", "info", "src_count"],
                                 meta_fields=["num_ranks", "max_tokens"])


@dataclasses.dataclass(frozen=True)
class LowLatencyDispatched:
    """Result of :func:`low_latency_dispatch`, per rank.

    Attributes:
      x: ``[L, R * Tmax, H]`` received rows (fp8-e4m3 with ``fp8``, else the
        input dtype), packed per expert: expert ``l``'s first ``count[l]``
        rows, by source rank then token (``src_count[l, s]`` rows from
        source ``s``), the rest unspecified: the masked layout
        ``jax_ep.grouped_matmul`` takes with ``group_sizes=count``.
      x_scales: ``[L, R * Tmax, H / 128]`` f32 dequantisation scales (fp8) or None.
      count: ``[L]`` int32 valid rows per local expert.
      src_count: ``[L, R]`` int32 valid rows per (local expert, source rank).
      handle: :class:`LowLatencyHandle`.
    """

    x: jax.Array
    x_scales: Optional[jax.Array]
    count: jax.Array
    src_count: jax.Array
    handle: LowLatencyHandle

    def valid_rows(self) -> jax.Array:
        """``[L, R * Tmax]`` bool: the rows that hold a token (each expert's
        first ``count[l]``)."""
        j = jnp.arange(self.x.shape[1], dtype=jnp.int32)
        return j[None, :] < self.count[:, None]


jax.tree_util.register_dataclass(
    LowLatencyDispatched, data_fields=["x", "x_scales", "count", "src_count", "handle"],
    meta_fields=[])


@dataclasses.dataclass(frozen=True)
class LowLatencyPending:
    """An op between its send half and its receive half (the hook).

    Attributes:
      token: native backend: ``[1]`` uint32 output of the send custom call,
        the receive's input (it orders the receive after the send; it holds
        no data). None with the reference backend.
      arrays: what the receive half needs (native: the handle's slot for
        dispatch; slot and merged weights for combine).
      result: reference backend: the op's finished result.
      meta: static: the op ("dispatch" / "combine") and the receive's shapes.
    """

    token: Optional[jax.Array]
    arrays: tuple
    result: object
    meta: tuple


jax.tree_util.register_dataclass(LowLatencyPending, data_fields=["token", "arrays", "result"],
                                 meta_fields=["meta"])
