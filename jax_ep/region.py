"""A region of each GPU's buffer, as a kernel family asks for it.

Each kernel family sizes its own region (``jax_ep/<family>/region.py``);
``jax_ep.runtime`` keeps the list, lays the regions out one after another
(each starting 256-aligned) and hands them to the extension.
"""
from __future__ import annotations

import dataclasses

ALIGN = 256   # the extension starts every region at a multiple of this


@dataclasses.dataclass(frozen=True)
class Region:
    """Attributes:
      family: the kernel family that uses it (``"intranode"``, ``"low_latency"``,
        ``"internode"``).
      attach_arg: what the extension's ``runtime_attach`` / ``peer_memory_attach``
        take for it: bytes (intranode) or a shape tuple (zeros: no region).
      nbytes: its size per GPU (0: none).
    """

    family: str
    attach_arg: object
    nbytes: int


def heap_bytes(regions) -> int:
    """Bytes of the regions laid out one after another, each ``ALIGN``-aligned."""
    return sum(r.nbytes for r in regions) + ALIGN * (len(regions) - 1)


def check_live_shape(option: str, asked, want: tuple, live: tuple, have: str) -> None:
    """Raise unless a later ``initialize(option=asked)`` on a live runtime leaves
    the region as it is (``asked`` None) or asks for the shape ``want`` equal to
    the live one, ``live``: a region is laid out once. ``have``: the live
    region in the user's words."""
    if asked is not None and tuple(want) != tuple(live):
        raise ValueError(f"jax_ep.initialize({option}): the runtime is already up with {have}; "
                         f"this call asks for {tuple(want)}. Call jax_ep.finalize() first")
