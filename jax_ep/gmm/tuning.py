"""The tuned tiles per device kind (``tuned_tiles.json``) and the one function that loads them.

Where the numbers come from: the tiles from one H200
(bench/grouped_matmul_bench.py and the V3 layer of bench/moe_layer_step.py;
the H100 entry reuses them, see the file); the group order (band 0) from
one H100; the fp8 kernel family and the fp8 tile store from one H200 and
one H100, as each entry says:

* default fwd/dx ``(128, 128, 64, 5, 0)``: tiles the best of the first H200
  tile sweep of bench/grouped_matmul_bench.py (the 2-consumer kernel runs them
  with the stages cut to what fits, 4), in the group order (band 0; measured
  on one H100, bench/results/2026-12-03-h200x1-grouped-matmul-layer-ep1.md).
  Against the snake of 2 row tiles that sweep chose on uniform 256-row groups:
  the V3 layer at T 4096 21.02 against 23.76 ms; on the layer's groups
  (256 or 320 rows) up fwd 3.261 against 4.873 ms, dx 3.398 against 4.790,
  down fwd 1.680 against 2.112, dx 1.657 against 1.682; skewed sizes 1-7%
  faster; uniform 256-row groups, where every band of 2 is one group, 2-7%
  slower (up fwd 3.119 against 2.918). On an H200 by the same reasoning (its
  SM, L2 and tile shapes are the H100's), not yet measured there.
* default dw ``(128, 128, 64, 4, 4)``; a 1-warpgroup variant with one pipeline
  per (SM, group) measured slower and was deleted (docs/decisions.md).
* small groups (at most ``small_group_rows`` = 96 rows per group on average,
  counting every row of x), measured in the V3 layer at T 128 (EP 1; 64-row
  groups of ~8 routed rows):

  - dx ``(64, 128, 128, 3, 2)``: 256-byte rows of the transposed weight tile
    for TMA, 2 stages fit; the two dx kernels 2703 against 2890-2945 us per
    step with the default, layer 9.14 against 9.27-9.43 ms; standalone at 64
    rows per group 1.862 / 0.954 against 2.055 / 1.035 ms (up / down),
    bit-identical; at 256 rows per group 36% slower, hence the bound.
  - dw ``(64, 128, 64, 5, 4)`` (a 128 x 128 CTA tile): gate_up dw 2093 against
    2218-2277 us per step, down dw equal, layer 9.159 against 9.217-9.259 ms.
  - fwd ``(64, 256, 64, 2, 2)``: 512-byte weight-tile rows, 2 stages fit the
    2-consumer kernel; gate_up fwd 1761-1762 against 1803-1814 us per step
    for ``(64, 128, 64, 4, 2)``, down 918-922 against 932-940, layer
    9.070-9.096 against 9.124-9.188 ms. At T 1024 (127 rows per group, above
    the bound) they lose: layer 10.82-10.86 against 10.63 ms.
  - wider ones (dx ``(64, 64, 256, 2, 2)``, ``(64, 64, 128, 4, 2)``, dw
    ``(64, 256, 64, 3, 4)``) were no faster in the layer (docs/decisions.md).

* dw pipeline (bench/results/2026-12-03-h200x1-grouped-matmul-layer-ep1.md): the ring across
  groups on 2-CTA clusters, standalone at T 4096 shapes up dw 3.235 ms against
  3.493 for the per-group pipeline (cuBLAS batched 3.131), down 1.633 against
  1.910; V3 layer at T 4096 20.660 against 20.919 ms. With small groups (one
  k-step per tile) the ring loses (layer 9.251 / 9.274 against 9.116): the
  per-group pipeline there.

* fp8 clusters (bench/results/2026-12-04-h200x1-fp8-grouped-matmul.md, one
  H200, one run, uniform sizes): the Pallas kernel's 2-CTA clusters sharing
  the x tile ran V3 up at 742 TF/s against 776 and 807 for two rows of the
  1-CTA kernel, V3 down at 793 against 787 and 808: level within the run's
  spread (CTA pairs of the CUDA kernel, tried on an H100, were slower and
  were removed: docs/decisions.md). ``fp8_cluster_min_k_steps`` = 0 keeps
  the Pallas kernel on single CTAs.

* fp8 kernel family (bench/results/2026-12-04-h200x1-fp8-grouped-matmul.md,
  one run each): ``fp8_kernel`` = "cuda" on an H200 and an H100. On one
  H200, its forward with TMA stores against the Pallas kernel at V3 shapes
  (uniform sizes): up 1.697 vs 2.372 ms, down 0.913 vs 1.232, bit for bit,
  after its 38 GPU bit tests passed there. On one H100 its forward
  (256-row tiles, one-block tiles paired, TMA store) at V3 shapes against
  the Pallas kernel, up 1.747 vs 2.363 ms (uniform sizes), 2.197 vs 2.857
  (skewed), 1.925 vs 2.629 (the layer's groups); down 0.956 vs 1.191, 1.149
  vs 1.496, 1.025 vs 1.358, bit for bit; its GPU tests passed there, the API
  with gradients on it included. (An earlier form of the CUDA forward,
  128-row tiles, ended in an illegal instruction on an H200.)

* fp8 tile store (bench/results/2026-12-04-h200x1-fp8-grouped-matmul.md, one H100, one run):
  the CUDA forward storing its bf16 tiles by TMA (3 stages) against from
  registers (4 stages), with each stage released before its last
  promotion: V3 up (K 7168, 56 k-steps of 128) 1.747 against 1.864 ms
  with uniform sizes, 1.925 against 1.964 on the layer's groups, 2.197
  against 2.276 skewed; V3 down (K 2048, 16 steps) 0.956 against 1.158,
  1.025 against 1.227, 1.149 against 1.305. The V3 layer (its dx contracts
  32 and 56 steps; on the kernel before the pairing) 18.56 and 18.58 ms
  with TMA stores everywhere against 19.05 with them up to 16 steps only
  (the dx shapes not timed alone on that build).
  ``fp8_tma_store_max_k_steps`` = 56: TMA stores up to V3 up's
  contraction, the longest measured. On one H200 (one run, uniform sizes)
  TMA stores against stores from registers: up 1.697 vs 2.008 ms, down
  0.913 vs 1.214.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from typing import Dict, Optional

from .tiles import DwTiles, FwdTiles

DW_PIPELINES = ("per_group", "ring")
FP8_KERNELS = ("pallas", "cuda")   # the fp8 path's kernel families (GroupedMatmulConfig.fp8_kernel)


@dataclasses.dataclass(frozen=True)
class TileSet:
    fwd: FwdTiles
    dx: FwdTiles
    dw: DwTiles
    dw_pipeline: str

    def __post_init__(self):
        if self.dw_pipeline not in DW_PIPELINES:
            raise ValueError(f"dw_pipeline must be one of {DW_PIPELINES}, got {self.dw_pipeline!r}")

    def tiles(self, op: str):
        return getattr(self, op)


@dataclasses.dataclass(frozen=True)
class DeviceTuning:
    kind: str
    small_group_rows: int
    default: TileSet
    small: TileSet
    fp8_cluster_min_k_steps: int = 0   # 0: the fp8 kernel never runs on clusters
    fp8_kernel: str = "pallas"         # the fp8 kernel family that wins here
    fp8_tma_store_max_k_steps: int = 0  # the CUDA forward's TMA stores up to these k-steps

    def __post_init__(self):
        if self.fp8_kernel not in FP8_KERNELS:
            raise ValueError(f"fp8_kernel must be one of {FP8_KERNELS}, got {self.fp8_kernel!r}")


@functools.lru_cache(maxsize=None)
def load_tuned(text: Optional[str] = None):
    """``(entries by device kind, the fallback kind)`` from ``tuned_tiles.json``
    (or from ``text``, for tests)."""
    if text is None:
        text = resources.files(__package__).joinpath("tuned_tiles.json").read_text()
    data = json.loads(text)
    raw = data["devices"]
    entries: Dict[str, DeviceTuning] = {}
    for kind, e in raw.items():
        src = {**raw[e["same_as"]], **e} if "same_as" in e else e   # same_as, then overrides
        entries[kind] = DeviceTuning(kind, int(src["small_group_rows"]),
                                     _tile_set(src["default"]), _tile_set(src["small"]),
                                     int(src.get("fp8_cluster_min_k_steps", 0)),
                                     src.get("fp8_kernel", "pallas"),
                                     int(src.get("fp8_tma_store_max_k_steps", 0)))
    fallback = data["fallback"]
    if fallback not in entries:
        raise ValueError(f"tuned_tiles.json: fallback {fallback!r} is not an entry")
    return entries, fallback


def tuning_for(kind: str) -> DeviceTuning:
    """The tuned entry of device kind ``kind``; the fallback's for unknown kinds
    (the tiles every device ran before the table existed)."""
    entries, fallback = load_tuned()
    return entries.get(kind) or entries[fallback]


def _tile_set(e) -> TileSet:
    return TileSet(FwdTiles(*e["fwd"]), FwdTiles(*e["dx"]), DwTiles(*e["dw"]), e["dw_pipeline"])
