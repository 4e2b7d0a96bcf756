"""The backend interfaces, the kernel families, and backend selection.

Four kernel families, each with a reference and a native backend:

- ``intranode``: normal mode inside one NVLink domain (``jax_ep/intranode/``);
- ``internode``: normal mode across nodes, hierarchical (``jax_ep/internode/``);
  its reference is intranode's (the semantics are one);
- ``low_latency``: decode (``jax_ep/low_latency/``);
- ``ragged``: ``ragged_all_to_all``, lax's op (``jax_ep/ragged/``).

:func:`select` picks the backend of a family one way for all four:
``EpConfig.backend`` ``"reference"``; ``"native"`` (raising why it cannot run
here); ``"auto"``: native when it can run here (:meth:`Backend.unavailable`
is None), else the reference, with a one-line notice when the extension is
built but the runtime is down. ``cfg`` is the family's config (the ragged
family: the call's ``RaggedCall``, whose ``backend`` is its config's).
Normal mode's family is :func:`normal_family`.

All row methods run per rank inside ``jax.shard_map`` over ``cfg.axis_name``
and see per-rank shapes. ``R`` = size of the EP axis, ``T`` = tokens per rank,
``C`` = capacity (``cfg.capacity_for(R, T)``).

The normal-mode split keeps the differentiation rules in one place
(``jax_ep.api``): dispatch = ``route`` + ``dispatch_rows`` (+
``dispatch_weights``); combine = ``combine_rows``; the backward of dispatch is
``combine_rows`` without weights plus ``return_weights``; the backward of
combine is ``combine_backward`` (a dispatch of the output cotangent, weighted
on the expert side, plus the weights' gradient). A normal-mode backend holds
a :class:`Router` (``backend.router``: the routing metadata and the weights);
every one holds ``jax_ep.routing.XlaRouter`` (XLA's all_to_all).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Protocol

import jax

from . import extension, runtime
from .config import EpConfig
from .internode import native as internode_native
from .intranode import native as intranode_native
from .intranode import reference as intranode_reference
from .low_latency import native as low_latency_native
from .low_latency import reference as low_latency_reference
from .low_latency.types import LowLatencyHandle, LowLatencyPending
from .ragged import native as ragged_native
from .ragged import reference as ragged_reference
from .ragged.config import RaggedCall
from .types import Handle


class Backend(Protocol):
    """What selection asks of every backend of every family."""

    name: str   # "reference" | "native"

    def unavailable(self, cfg: EpConfig) -> Optional[Exception]:
        """None when ``cfg`` can run on this backend here (the reference: always),
        else the error a call with ``backend="native"`` raises."""


class Router(Protocol):
    """The routing half of a normal-mode backend (metadata and weights, a few
    bytes per token)."""

    def route(self, topk_idx: jax.Array, cfg: EpConfig, R: int):
        """Exchange routing metadata. -> (handle, group_sizes [L] i32 or None,
        num_valid i32[], num_dropped i32[])."""

    def dispatch_weights(self, topk_weights: jax.Array, handle: Handle, cfg: EpConfig):
        """``[T, K]`` f32 -> ``[C]`` (expert_major: weight of each row's pair) or
        ``[C, K]`` (rank_major: weights of this rank's slots, 0 elsewhere)."""

    def return_weights(self, d_recv_w: jax.Array, handle: Handle, cfg: EpConfig):
        """Transpose of ``dispatch_weights``: ``[C]`` or ``[C, K]`` -> ``[T, K]`` f32."""


class RowBackend(Backend, Protocol):
    """A normal-mode backend (intranode and internode families)."""

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
        bit-identical to ``dispatch_rows(*fp8_cast(x))``."""

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


class LowLatencyBackend(Backend, Protocol):
    """A low-latency backend: each op as a send half and a receive half."""

    def dispatch_send(self, x: jax.Array, idx: jax.Array, slot: jax.Array,
                      per_expert: jax.Array, cfg: EpConfig, R: int, fp8: bool,
                      scale_format: str, after=None) -> LowLatencyPending:
        """``x [T, H]``, ``idx`` / ``slot [T, K]`` int32, tokens per expert
        ``per_expert [E]`` -> the pending dispatch."""

    def dispatch_recv(self, pending: LowLatencyPending):
        """-> ``LowLatencyDispatched`` (``x [L, R * Tmax, H]``, ...)."""

    def combine_send(self, y: jax.Array, idx: jax.Array, w: jax.Array,
                     handle: LowLatencyHandle, cfg: EpConfig, R: int,
                     after=None) -> LowLatencyPending:
        """``y [L, R * Tmax, H]``, merged weights ``w [T, K]`` f32 -> the pending combine."""

    def combine_recv(self, pending: LowLatencyPending) -> jax.Array:
        """-> ``[T, H]`` in y's dtype."""


class RaggedBackend(Backend, Protocol):
    """A ragged all-to-all backend (``jax_ep.ragged_all_to_all``); ``unavailable``
    takes the call's :class:`jax_ep.ragged.config.RaggedCall`."""

    def ragged_all_to_all(self, operand: jax.Array, output: jax.Array,
                          input_offsets: jax.Array, send_sizes: jax.Array,
                          output_offsets: jax.Array, recv_sizes: jax.Array,
                          call: RaggedCall) -> jax.Array:
        """``operand [N, ...]``, ``output [M, ...]``, int32 ``[K]`` offsets and
        sizes (K = R * S), all varying over the axis -> ``[M, ...]``: ``output``
        with the received slices written (docs/ragged.md). Bit-exact."""


@dataclasses.dataclass(frozen=True)
class Family:
    """A kernel family's two backends."""

    name: str
    reference: Backend
    native: Backend


INTRANODE = Family("intranode", intranode_reference.BACKEND, intranode_native.BACKEND)
INTERNODE = Family("internode", intranode_reference.BACKEND, internode_native.BACKEND)
LOW_LATENCY = Family("low_latency", low_latency_reference.BACKEND, low_latency_native.BACKEND)
RAGGED = Family("ragged", ragged_reference.BACKEND, ragged_native.BACKEND)
FAMILIES = (INTRANODE, INTERNODE, LOW_LATENCY, RAGGED)

_notice_printed = False
_log = logging.getLogger("jax_ep")


def _fallback_notice() -> None:
    """Without the extension "auto" is the reference, silently; with it and the
    runtime down, one line (once per process) says so and why."""
    global _notice_printed
    if runtime.is_initialized() or _notice_printed or not extension.available():
        return
    _notice_printed = True
    _log.warning("jax_ep: native runtime not initialised (%s); using the reference backend",
                 runtime.unavailable_reason())


def select(family: Family, cfg: EpConfig) -> Backend:
    """The backend of ``family`` for ``cfg.backend`` (see the module docstring)."""
    if cfg.backend == "reference":
        return family.reference
    why = family.native.unavailable(cfg)
    if why is None:
        return family.native
    if cfg.backend == "native":
        raise why
    _fallback_notice()
    return family.reference


def normal_family(cfg: EpConfig, R: int) -> Family:
    """Normal mode's family for an EP group of R ranks: internode when it has
    several nodes (``internode.native.nodes_of``: ``num_nodes > 1``, or one
    node per host where the group spans hosts), else intranode."""
    return INTERNODE if internode_native.nodes_of(cfg, R) > 1 else INTRANODE


def sent_by(family: Family, pending: LowLatencyPending) -> Backend:
    """The backend whose send half made ``pending`` (native sends leave a token)."""
    return family.reference if pending.token is None else family.native
