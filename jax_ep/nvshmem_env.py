"""The NVSHMEM environment ``jax_ep.initialize`` sets before NVSHMEM starts.

NVSHMEM reads these variables once, at init. What the user set wins, except
that the symmetric heap must hold jax_ep's buffer. The network variables
follow the job's hosts (``hosts.network_env``); a value this module set
earlier is not mistaken for the user's on a later ``initialize``.
"""
from __future__ import annotations

import os
from typing import Optional

HEAP_GRANULE = 512 << 20       # NVSHMEM grows its heap in 512 MiB granules
HEAP_SLACK = 128 << 20         # NVSHMEM's own allocations from the heap
NET_VARS = ("NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA")

USER_HEAP = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")  # as set before jax_ep came in
_set_here: dict = {}   # network variables set here (and their values)


def parse_size(v: Optional[str]) -> int:
    """NVSHMEM size syntax: bytes with an optional K/M/G/T suffix; 0 if unset/bad."""
    if not v:
        return 0
    v = v.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(v[-1:], 1)
    try:
        return int(float(v.rstrip("KMGT")) * mult)
    except ValueError:
        return 0


def set_heap(heap_bytes: int) -> None:
    """``NVSHMEM_SYMMETRIC_SIZE`` large enough for ``heap_bytes`` (whole granules,
    plus NVSHMEM's own share), never below the user's; NVLink multicast off
    unless the user chose."""
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    need = -(-(heap_bytes + HEAP_SLACK) // HEAP_GRANULE) * HEAP_GRANULE
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(max(need, parse_size(USER_HEAP)))


def user_network() -> dict:
    """NVSHMEM's network variables as the user set them: a value still equal to
    what an earlier initialize set counts as unset."""
    return {k: None if (k in _set_here and os.environ.get(k) == _set_here[k])
            else os.environ.get(k) for k in NET_VARS}


def apply_network(env: dict, user: dict) -> None:
    """Set ``env`` (hosts.network_env; None: unset) where the user set nothing."""
    for k, v in env.items():
        if user.get(k) is not None:
            continue
        _set_here.pop(k, None)
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = _set_here[k] = v


def keep_nvshmem() -> bool:
    """``JAX_EP_KEEP_NVSHMEM=1``: ``finalize`` frees the buffer but leaves NVSHMEM up."""
    return os.environ.get("JAX_EP_KEEP_NVSHMEM", "0") == "1"
