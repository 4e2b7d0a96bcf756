"""GroupedMatmulConfig and the default tiles of the grouped-matmul kernels."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

# (block_m, block_n, block_k, max_concurrent_steps, band)
Tiles = Tuple[int, int, int, int, int]


# fwd/dx: best of the first H200 sweep (bench/results/history/2026-11-30-h200-grouped-
# matmul-first.md): 5 stages, band 2. dw: the 2-consumer kernel cuts the stages to
# fit shared memory (two_consumer_tiles); a 1-warpgroup variant with one pipeline per (SM,
# group) measured slower and was deleted (bench/results/README.md, "Deleted variants").
DEFAULT_TILES = {
    "fwd": (128, 128, 64, 5, 2),
    "dx": (128, 128, 64, 5, 2),
    "dw": (128, 128, 64, 4, 4),
}


# Tiles for small groups (at most SMALL_GROUP_ROWS rows per group on average,
# counting every row of x), measured in the V3 layer at T 128 (EP 1, one H200;
# 64-row groups of ~8 routed rows):
#  - dx: block_m 64 and block_k 128 (256-byte rows of the transposed weight
#    tile for TMA; 2 stages fit): the two dx kernels 2703 against
#    2890-2945 us per step with the default tiles, layer 9.14 against
#    9.27-9.43 ms; standalone at 64 rows per group 1.862 / 0.954 against 2.055 /
#    1.035 ms (up / down), bit-identical; at 256 rows per group 36% slower,
#    hence the bound.
#  - dw: block_m 64 (a 128 x 128 CTA tile of dw[g]) with 5 stages:
#    gate_up dw 2093 against 2218-2277 us per step (four runs of the default),
#    down dw equal (1124 against 1110-1119), layer 9.159 against 9.217-9.259 ms.
#  - fwd: block_m 64, block_n 256 (512-byte weight-tile rows; 2 stages fit
#    the 2-consumer kernel; asked for as 5 stages, cut to 2 by the fit).
#    Two calls, 3 runs against 4 of
#    (64, 128, 64, 4, 2): gate_up fwd 1761-1762 against 1803-1814 us per step,
#    down fwd 918-922 against 932-940, layer 9.070-9.096 against 9.124-9.188
#    ms. At T 1024 (127 rows per group, above the bound) they lose: layer
#    10.82-10.86 against 10.63 ms. (64, 128, 64, 4, 2) had beaten the 128-row
#    default by 1.5-1.8% per kernel; 64-row tiles with a pipeline per tile
#    were no faster.
#  Wider ones (dx (64, 64, 256, 2, 2) and (64, 64, 128, 4, 2), dw
#    (64, 256, 64, 3, 4)) no faster in the layer at T 128 (docs/decisions.md).
SMALL_GROUP_ROWS = 96
SMALL_GROUP_TILES = {"fwd": (64, 256, 64, 2, 2), "dx": (64, 128, 128, 3, 2),
                     "dw": (64, 128, 64, 5, 4)}

# dw's defaults (GroupedMatmulConfig.dw_pipeline None, dw_cluster 2), one H200
# (bench/results/2026-12-03-h200x1-grouped-matmul-layer-ep1.md). Standalone at T 4096 shapes
# (128 groups of 256 rows, uniform), same call: up dw 3.493 ms per-group
# pipeline, 3.487 on clusters, 3.380 ring, 3.235 ring on clusters (0.73 -> 0.79
# of dense; cuBLAS's batched dw 3.131); down dw 1.910 / 1.856 / 1.712 / 1.633
# (0.67 -> 0.79; cuBLAS 1.625). V3 layer at EP 1, T 4096: 20.919 ms default,
# 20.660 ring on clusters. At T 128 (small groups, one k-step per tile) the
# ring loses (layer 9.251 / 9.274 against 9.116) and clusters alone win (9.020
# / 9.029 against 9.093 / 9.116 in two calls).
DW_PIPELINE = {"default": "ring", "small": "per_group"}

# The expert alignment (EpConfig.expert_alignment) that suits these kernels:
# the default dw block_k. Groups that start and end on a k-step boundary need
# no zeroing pass in dw (pallas_common.step_has_outside_rows). Measured in the
# V3 layer at EP 1 (128 experts, T 4096, one H200, same run): 22.80 ms per
# fwd+bwd step at alignment 64 against 25.89 ms at 1.
GROUP_ALIGNMENT = 64

_IMPLS = ("auto", "pallas", "xla")
_DW_PIPELINES = ("per_group", "ring")


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """How :func:`grouped_matmul` runs (hashable; safe as a static argument).

    Attributes:
      impl: ``"auto"`` (Pallas Mosaic-GPU on Hopper where it applies, else
        XLA), ``"pallas"`` (force; raises when unsupported) or ``"xla"``
        (``jax.lax.ragged_dot``).
      fwd, dx, dw: tile configuration of the Pallas kernel for the forward
        ``x @ w[g]``, for ``dx = dy @ w[g]^T`` and for
        ``dw[g] = x[g]^T @ dy[g]``: a tuple
        ``(block_m, block_n, block_k, max_concurrent_steps, band)``, or ``None``
        for :data:`DEFAULT_TILES`. ``max_concurrent_steps`` is the number of
        shared-memory pipeline stages (>= 2); ``band`` is how many row
        tiles (forward/dx) or row tiles of ``dw`` are swept together per
        column tile (L2 locality).
      dw_warpgroups: consumer warpgroups of the dw kernel: 2 (a producer
        warpgroup feeds two consumers that own a ``2 block_m x block_n`` tile;
        used when ``K % (2 block_m) == 0``, else the 1-warpgroup kernel) or 1
        (one warpgroup loads and computes ``block_m x block_n`` tiles).
      fwd_warpgroups: consumer warpgroups of the forward / dx kernel: 2 (a
        producer warpgroup feeds two consumers that own ``block_m x 2
        block_n``; used where ``N % (2 block_n) == 0`` and the stages fit
        shared memory, else the 1-warpgroup kernel) or 1.
      dw_cluster: CTAs per cluster of the 2-consumer dw kernel: 2 (default;
        CTA pairs own adjacent ``block_n`` column tiles and share the x tile
        by TMA multicast, halving x's L2 reads; used where ``N % (2 block_n)
        == 0``, else 1) or 1.
      dw_pipeline: how the 2-consumer dw kernel pipelines its loads:
        ``"ring"`` (one ring of stages per SM across all groups: the next
        group's loads are in flight while the last group's tiles finish),
        ``"per_group"`` (one warp-specialized pipeline per (SM, group),
        filled and drained at every group), or ``None`` (default): ``"ring"``,
        and ``"per_group"`` where groups are small (the bound of
        :data:`SMALL_GROUP_TILES`), as measured (:data:`DW_PIPELINE`).
      interpret: run the Pallas kernels in Mosaic-GPU interpret mode (for
        testing the kernels on CPU; jax >= 0.11; very slow).
    """

    impl: str = "auto"
    fwd: Optional[Tiles] = None
    dx: Optional[Tiles] = None
    dw: Optional[Tiles] = None
    interpret: bool = False
    dw_warpgroups: int = 2
    fwd_warpgroups: int = 2
    dw_cluster: int = 2
    dw_pipeline: Optional[str] = None

    def __post_init__(self):
        if self.dw_pipeline is not None and self.dw_pipeline not in _DW_PIPELINES:
            raise ValueError(f"dw_pipeline must be one of {_DW_PIPELINES}, got {self.dw_pipeline!r}")
        if self.impl not in _IMPLS:
            raise ValueError(f"impl must be one of {_IMPLS}, got {self.impl!r}")
        for name in ("dw_warpgroups", "fwd_warpgroups", "dw_cluster"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) not in (1, 2):
                raise ValueError(f"{name} must be 1 or 2, got {getattr(self, name)!r}")
        for name in ("fwd", "dx", "dw"):
            t = getattr(self, name)
            if t is None:
                continue
            t = tuple(int(v) for v in t)
            if len(t) != 5:
                raise ValueError(f"{name} tiles must be (block_m, block_n, block_k, "
                                 f"max_concurrent_steps, band), got {t}")
            object.__setattr__(self, name, t)

    def tiles(self, op: str) -> Tiles:
        t = getattr(self, op)
        return DEFAULT_TILES[op] if t is None else t
