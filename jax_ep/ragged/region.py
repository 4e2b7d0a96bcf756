"""The ragged all-to-all's region, laid out for one capacity.

``jax_ep.initialize(ragged_bytes=B)`` lays out, on every GPU, two receive
areas of B bytes (one per call parity: a peer may send call e + 1 while this
rank still copies call e out), one staging area of B bytes (the rows this rank
sends by NVSHMEM puts, which read symmetric memory) and the control, flag and
slice words. A native call needs its ``operand`` and its ``output`` (per rank)
to fit in B bytes each. The size comes from the extension
(``ragged_region_size``), the one source of it.
"""
from __future__ import annotations

import operator

from .. import extension
from ..region import Region, check_live_shape

NONE = (0, 0, 0, 0)   # the region shape of no region
KIB = 1024            # the shape counts the areas' bytes in KiB (an int32 each)


def shape_of(ragged_bytes) -> tuple:
    """The extension's region shape for ``ragged_bytes`` (None or 0: no region):
    (area KiB, 0, 0, 0)."""
    if ragged_bytes is None:
        return NONE
    try:
        n = operator.index(ragged_bytes)
    except TypeError:
        n = -1
    if isinstance(ragged_bytes, bool) or n < 0:
        raise ValueError(f"jax_ep.initialize: ragged_bytes must be a non-negative int (bytes of "
                         f"the largest operand or output of a native ragged_all_to_all, per "
                         f"rank) or None, got {ragged_bytes!r}")
    kib = -(-n // KIB)
    if kib >= 2**31:
        raise ValueError(f"jax_ep.initialize: ragged_bytes={n} is too large (at most "
                         f"{(2**31 - 1) * KIB})")
    return (kib, 0, 0, 0)


def capacity(shape) -> int:
    """Bytes of each area of a region of ``shape`` (the largest operand or output)."""
    return int(shape[0]) * KIB


def region_bytes(ragged_bytes) -> int:
    """Bytes ``initialize(ragged_bytes=...)`` adds to each GPU's buffer: three
    areas of ``ragged_bytes`` (rounded up to KiB) plus a few KiB of words."""
    C = extension.require("jax_ep.ragged_region_bytes")
    return int(C.ragged_region_size(shape_of(ragged_bytes)))


def plan(C, ragged_bytes) -> Region:
    """The region for ``initialize(ragged_bytes=...)`` (extension ``C``)."""
    shape = shape_of(ragged_bytes)
    return Region("ragged", shape, int(C.ragged_region_size(shape)) if shape != NONE else 0)


def check_live(live_shape: tuple, ragged_bytes) -> None:
    """A later ``initialize(ragged_bytes=...)`` on a live runtime must ask for
    the region it has (or None)."""
    check_live_shape(f"ragged_bytes={ragged_bytes}", ragged_bytes, shape_of(ragged_bytes),
                     live_shape, f"a ragged region of {capacity(live_shape)} bytes per area "
                     "(0: none)")
