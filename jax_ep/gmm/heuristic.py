"""The one heuristic: which tuned tiles (and dw pipeline) an operation asks
for, by device kind and group size, and the fp8 path's choices by device kind
and contraction length (kernel family, CTA pairs, the CUDA forward's TMA tile
store). What a kernel can run is not decided here
(``registry``); the caller takes the first candidate its kernel supports."""
from __future__ import annotations

import dataclasses
from typing import Tuple

from .tuning import tuning_for


@dataclasses.dataclass(frozen=True)
class Suggestion:
    tiles: Tuple    # candidates, preferred first; the last is the device's default
    dw_pipeline: str


def small_groups(rows: int, groups: int, device_kind: str) -> bool:
    """Whether the groups are small: ``rows / groups`` at most the device's
    bound (a static bound on the mean: group sizes live on the device)."""
    return rows <= tuning_for(device_kind).small_group_rows * groups


def suggest(op: str, rows: int, groups: int, device_kind: str) -> Suggestion:
    """Tiles for ``op`` (``"fwd"``, ``"dx"``, ``"dw"``) on ``rows`` rows in
    ``groups`` groups: the small-group tiles first where groups are small
    (they do not fit every shape), then the default."""
    t = tuning_for(device_kind)
    if small_groups(rows, groups, device_kind):
        return Suggestion((t.small.tiles(op), t.default.tiles(op)), t.small.dw_pipeline)
    return Suggestion((t.default.tiles(op),), t.default.dw_pipeline)


def fp8_kernel(device_kind: str) -> str:
    """The fp8 kernel family (``"pallas"`` or ``"cuda"``) the device's table picks."""
    return tuning_for(device_kind).fp8_kernel


def fp8_cluster(k_steps: int, device_kind: str) -> int:
    """CTAs per cluster for the fp8 kernel over a contraction of ``k_steps``
    128-wide steps: 2 where the device's table says pairs win (long
    contractions), else 1."""
    least = tuning_for(device_kind).fp8_cluster_min_k_steps
    return 2 if least and k_steps >= least else 1


def fp8_tma_store(k_steps: int, device_kind: str) -> bool:
    """Whether the CUDA fp8 forward stores its bf16 tiles by TMA over a
    contraction of ``k_steps`` 128-wide steps: up to the device's measured
    threshold (``fp8_tma_store_max_k_steps``: 56 on an H200 and an H100,
    the longest contraction measured; 0 would mean never)."""
    return k_steps <= tuning_for(device_kind).fp8_tma_store_max_k_steps
