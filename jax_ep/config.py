"""The configuration of an EP group: :class:`EpConfig` and :class:`KernelTuning`.

Pure data and checks; each kernel family sizes its buffer region from it in
``jax_ep/<family>/region.py``.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Literal, Optional

import numpy as np

from . import abi

# Scales of the fp8 cast (jax_ep.fp8_cast): "f32" amax / 448, or "ue8m0"
# powers of two (an exact cast).
FP8_SCALE_FORMATS = ("f32", "ue8m0")

Layout = Literal["expert_major", "rank_major"]
Backend = Literal["auto", "reference", "native"]

_LAYOUTS = ("expert_major", "rank_major")
BACKENDS = ("auto", "reference", "native")
# How the native low-latency kernels reach each rank (abi.LL_TRANSPORTS).
LL_TRANSPORTS = tuple(abi.LL_TRANSPORTS)
# How the internode kernels' network leg reaches each rank (abi.NET_TRANSPORTS).
NET_TRANSPORTS = tuple(abi.NET_TRANSPORTS)


def one_of(obj, name: str, choices) -> None:
    """Raise, naming the field and the choices, unless field ``name`` of ``obj``
    is one of ``choices``."""
    v = getattr(obj, name)
    if v not in choices:
        raise ValueError(f"{type(obj).__name__}.{name} must be one of {choices}, got {v!r}")


def local_experts(cfg, num_ranks: int) -> int:
    """L = E / R of a config with ``num_experts`` and ``axis_name``, checked."""
    if cfg.num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts ({cfg.num_experts}) must be divisible by the size of "
            f"axis {cfg.axis_name!r} ({num_ranks})")
    return cfg.num_experts // num_ranks


def positive_int(obj, name: str, v) -> None:
    """Set frozen dataclass field ``name`` of ``obj`` to ``v`` as a plain int
    (ints and NumPy integers; not floats or bools), or raise naming it."""
    try:
        iv = operator.index(v)
    except TypeError:
        iv = None
    if iv is None or isinstance(v, (bool, np.bool_)) or iv < 1:
        raise ValueError(f"{type(obj).__name__}.{name} must be a positive int, got {v!r}")
    object.__setattr__(obj, name, int(iv))  # keep the config hashable and plain


# The largest peer_timeout_s: its nanoseconds (the kernels' int64 timeout_ns
# attribute, jax_ep/ffi_attrs.py timeout_ns) must fit an int64 (~292 years).
MAX_PEER_TIMEOUT_S = float((2**63 - 1) // 10**9)


def peer_timeout(obj, name: str = "peer_timeout_s") -> None:
    """Set frozen dataclass field ``name`` of ``obj`` (seconds a native kernel
    waits for a peer rank) to a plain float, or raise naming it: a finite
    number > 0 (not a bool), at most :data:`MAX_PEER_TIMEOUT_S`."""
    v = getattr(obj, name)
    number = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
        v, (bool, np.bool_))
    f = float(v) if number else math.nan
    if not (math.isfinite(f) and 0 < f <= MAX_PEER_TIMEOUT_S):
        raise ValueError(
            f"{type(obj).__name__}.{name} must be a finite number of seconds > 0 (how long a "
            f"native kernel waits for a peer rank before it gives up; at most "
            f"{MAX_PEER_TIMEOUT_S:.0f}), got {v!r}")
    object.__setattr__(obj, name, f)  # keep the config hashable and plain


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Tuning knobs of the native dispatch / combine kernels, passed to them as
    FFI attributes (never read from the environment). The chunk and division
    defaults are the measured best (bench/results); every rank of an EP group
    must use the same values, which holds as they come from the one ``EpConfig``.

    Attributes:
      dispatch_chunk: tokens per flag of the dispatch kernels (dispatch, fp8
        dispatch, the combine backward); 0 = the kernel default (one token per
        sender warp, 8, fewer when T is small).
      combine_chunk: tokens per flag of the combine kernel; 0 = the kernel
        default (4, fewer when T is small).
      fp8_ieee_division: the fp8 cast computes 448/amax with IEEE
        round-to-nearest division instead of rounding it as XLA:GPU's f32
        division does (the default, bit-identical to ``jax_ep.fp8_cast``
        compiled by XLA:GPU).
      peer_timeout_s: seconds a native communication kernel (dispatch,
        combine, the combine backward, the internode kernels and the
        low-latency receives) waits for a peer rank's signal before it gives
        up, so a peer that never arrives becomes an error instead of a hang:
        the kernel stops waiting and the next native call of the process (or
        ``jax_ep.check_device_error()``) raises an error saying a kernel
        timed out waiting for a peer rank; the results since are invalid and
        the job must restart. A rank's wait starts with its kernel, so every
        rank must reach the call within this time of the first one: raise it
        (e.g. to 100) when the ranks of a multi-host job reach their first
        call far apart (compilation or loading that takes longer on some
        hosts), or lower it to find a lost peer sooner. A finite number > 0,
        passed to the kernels as the ``timeout_ns`` attribute (nanoseconds).
    """

    dispatch_chunk: int = 0
    combine_chunk: int = 0
    fp8_ieee_division: bool = False
    peer_timeout_s: float = 10.0

    def __post_init__(self):
        for name in ("dispatch_chunk", "combine_chunk"):
            v = getattr(self, name)
            try:
                iv = operator.index(v)
            except TypeError:
                iv = None
            if iv is None or isinstance(v, (bool, np.bool_)) or not 0 <= iv < 2**31:
                raise ValueError(
                    f"KernelTuning.{name} must be a non-negative int (0: the default), got {v!r}")
            object.__setattr__(self, name, int(iv))
        if not isinstance(self.fp8_ieee_division, (bool, np.bool_)):
            raise TypeError(
                f"KernelTuning.fp8_ieee_division must be a bool, got {self.fp8_ieee_division!r}")
        object.__setattr__(self, "fp8_ieee_division", bool(self.fp8_ieee_division))
        peer_timeout(self)


@dataclasses.dataclass(frozen=True)
class EpConfig:
    """Static description of one expert-parallel (EP) group and its buffers.

    Frozen and hashable, so it can be closed over by ``jax.jit`` and passed as a
    static argument.

    Attributes:
      num_experts: E, total routed experts. Must be divisible by the size R of
        ``axis_name``; rank r holds experts ``[r*L, (r+1)*L)`` with ``L = E // R``.
      topk: K, experts picked per token.
      max_tokens_per_rank: static upper bound on T, the tokens each rank passes
        to ``dispatch``; ``jax_ep.initialize(config=...)`` sizes the native
        buffer from it.
      hidden: H, the model width (row length of ``x``).
      axis_name: the mesh axis that forms the EP group (may be one axis of a
        larger mesh, e.g. ``('data', 'ep')``).
      layout: ``"expert_major"`` (rows grouped by local expert, feeds
        ``jax.lax.ragged_dot``) or ``"rank_major"`` (DeepEP-compatible, one row
        per (source token, this rank)).
      expert_alignment: each expert group starts at a multiple of this
        (expert_major only).
      capacity: C, static rows of the dispatch output. ``None`` = the worst
        case, so nothing is ever dropped.
      num_sms: SMs the native communication kernels may occupy (``None``: a
        default chosen from the device).
      backend: ``"auto"`` (native when the runtime is initialised, reference
        otherwise), ``"reference"`` (pure JAX) or ``"native"``.
      fp8_dispatch: cast a bf16/f32 ``x`` to fp8-e4m3 with per-token
        per-128-channel f32 scales before sending (H % 128 == 0).
      fp8_scale_format: the scales of that cast: ``"f32"`` (``amax / 448``)
        or ``"ue8m0"`` (powers of two: an exact cast, the same bits on every
        platform; in the native cast kernel too: bit-identical to the
        reference's cast in the one-GPU loopback harness and through JAX with
        2, 4 and 8 processes sharing one GPU, tests/gpu/test_native_dispatch.py).
      check_overflow: raise ``OverflowError`` when any rank drops a pair
        (capacity overflow or an expert id outside ``[-1, E)``) instead of
        only reporting ``num_dropped``. The drop count is summed over every
        device of the mesh first, so all of them raise together before any
        row moves (no rank is left waiting); a ``jax.pure_callback``, so it
        works under ``jit`` and ``jax.checkpoint``. The error reaches Python
        as a ``JaxRuntimeError`` whose last line is the ``OverflowError``.
      zero_tail: write zeros to the rows of the dispatch output past the
        last expert group (expert_major: rows >= sum(group_sizes); rank_major:
        rows >= num_valid). Off by default: those rows are unspecified (the
        native kernels leave them unwritten — at EP 2 dropless that is half of
        a [C, H] output, ~470 MB of HBM writes at V3-train). Padding rows
        inside groups (``expert_alignment`` > 1) are always zero.
        :func:`jax_ep.grouped_matmul` and :func:`jax_ep.combine` never read the
        tail; set True when your own code reads whole rows (e.g. a dense
        masked matmul over all C rows).
      buffer_bytes: NVSHMEM symmetric buffer per process that
        ``jax_ep.initialize(config=...)`` allocates (``None``: sized from the
        shapes above, ``jax_ep.intranode.region.buffer_bytes``).
      tuning: :class:`KernelTuning`, the native kernels' knobs (chunks and
        division: the measured best; the peer timeout; the reference backend
        ignores them).
      num_nodes: the EP group is ``num_nodes`` consecutive blocks of
        ``R / num_nodes`` ranks ("nodes": rank r is in node ``r // (R /
        num_nodes)``); R must be a multiple of it (checked at trace time).
        1 (the default): the intranode kernels, unless the EP group has more
        ranks than a host of the job has GPUs: then one node per host,
        chosen at trace time from the hosts ``jax_ep.initialize`` learnt
        (``jax_ep.hosts.auto_nodes``; each host's ranks contiguous along the
        axis, else a clear error at lowering). > 1: the native backend uses
        the hierarchical (internode) kernels, docs/internode.md: each token
        crosses the "network" once per destination node and is forwarded
        inside the node; combine sums each node's partials before the network
        leg (so bf16 results differ from the flat sum by one rounding per node
        partial). On one host ``num_nodes > 1`` *emulates* nodes (the network
        leg goes through the same P2P stores). Pass the config to
        ``jax_ep.initialize(config=...)`` so the buffer gets the internode
        region (it follows the hosts for ``num_nodes=1`` too). The reference
        backend ignores it (same semantics). Run through JAX with 2, 4 and 8
        processes sharing one GPU as emulated nodes
        (tests/gpu/test_native_internode.py) and with two launchers as two
        hosts on one machine (``scripts/gpu_check.sh`` REHEARSAL); not yet
        across physical hosts.
      ll_transport: how the native low-latency (decode) kernels reach each
        rank of the EP group: ``"auto"`` (P2P stores to the ranks whose memory
        NVSHMEM maps, over NVLink; NVSHMEM puts to the others, e.g. a PE
        across a network), ``"p2p"`` (stores only: every rank must be mapped)
        or ``"put"`` (NVSHMEM puts to every rank, this one included; needs
        the NVSHMEM transport). The normal-mode kernels ignore it.
      net_transport: how the internode kernels (``num_nodes > 1``) move rows
        across the network leg, between nodes (docs/internode.md, "Network
        leg transports"): ``"auto"`` (P2P stores to the network peers NVSHMEM
        maps, NVSHMEM put-with-signal to the others, e.g. a GPU of another
        host over IBGDA), ``"p2p"`` (stores only: every network peer must be
        mapped) or ``"put"`` (puts for the whole network leg, this rank
        included, even where mapped; needs the NVSHMEM transport: how emulated
        nodes test the put path). The NVLink leg inside a node is always P2P.
        A field of its own, not ``ll_transport``: the two kernel families
        reach different peers (every rank vs. the network leg's), and a test
        can force puts on one without the other.
      internode_bytes: bound on the internode region (``num_nodes > 1``) per
        GPU; None: 1 GiB (``jax_ep.internode.region``). The region is laid out
        for a window of W tokens, the most that fit (at most
        ``max_tokens_per_rank``); a call of more tokens runs as windows of W
        tokens, one kernel each (docs/internode.md, "Windows"), so the memory
        does not grow with T. At V3-train on 2 x 4 ranks (H 7168) 1 GiB holds
        W = 780 tokens: T 4096 runs as 6 windows. With several configs the
        smallest bound any of them sets wins (1 GiB when none sets one); a
        later ``initialize`` keeps the live region. ``initialize`` sizes it,
        like the normal buffer, for an EP group of every process: a job that
        spans hosts gets a region even when its EP groups stay inside a host
        (data parallel across hosts); a small bound (e.g. ``1 << 24``) keeps
        that unused region small.
    """

    num_experts: int
    topk: int
    max_tokens_per_rank: int
    hidden: int
    axis_name: str = "ep"
    layout: Layout = "expert_major"
    expert_alignment: int = 1
    capacity: Optional[int] = None
    num_sms: Optional[int] = None
    backend: Backend = "auto"
    fp8_dispatch: bool = False
    fp8_scale_format: str = "f32"
    check_overflow: bool = False
    buffer_bytes: Optional[int] = None
    zero_tail: bool = False
    tuning: KernelTuning = KernelTuning()
    num_nodes: int = 1
    ll_transport: str = "auto"
    net_transport: str = "auto"
    internode_bytes: Optional[int] = None

    def __post_init__(self):
        def pos_int(name, v):
            positive_int(self, name, v)

        for name in ("num_experts", "topk", "max_tokens_per_rank", "hidden", "expert_alignment",
                     "num_nodes"):
            pos_int(name, getattr(self, name))
        if self.topk > self.num_experts:
            raise ValueError(
                f"EpConfig.topk ({self.topk}) must not exceed num_experts ({self.num_experts})")
        one_of(self, "layout", _LAYOUTS)
        one_of(self, "backend", BACKENDS)
        if self.capacity is not None:
            pos_int("capacity", self.capacity)
        if self.num_sms is not None:
            pos_int("num_sms", self.num_sms)
        if self.buffer_bytes is not None:
            pos_int("buffer_bytes", self.buffer_bytes)
        if self.internode_bytes is not None:
            pos_int("internode_bytes", self.internode_bytes)
        if not isinstance(self.axis_name, str):
            raise TypeError(f"EpConfig.axis_name must be a str, got {self.axis_name!r}")
        if not isinstance(self.tuning, KernelTuning):
            raise TypeError(f"EpConfig.tuning must be a jax_ep.KernelTuning, got {self.tuning!r}")
        one_of(self, "fp8_scale_format", FP8_SCALE_FORMATS)
        one_of(self, "ll_transport", LL_TRANSPORTS)
        one_of(self, "net_transport", NET_TRANSPORTS)
        if self.fp8_dispatch and self.hidden % 128 != 0:
            raise ValueError(
                f"EpConfig.fp8_dispatch needs hidden % 128 == 0, got hidden={self.hidden}")

    def local_experts(self, num_ranks: int) -> int:
        """L = E / R, checked."""
        return local_experts(self, num_ranks)

    def ranks_per_node(self, num_ranks: int) -> int:
        """R / num_nodes, checked (R must split into num_nodes equal nodes)."""
        if num_ranks % self.num_nodes != 0:
            raise ValueError(
                f"EpConfig.num_nodes ({self.num_nodes}) must divide the size of axis "
                f"{self.axis_name!r} ({num_ranks}): the EP group is num_nodes consecutive "
                "blocks of equally many ranks")
        return num_ranks // self.num_nodes

    def capacity_for(self, num_ranks: int, num_tokens: int) -> int:
        """Static row count C of the dispatch output on each rank.

        Worst case (dropless): rank_major receives at most one row per
        (source rank, token): ``R*T``. expert_major receives at most
        ``min(K, L)`` rows per received token, plus up to ``align-1`` padding
        rows per local expert, rounded up to a multiple of the alignment.
        """
        if self.capacity is not None:
            return self.capacity
        L = self.local_experts(num_ranks)
        if self.layout == "rank_major":
            return max(1, num_ranks * num_tokens)
        a = self.expert_alignment
        rows = num_ranks * num_tokens * min(self.topk, L) + L * (a - 1)
        return max(a, -(-rows // a) * a)
