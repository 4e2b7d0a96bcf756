"""Low-latency (decode) dispatch and combine: docs/semantics.md §12.

Per rank, inside ``jax.shard_map`` over ``config.axis_name`` (R ranks, E
experts, L = E / R local experts, T <= Tmax = ``config.max_tokens_per_rank``
tokens, H hidden, K top-k). Every (token, expert) pair gets its own row of
one static layout, with no CPU-visible size (the native kernels send a token
once per destination rank and replicate it there):

- ``x [L, R * Tmax, H]``: expert ``l``'s first ``count[l]`` rows hold the
  tokens that picked it, by source rank, then in token order: ``n[l, s]``
  rows from source ``s`` after those of sources ``< s`` (packed, DeepEP's
  layout in a fixed order; rows past ``count[l]`` are unspecified). It is
  the masked layout ``jax_ep.grouped_matmul(x, w, count)`` takes;
- ``src_count [L, R]`` = ``n``, ``count [L]`` = its sum over sources.

The source knows where each of its pairs lands inside its own rows without
asking anyone: the token's rank among its own tokens that picked the same
expert. That index is the handle's ``slot [T, K]``; with ``src_count`` (the
rows of earlier sources) it locates the pair's row for combine. fp8 sends e4m3 rows with
per-token, per-128-channel scales, f32 (``jax_ep.fp8_cast``) or
power-of-two "UE8M0" (exact on every platform). Combine brings each expert's
output row back and sums ``out[t] = cast(sum_k w'_k f32(y_(t, k)))`` on the
source, k ascending, in f32 (``w'``: repeated ids merged onto the first slot,
as in normal mode).

The reference backend (``jax_ep/low_latency/reference.py``: XLA all_to_all
of a dense ``[R, L * Tmax, H]`` buffer) is the semantics; the native kernels
(``jax_ep/low_latency/native.py``, cc/low_latency/kernels.cu) give its bits;
``jax_ep.backend.select`` picks one.
Forward-only: differentiating raises.

The hook: each op also exists as a send half and a receive half,
``low_latency_dispatch_send`` / ``low_latency_dispatch_recv`` and
``low_latency_combine_send`` / ``low_latency_combine_recv``, linked by a
:class:`LowLatencyPending` value. Natively the send kernel only issues its
stores and signals and exits; work placed between the halves runs while the
data travels, and the receive kernel waits for the signals. Per op, calls
must alternate send, receive, send, ... on every rank (two sends of one op in
flight would overwrite rows a peer still reads: the native send then raises).
With the reference backend the send half does everything and the receive
half returns its result (same values, no overlap).
"""
from __future__ import annotations

from functools import partial
from typing import Union

import jax
import jax.numpy as jnp

from .. import backend as _backend
from .. import validate
from ..config import FP8_SCALE_FORMATS, EpConfig
from ..routing import F32, excl_cumsum, merge_duplicate_weights, sanitize_topk
from . import config as ll_config
from .config import LowLatencyConfig
from .types import LowLatencyDispatched, LowLatencyHandle, LowLatencyPending


# Up to this many (token, expert) pairs, _slots compares every pair with every
# earlier one ([T*K, T*K]: one fused reduce, ~1 µs at V3-decode) instead of an
# exclusive cumsum over a [T, E] one-hot (XLA:GPU: 6 µs at T 128, E 256; both
# exact integers, the same slots: tests/test_low_latency.py).
_PAIRWISE_SLOTS_MAX = 2048


def _slots(topk_idx, E):
    """Per pair, its slot among this rank's rows of the expert (the token's
    rank among this rank's tokens that picked the same expert), and tokens per expert ``[E]``.
    Invalid ids and repeats of an id the token already named get no slot
    (``sanitize_topk``, the normal mode's rule)."""
    idx, _ = sanitize_topk(topk_idx, E)
    first = idx >= 0
    e = jnp.where(first, idx, E)
    T, K = topk_idx.shape
    if T * K <= _PAIRWISE_SLOTS_MAX:
        # pair i's slot = earlier pairs (flat order t*K + k) naming its expert:
        # a token names an expert once, so "earlier" is "of an earlier token"
        f = e.reshape(-1)
        i = jnp.arange(T * K, dtype=jnp.int32)
        before = (f[None, :] == f[:, None]) & (i[None, :] < i[:, None])
        pos = jnp.sum(before, axis=1, dtype=jnp.int32).reshape(T, K)
        slot = jnp.where(first, pos, -1)
        count = jnp.zeros((E + 1,), jnp.int32).at[f].add(1)[:E]
        return slot.astype(jnp.int32), count
    return _slots_cumsum(e, first, E)


def _slots_cumsum(e, first, E):
    """``_slots`` by an exclusive cumsum over the ``[T, E]`` one-hot (any T)."""
    onehot = jnp.zeros((e.shape[0], E + 1), jnp.int32).at[
        jnp.arange(e.shape[0])[:, None], e].add(1)[:, :E]   # [T, E] 0/1
    pos = excl_cumsum(onehot, axis=0)
    slot = jnp.where(first, jnp.take_along_axis(pos, jnp.minimum(e, E - 1), axis=1), -1)
    return slot.astype(jnp.int32), jnp.sum(onehot, axis=0).astype(jnp.int32)


Config = Union[LowLatencyConfig, EpConfig]


def _config(config: Config):
    """(R, the :class:`LowLatencyConfig`) of ``config``; an EpConfig is checked as
    normal mode checks it (E and num_nodes against R)."""
    if isinstance(config, EpConfig):
        R = validate.axis_size(config)
    else:
        R = validate.mesh_axis_size(config)
    cfg = ll_config.of(config)
    cfg.local_experts(R)
    return R, cfg


def _check(x, topk_idx, cfg: LowLatencyConfig, R: int, fp8: bool, scale_format: str):
    if x.ndim != 2 or topk_idx.ndim != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"low_latency_dispatch: x must be [T, H] and topk_idx [T, K], got "
                         f"{x.shape} and {topk_idx.shape}")
    T, K = topk_idx.shape
    if x.shape[1] != cfg.hidden:
        raise ValueError(f"low_latency_dispatch: x has H={x.shape[1]}, config.hidden={cfg.hidden}")
    if T > cfg.max_tokens_per_rank:
        raise ValueError(f"low_latency_dispatch: T={T} tokens exceed "
                         f"config.max_tokens_per_rank={cfg.max_tokens_per_rank} (Tmax)")
    if K != cfg.topk:
        raise ValueError(f"low_latency_dispatch: topk_idx has K={K}, config.topk={cfg.topk}")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise TypeError(f"low_latency_dispatch: topk_idx must be integer, got {topk_idx.dtype}")
    if x.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise TypeError(f"low_latency_dispatch: x must be bf16 or f32, got {x.dtype}")
    if scale_format not in FP8_SCALE_FORMATS:
        raise ValueError("low_latency_dispatch: scale_format must be one of "
                         f"{FP8_SCALE_FORMATS}, got {scale_format!r}")
    if fp8 and x.shape[1] % 128:
        raise ValueError(f"low_latency_dispatch: fp8 needs H % 128 == 0, got H={x.shape[1]}")


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _forward_only(name, *arrays):
    return arrays


def _forward_only_fwd(name, *arrays):
    return arrays, None


def _forward_only_bwd(name, res, g):
    raise TypeError(f"jax_ep.{name} is forward-only (the decode path): it has no gradient. "
                    "Use jax_ep.dispatch / jax_ep.combine where gradients are needed, or "
                    "jax.lax.stop_gradient the inputs.")


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)


def low_latency_dispatch_send(x: jax.Array, topk_idx: jax.Array, config: Config, *,
                              fp8: bool = True, scale_format: str = "f32",
                              after=None) -> LowLatencyPending:
    """Send half of :func:`low_latency_dispatch` (same arguments).

    Natively: one kernel stores each token row once into every rank that
    holds one of its experts (the receive half copies it to each expert's
    row) and raises the signal words, then exits (nothing
    waits while the rows travel). Finish with :func:`low_latency_dispatch_recv`;
    independent work may run in between. Per op, sends and receives must
    alternate on every rank: with two micro-batches, pass the previous
    dispatch's result (any pytree of arrays) as ``after`` so that XLA cannot
    schedule this send before that receive.
    """
    R, cfg = _config(config)
    _check(x, topk_idx, cfg, R, fp8, scale_format)
    be = _backend.select(_backend.LOW_LATENCY, cfg)
    x, = _forward_only("low_latency_dispatch", x)
    idx = topk_idx.astype(jnp.int32)
    slot, per_expert = _slots(idx, cfg.num_experts)
    return be.dispatch_send(x, idx, slot, per_expert, cfg, R, fp8, scale_format, after=after)


def low_latency_dispatch_recv(pending: LowLatencyPending) -> LowLatencyDispatched:
    """Receive half of :func:`low_latency_dispatch`: waits for every source's
    signals (a device-side timeout, never a hang) and writes the outputs.

    Args:
      pending: the :func:`low_latency_dispatch_send` result.

    Returns:
      :class:`LowLatencyDispatched`, as :func:`low_latency_dispatch`.
    """
    if pending.meta[0] != "dispatch":
        raise ValueError(f"low_latency_dispatch_recv: got the pending {pending.meta[0]!r} op")
    return _backend.sent_by(_backend.LOW_LATENCY, pending).dispatch_recv(pending)


def low_latency_dispatch(x: jax.Array, topk_idx: jax.Array, config: Config, *,
                         fp8: bool = True, scale_format: str = "f32",
                         after=None) -> LowLatencyDispatched:
    """Send each (token, expert) pair to the expert's rank, into a static layout.

    Args:
      x: ``[T, H]`` bf16 / f32 tokens, ``T <= config.max_tokens_per_rank`` (Tmax).
        The native backend sends fp8 or bf16 rows (f32 needs ``fp8=True``).
      topk_idx: ``[T, K]`` expert ids in ``[-1, E)`` (-1, or any id outside,
        = slot unused); an expert named twice by a token is sent once.
      config: a :class:`LowLatencyConfig`, or an :class:`EpConfig` (its fields
        of the same names are read; layout, capacity, fp8 and internode fields
        are unused). The native backend needs
        ``jax_ep.initialize(low_latency=config)``.
      fp8: send fp8-e4m3 rows with per-token, per-128-channel scales (else x's dtype).
      scale_format: ``"f32"`` (``jax_ep.fp8_cast``) or ``"ue8m0"`` (power-of-two
        scales: the cast is exact, the same bits on every platform).
      after: any pytree of arrays this dispatch must run after. Two dispatches
        in one program that do not depend on each other by data (e.g. two
        micro-batches) must be ordered this way: pass the first one's result
        to the second (the native send of an op must follow its previous
        receive on every rank).

    Returns:
      :class:`LowLatencyDispatched` (``x [L, R*Tmax, H]``, ``x_scales``,
      ``count [L]``, ``src_count [L, R]``, ``handle``). Forward-only.
    """
    return low_latency_dispatch_recv(
        low_latency_dispatch_send(x, topk_idx, config, fp8=fp8, scale_format=scale_format,
                                  after=after))


def low_latency_combine_send(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                             handle: LowLatencyHandle, config: Config, *,
                             after=None) -> LowLatencyPending:
    """Send half of :func:`low_latency_combine` (same arguments): natively one
    kernel stores every valid row of ``y`` into its source's combine area and
    signals; finish with :func:`low_latency_combine_recv`. ``after``: as in
    :func:`low_latency_dispatch_send` (the previous combine's output)."""
    R, cfg = _config(config)
    E, L, Tm = cfg.num_experts, cfg.num_experts // R, handle.max_tokens
    if y.ndim != 3 or y.shape[:2] != (L, R * Tm):
        raise ValueError(f"low_latency_combine: y must be [L, R*Tmax, H] = [{L}, {R * Tm}, H], "
                         f"got {y.shape}")
    if topk_idx.shape != handle.slot.shape or topk_weights.shape != handle.slot.shape:
        raise ValueError(f"low_latency_combine: topk_idx / topk_weights must be {handle.slot.shape} "
                         f"(the dispatch's [T, K]), got {topk_idx.shape} / {topk_weights.shape}")
    if handle.num_ranks != R:
        raise ValueError(f"low_latency_combine: handle is for R={handle.num_ranks}, axis has {R}")
    if handle.src_count is None:
        raise ValueError("low_latency_combine: the handle has no src_count, which locates each "
                         "source's rows in y; pass the handle of the low_latency_dispatch whose "
                         "rows y holds")
    if handle.src_count.shape != (L, R):
        raise ValueError(f"low_latency_combine: handle.src_count must be [L, R] = [{L}, {R}], got "
                         f"{handle.src_count.shape}; pass the dispatch's handle unchanged")
    be = _backend.select(_backend.LOW_LATENCY, cfg)
    y, topk_weights = _forward_only("low_latency_combine", y, topk_weights)
    idx = topk_idx.astype(jnp.int32)
    w = merge_duplicate_weights(idx, topk_weights.astype(F32), E)
    return be.combine_send(y, idx, w, handle, cfg, R, after=after)


def low_latency_combine_recv(pending: LowLatencyPending) -> jax.Array:
    """Receive half of :func:`low_latency_combine`: waits for every expert
    rank's signal, then reduces; returns ``[T, H]`` as :func:`low_latency_combine`."""
    if pending.meta[0] != "combine":
        raise ValueError(f"low_latency_combine_recv: got the pending {pending.meta[0]!r} op")
    return _backend.sent_by(_backend.LOW_LATENCY, pending).combine_recv(pending)


def low_latency_combine(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                        handle: LowLatencyHandle, config: Config, *, after=None) -> jax.Array:
    """Bring every expert's output row back and reduce it with the routing weights.

    Args:
      y: ``[L, R * Tmax, H]`` expert outputs in the dispatch layout (bf16 / f32;
        rows past ``count[l]`` are never read).
      topk_idx: ``[T, K]``, the ids given to :func:`low_latency_dispatch`.
      topk_weights: ``[T, K]`` routing weights (used as f32).
      handle: the dispatch's :class:`LowLatencyHandle`.
      config: the dispatch's config.
      after: as in :func:`low_latency_dispatch` (the previous combine's output).

    Returns:
      ``[T, H]`` in y's dtype: ``cast(sum_k w'_k f32(y_(t, k)))``, k ascending,
      f32 accumulation, where ``w'`` merges repeated ids onto the first slot.
      Forward-only.
    """
    return low_latency_combine_recv(
        low_latency_combine_send(y, topk_idx, topk_weights, handle, config, after=after))
