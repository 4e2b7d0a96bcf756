"""Typed tile configurations, one per kernel family (forward/dx and dw).

Frozen and hashable: they are static arguments of the kernels and keys of the
one-time compile check. Only the shape of a config is checked here; whether a
kernel can run it is the registry's question (``registry.Variant.check``), so
an unusable config reaches "auto" as a reason to use XLA, not as an error.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence, Type, TypeVar, Union


@dataclasses.dataclass(frozen=True)
class _Tiles:
    block_m: int
    block_n: int
    block_k: int
    stages: int    # shared-memory pipeline stages (the pipeline's max_concurrent_steps)
    band: int      # row tiles swept together per column tile (L2 reuse); fwd/dx 0: by group

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or int(v) != v:
                raise ValueError(f"{type(self).__name__}.{f.name} must be an int, got {v!r}")
            object.__setattr__(self, f.name, int(v))

    def astuple(self):
        return dataclasses.astuple(self)


@dataclasses.dataclass(frozen=True)
class FwdTiles(_Tiles):
    """Forward and dx (``x @ w[g]``, ``dy @ w[g]^T``): a ``block_m x block_n``
    output tile (the 2-consumer kernel's CTA owns ``block_m x 2 block_n``),
    ``block_k`` of the contraction per stage; ``band``: row tiles per column tile
    (0: a group's row tiles, the group order)."""


@dataclasses.dataclass(frozen=True)
class DwTiles(_Tiles):
    """dw (``x[g]^T @ dy[g]``): a ``block_m x block_n`` tile of ``dw[g]`` (the
    2-consumer kernel's CTA owns ``2 block_m x block_n``), ``block_k`` ragged
    rows per k-step; ``band``: row tiles of ``dw[g]`` per column tile."""


T = TypeVar("T", bound=_Tiles)


def as_tiles(cls: Type[T], value: Union[_Tiles, Sequence[int]]) -> T:
    """``value`` as a ``cls``: a tile config of either family, or the
    positional ``(block_m, block_n, block_k, stages, band)`` the config accepts."""
    if isinstance(value, cls):
        return value
    t = value.astuple() if isinstance(value, _Tiles) else tuple(value)
    if len(t) != 5:
        raise ValueError(f"tiles must be (block_m, block_n, block_k, stages, band), got {t}")
    return cls(*t)
