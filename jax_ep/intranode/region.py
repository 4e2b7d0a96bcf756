"""The intranode kernels' buffer: bounded staging rings, sized by the extension.

Staging is a ring per (peer, block) for dispatch and for combine, each
double-buffered by call parity; rows sized for f32 (the widest row dtype),
plus the control words. The rings wrap, so the buffer is at most the 1 GiB
default whatever T and R (smaller when a ring that never wraps fits in
less). The sizes come from ``cc/low_latency/region_layout.h`` through the extension, the
one source of them.
"""
from __future__ import annotations

from .. import extension
from ..config import EpConfig
from ..region import Region

DEFAULT_BYTES = 1 << 30   # per process, when no config says otherwise


def buffer_bytes(config: EpConfig, num_ranks: int) -> int:
    """The buffer the intranode kernels need for ``config`` on an EP group of
    ``num_ranks``; ``config.buffer_bytes`` overrides it. Needs ``jax_ep._C``."""
    if config.buffer_bytes is not None:
        return config.buffer_bytes
    C = extension.require("jax_ep.intranode.region.buffer_bytes")
    H = config.hidden
    return int(C.symmetric_buffer_bytes(num_ranks, config.max_tokens_per_rank, H * 4,
                                        (H // 128) * 4))


def plan(configs, num_ranks: int, nbytes=None) -> Region:
    """The region for ``initialize``: ``nbytes`` when given, else the largest
    :func:`buffer_bytes` of ``configs``, else :data:`DEFAULT_BYTES`."""
    if nbytes is None and configs:
        nbytes = max(buffer_bytes(c, num_ranks) for c in configs)
    nbytes = DEFAULT_BYTES if nbytes is None else int(nbytes)
    if nbytes < 1:
        raise ValueError(f"jax_ep.initialize: buffer_bytes must be positive, got {nbytes}")
    return Region("intranode", nbytes, nbytes)
