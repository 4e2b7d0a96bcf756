"""The ragged all-to-all's configuration and the facts of one call.

:class:`RaggedConfig` holds the knobs a user may set (all optional);
:class:`RaggedCall` adds what one call's shapes say, which backend
selection (``jax_ep.backend.select``) and the native glue read.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import numpy as np

from ..config import BACKENDS, LL_TRANSPORTS, one_of, peer_timeout


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    """Knobs of :func:`jax_ep.ragged_all_to_all`. Frozen and hashable.

    Attributes:
      backend: ``"auto"`` (native when the runtime is up with a ragged region
        that fits the call, else the reference), ``"reference"`` (pure JAX) or
        ``"native"`` (raises, naming why, when it cannot run).
      transport: how the native kernel reaches each rank: ``"auto"`` (P2P
        stores where NVSHMEM maps the peer, NVSHMEM puts where not), ``"p2p"``
        or ``"put"`` (puts to every rank; needs the NVSHMEM symmetric heap).
      num_sms: SMs the native kernel may occupy (None: every SM).
      peer_timeout_s: seconds the native kernel's receive phase waits for a
        sender's signal before it gives up (a peer that never arrives becomes
        an error, not a hang): the next native call of the process (or
        ``jax_ep.check_device_error()``) then raises an error saying a kernel
        timed out waiting for a peer rank, and the job must restart. Every
        rank must reach the call within this time of the first: raise it
        (e.g. to 100) when the hosts of a multi-host job reach their first
        call far apart (compilation or loading skew). A finite number > 0,
        the kernel's ``timeout_ns`` attribute; as
        :attr:`jax_ep.KernelTuning.peer_timeout_s` for the other families.
    """

    backend: str = "auto"
    transport: str = "auto"
    num_sms: Optional[int] = None
    peer_timeout_s: float = 10.0

    def __post_init__(self):
        one_of(self, "backend", BACKENDS)
        one_of(self, "transport", LL_TRANSPORTS)
        if self.num_sms is not None:
            try:
                n = operator.index(self.num_sms)
            except TypeError:
                n = 0
            if isinstance(self.num_sms, (bool, np.bool_)) or n < 1:
                raise ValueError(f"RaggedConfig.num_sms must be a positive int or None, got "
                                 f"{self.num_sms!r}")
            object.__setattr__(self, "num_sms", int(n))
        peer_timeout(self)


@dataclasses.dataclass(frozen=True)
class RaggedCall:
    """One call's static facts, per rank.

    Attributes:
      config: the :class:`RaggedConfig`.
      axis_name: the mesh axis of the exchange.
      groups: ``axis_index_groups`` as a tuple of tuples (None: the whole axis).
      num_ranks: R, ranks of one group.
      slices: S = K / R, slices sent to each rank (K: length of the offset arrays).
      in_rows, out_rows: N and M, leading sizes of ``operand`` and ``output``.
      row_bytes: bytes of one row (every dimension after the first); None for
        sub-byte dtypes.
    """

    config: RaggedConfig
    axis_name: str
    groups: Optional[tuple]
    num_ranks: int
    slices: int
    in_rows: int
    out_rows: int
    row_bytes: Optional[int]

    @property
    def backend(self) -> str:   # what jax_ep.backend.select reads
        return self.config.backend

    @property
    def in_bytes(self) -> int:
        return self.in_rows * (self.row_bytes or 0)

    @property
    def out_bytes(self) -> int:
        return self.out_rows * (self.row_bytes or 0)
