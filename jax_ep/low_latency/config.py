"""The low-latency family's configuration: the fields its ops read.

:class:`LowLatencyConfig` is what ``low_latency_*`` and
``initialize(low_latency=...)`` run on; they take an :class:`EpConfig` too
(:func:`of` keeps the fields low latency reads). The fp8 choice and its
scale format are per call (``fp8=``, ``scale_format=``): one decode step may
dispatch fp8 and another bf16 on the same region.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..config import (BACKENDS, LL_TRANSPORTS, EpConfig, KernelTuning, local_experts, one_of,
                      positive_int)


@dataclasses.dataclass(frozen=True)
class LowLatencyConfig:
    """Static description of a low-latency (decode) EP group. Frozen and hashable.

    Attributes:
      num_experts: E, experts of the group (divisible by the size R of ``axis_name``).
      topk: K, experts per token.
      max_tokens_per_rank: Tmax, the most tokens a rank sends per call (the
        region and the output ``[L, R * Tmax, H]`` are laid out for it).
      hidden: H.
      axis_name: the mesh axis of the EP group.
      backend: ``"auto"`` (native when the live runtime has a low-latency region
        for this (E, Tmax, K, H)), ``"reference"`` or ``"native"``.
      num_sms: SMs the kernels may occupy (None: every SM).
      ll_transport: how the native kernels reach each rank: ``"auto"`` (P2P
        stores where NVSHMEM maps the peer, puts elsewhere), ``"p2p"`` or
        ``"put"`` (needs the NVSHMEM symmetric heap).
      tuning: :class:`KernelTuning`; low latency reads ``fp8_ieee_division`` and
        ``peer_timeout_s`` (how long a receive waits for a peer rank).
    """

    num_experts: int
    topk: int
    max_tokens_per_rank: int
    hidden: int
    axis_name: str = "ep"
    backend: str = "auto"
    num_sms: Optional[int] = None
    ll_transport: str = "auto"
    tuning: KernelTuning = KernelTuning()

    def __post_init__(self):
        for name in ("num_experts", "topk", "max_tokens_per_rank", "hidden"):
            positive_int(self, name, getattr(self, name))
        if self.num_sms is not None:
            positive_int(self, "num_sms", self.num_sms)
        if self.topk > self.num_experts:
            raise ValueError(f"LowLatencyConfig.topk ({self.topk}) must not exceed num_experts "
                             f"({self.num_experts})")
        if not isinstance(self.axis_name, str):
            raise TypeError(f"LowLatencyConfig.axis_name must be a str, got {self.axis_name!r}")
        one_of(self, "backend", BACKENDS)
        one_of(self, "ll_transport", LL_TRANSPORTS)
        if not isinstance(self.tuning, KernelTuning):
            raise TypeError(f"LowLatencyConfig.tuning must be a jax_ep.KernelTuning, got "
                            f"{self.tuning!r}")

    @property
    def shape(self) -> tuple:
        """(E, Tmax, K, H): what the region is laid out for."""
        return (self.num_experts, self.max_tokens_per_rank, self.topk, self.hidden)

    def local_experts(self, num_ranks: int) -> int:
        """L = E / R, checked."""
        return local_experts(self, num_ranks)


def of(config) -> LowLatencyConfig:
    """``config`` as a :class:`LowLatencyConfig` (an :class:`EpConfig`'s fields
    that low latency reads; its layout, capacity, fp8 and internode fields
    play no part)."""
    if isinstance(config, LowLatencyConfig):
        return config
    if isinstance(config, EpConfig):
        return LowLatencyConfig(
            num_experts=config.num_experts, topk=config.topk,
            max_tokens_per_rank=config.max_tokens_per_rank, hidden=config.hidden,
            axis_name=config.axis_name, backend=config.backend, num_sms=config.num_sms,
            ll_transport=config.ll_transport, tuning=config.tuning)
    raise TypeError(f"jax_ep low-latency mode: config must be a LowLatencyConfig or an EpConfig, "
                    f"got {type(config).__name__}")
