"""The interface every backend implements, and backend selection.

All methods run per rank inside ``jax.shard_map`` over ``cfg.axis_name`` and
see per-rank shapes. ``R`` = size of the EP axis, ``T`` = tokens per rank,
``C`` = capacity (``cfg.capacity_for(R, T)``).

The split keeps the differentiation rules in one place (``jax_ep.api``):
dispatch = ``route`` + ``dispatch_rows`` (+ ``dispatch_weights``); combine =
``combine_rows``; the backward of dispatch is ``combine_rows`` without weights
plus ``return_weights``; the backward of combine is ``combine_backward`` (a
dispatch of the output cotangent, weighted on the expert side, plus the
weights' gradient).

A backend is composed of a :class:`Router` (``backend.router``: the routing
metadata and the weights) and its own row movement. Both backends hold the
same router, ``jax_ep.routing.XlaRouter`` (XLA's all_to_all); a transport
whose metadata exchange should run natively supplies another router.
"""
from __future__ import annotations

import logging
from typing import Optional, Protocol

import jax

from .config import EpConfig
from .types import Handle


class Router(Protocol):
    """The routing half of a backend (metadata and weights, a few bytes per token)."""

    def route(self, topk_idx: jax.Array, cfg: EpConfig, R: int):
        """Exchange routing metadata. -> (handle, group_sizes [L] i32 or None,
        num_valid i32[], num_dropped i32[])."""

    def dispatch_weights(self, topk_weights: jax.Array, handle: Handle, cfg: EpConfig):
        """``[T, K]`` f32 -> ``[C]`` (expert_major: weight of each row's pair) or
        ``[C, K]`` (rank_major: weights of this rank's slots, 0 elsewhere)."""

    def return_weights(self, d_recv_w: jax.Array, handle: Handle, cfg: EpConfig):
        """Transpose of ``dispatch_weights``: ``[C]`` or ``[C, K]`` -> ``[T, K]`` f32."""


class Backend(Protocol):
    name: str
    router: Router   # routing metadata and weights (shared code, held, not inherited)

    def layout(self, topk_idx: jax.Array, cfg: EpConfig, R: int):
        """-> (num_tokens_per_rank [R] i32, num_tokens_per_expert [E] i32,
        is_token_in_rank [T, R] bool). Counts are over this rank's tokens;
        invalid ids (outside [0, E)) count nowhere; a token counts once per rank."""

    def dispatch_rows(self, x: jax.Array, x_scales: Optional[jax.Array], handle: Handle,
                      cfg: EpConfig):
        """Pure data movement of per-token rows ``x [T, W]`` (any dtype, any W)
        into the output layout -> (recv ``[C, W]``, recv_scales ``[C, H/128]``
        or None). Rows past the last group (the tail) may be left unwritten unless
        ``cfg.zero_tail``; padding rows inside groups are zero. Bit-exact."""

    def dispatch_rows_fp8(self, x: jax.Array, handle: Handle, cfg: EpConfig):
        """bf16/f32 ``x [T, H]`` -> (fp8 ``[C, H]``, f32 scales ``[C, H/128]``),
        bit-identical to ``dispatch_rows(*reference.fp8_cast(x))``."""

    def combine_rows(self, y: jax.Array, row_weights: Optional[jax.Array], handle: Handle,
                     cfg: EpConfig):
        """``y [C, W]`` -> ``[T, W]`` in y's dtype.

        Expert side: for every received (source s, token t), the partial
        ``p = sum_k w_row * f32(y[row_k])`` over the slots k (ascending) stored
        on this rank (expert_major; ``w_row = 1`` when row_weights is None),
        or ``p = f32(y[row])`` (rank_major). p is cast to y's dtype and sent
        back; the source sums the partials of ranks 0..R-1 in that order in
        f32 and casts to y's dtype."""

    def combine_backward(self, g: jax.Array, y: jax.Array, row_weights: Optional[jax.Array],
                         handle: Handle, cfg: EpConfig):
        """Backward of ``combine_rows(y, row_weights)`` for ``g = d_out [T, W]`` (y's
        dtype) -> ``(dy [C, W] in y's dtype, dw [C] f32 or None)``: with ``g_rows``
        the dispatch of ``g``, ``dy = cast(w * f32(g_rows))`` (bit-identical across
        backends) and ``dw = sum_h f32(g_rows) * f32(y)`` (f32, equal up to
        reduction order). Without weights (rank_major): ``dy`` = dispatch of ``g``,
        ``dw`` None. Padding rows 0; tail rows of ``dy`` as in ``dispatch_rows``."""


_notice_printed = False
_log = logging.getLogger("jax_ep")


def select(cfg: EpConfig) -> Backend:
    """Pick the backend for ``cfg.backend``; ``auto`` = native when initialised."""
    global _notice_printed
    from . import reference

    if cfg.backend == "reference":
        return reference.BACKEND
    from . import runtime

    if cfg.backend == "native":
        return runtime.native_backend()  # raises with a clear message if not initialised
    if runtime.is_initialized():
        return runtime.native_backend()
    # Without the extension "auto" is the reference, silently; with it, one
    # line says the runtime is down and why.
    if runtime.extension_available() and not _notice_printed:
        _notice_printed = True
        _log.warning("jax_ep: native runtime not initialised (%s); using the reference backend",
                     runtime.unavailable_reason())
    return reference.BACKEND
