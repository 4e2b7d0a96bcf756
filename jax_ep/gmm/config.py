"""GroupedMatmulConfig: how the grouped matmul runs (the tuned defaults are
per device: ``tuned_tiles.json``)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

from .tiles import DwTiles, FwdTiles, as_tiles
from .tuning import DW_PIPELINES, FP8_KERNELS

# The expert alignment (EpConfig.expert_alignment) that suits these kernels:
# the default dw block_k. Groups that start and end on a k-step boundary need
# no zeroing pass in dw (pallas_common.step_has_outside_rows). Measured in the
# V3 layer at EP 1 (128 experts, T 4096, one H200, same run): 22.80 ms per
# fwd+bwd step at alignment 64 against 25.89 ms at 1.
GROUP_ALIGNMENT = 64

_IMPLS = ("auto", "pallas", "xla")
# How a cast with a CUDA kernel and an XLA form runs (fp8_dx_cast; cuda_quant.by_impl)
CAST_IMPLS = ("auto", "native", "xla")


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """How :func:`grouped_matmul` runs (hashable; safe as a static argument).

    Attributes:
      impl: ``"auto"`` (the device's kernel on Hopper where it applies, else
        XLA), ``"pallas"`` (force the kernel; raises when unsupported) or
        ``"xla"`` (``jax.lax.ragged_dot``; fp8: dequantize, then f32). On the
        fp8 path the kernel is the ``fp8_kernel`` family's (CUDA on Hopper),
        so ``"pallas"`` forces that family's kernel there.
      fwd, dx, dw: tile configuration of the Pallas kernel for the forward
        ``x @ w[g]``, for ``dx = dy @ w[g]^T`` (:class:`FwdTiles`) and for
        ``dw[g] = x[g]^T @ dy[g]`` (:class:`DwTiles`), or a tuple
        ``(block_m, block_n, block_k, stages, band)`` converted to one, or
        ``None`` for the device's tuned tiles (``tuned_tiles.json``).
        ``stages`` is the number of shared-memory pipeline stages (>= 2);
        ``band`` is how many row tiles (forward/dx) or row tiles of ``dw``
        are swept together per column tile (L2 locality); forward/dx ``band
        0``: each group's row tiles together at each of its column tiles (the
        group order, ``pallas_common.tile_at``).
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
        small-group tiles), as tuned for the device.
      interpret: run the Pallas kernels in Mosaic-GPU interpret mode (for
        testing the kernels on CPU; jax >= 0.11; very slow).
      fp8_dx: the fp8 path's ``dx = dy @ (w * ws)^T``. True (default): in
        fp8 (``dy`` cast per row and 128 columns as dispatch casts, f32
        scales, then the fp8 kernel against ``w`` as stored), at Hopper's fp8
        tensor-core rate, twice bf16's; ``dy`` rounded to e4m3's 3 mantissa
        bits costs accuracy: 2.6% normwise relative error of dx on random
        data against 0.23% in bf16 (CPU reference, 1024 x 512 x 512, normal
        and 2^±8-outlier data alike; per entry at most 2.1% of the sum of
        its products' magnitudes). False: in bf16 (``w`` dequantized to
        bf16, then the bf16 kernel). A switch so the speed side can be
        measured.
      fp8_dx_cast: how the fp8 dx casts ``dy`` per row and 128 columns:
        ``"auto"`` (default: the row kernel, ``cuda_quant.quantize_rows``,
        one read of ``dy``, where the program is lowered for CUDA and the
        extension can cast ``dy``; else XLA), ``"xla"`` (XLA's fusions, which
        read ``dy`` twice: once for the blocks' maxima, once for the cast) or
        ``"native"`` (the kernel or an error). The same bits on one GPU for
        finite ``dy`` (a NaN stays in its element rather than filling its
        block). In the V3 layer the kernel saves about
        0.15 ms of a 19 ms step (H100,
        bench/results/2026-12-04-h200x1-fp8-grouped-matmul.md).
      fp8_dw: the fp8 path's ``dw = (x * xs)[rows of g]^T @ dy[rows of g]``.
        False (default): in bf16 (``x * xs`` and ``dy`` rounded to bf16, the
        bf16 dw kernel). True: in fp8 at the fp8 tensor-core rate: ``x``'s
        per-row scales vary along dw's contraction (the rows), so ``x * xs``
        and ``dy`` are recast per column and 128 rows of their group, with
        the rows regrouped to start each group on a block and transposed
        (``fp8_columns``), then the ``fp8_kernel`` family's fp8 dw kernel.
        Both casts cost accuracy: 3.3-3.6% normwise relative error of dw
        against 0.24% in bf16 (CPU reference, 1024 x 512 x 512, normal and
        2^±8-outlier data; per entry at most 4.2% of the sum of its
        products' magnitudes); the training example's ``--fp8`` loss stays
        within 1.5-1.6% of bf16's over the first 12 steps (1.4-1.8% with dw in
        bf16; two runs of different lengths).
        Off by default: less accurate and no faster (V3 on one H100: up
        dw 4.39 ms, the CUDA kernel 3.57 plus 0.82 of recast, against 3.61
        in bf16; down 2.43 against 1.80): at 256 rows per group dw mostly
        writes its bf16 output, at the same pace in either precision.
      fp8_kernel: which kernels run the fp8 path's forward, fp8 dx and (with
        ``fp8_dw``) fp8 dw: ``"pallas"`` (``pallas_fp8``, ``pallas_fp8_dw``, Mosaic GPU),
        ``"cuda"`` (``cuda_fp8``: the native extension's kernels, one
        producer thread and the tile's sum zeroed once per tile; same
        contracts, the same bits), or None (default: the device's tuned
        choice, ``tuned_tiles.json``: ``"cuda"`` on an H200 and an H100,
        where it was measured faster, and on kinds the table does not list,
        which take its H200 entry). Left None, the Pallas kernels run
        without the native extension or with ``interpret``.
      fp8_tma_store: how the CUDA fp8 forward and dx store a bf16 result:
        None (default: the device's tuned choice by the contraction's length,
        ``heuristic.fp8_tma_store``; on an H200 and an H100 TMA up to 56 k-steps of 128),
        True (64-row blocks inside one group through a shared-memory tile and
        TMA, the ring 3 stages: frees the consumers from the store queue) or
        False (from registers, 4 stages). The same bits either way; the Pallas
        kernel ignores it.
      fp8_cluster: CTAs per cluster of the Pallas fp8 kernel (forward and fp8 dx):
        None (default: the device's tuned choice, ``heuristic.fp8_cluster``;
        on an H200 single CTAs, pairs not yet measured ahead), 1,
        or 2 (CTA pairs own adjacent ``128``-column tiles of one row tile and
        share the x tile and its row scales by TMA multicast: L2 reads per
        pair and k-step 64 -> 48 KB). 2 applies where ``Nout % 256 == 0``,
        else 1, and only to the Pallas kernel (``fp8_kernel="pallas"``; the
        CUDA kernel runs single CTAs); with ``impl="auto"`` on a GPU, 2 only
        where it compiles, else 1.
      expected_rows: the mean rows per group the tuned tiles are chosen for
        (DeepGEMM's ``expected_m``): None (default) takes x's rows / groups,
        which for the masked layout is its capacity C, however few rows the
        groups hold. Set it where C is a bound far above the groups' sizes
        (low-latency decode: C = R * Tmax, a few rows per expert) so small
        groups get the small-group tiles.
    """

    impl: str = "auto"
    fwd: Optional[Union[FwdTiles, Sequence[int]]] = None
    dx: Optional[Union[FwdTiles, Sequence[int]]] = None
    dw: Optional[Union[DwTiles, Sequence[int]]] = None
    interpret: bool = False
    dw_warpgroups: int = 2
    fwd_warpgroups: int = 2
    dw_cluster: int = 2
    dw_pipeline: Optional[str] = None
    fp8_dx: bool = True
    fp8_dx_cast: str = "auto"
    fp8_dw: bool = False
    fp8_kernel: Optional[str] = None
    fp8_tma_store: Optional[bool] = None
    fp8_cluster: Optional[int] = None
    expected_rows: Optional[int] = None

    def __post_init__(self):
        if self.dw_pipeline is not None and self.dw_pipeline not in DW_PIPELINES:
            raise ValueError(f"dw_pipeline must be one of {DW_PIPELINES}, got {self.dw_pipeline!r}")
        if self.impl not in _IMPLS:
            raise ValueError(f"impl must be one of {_IMPLS}, got {self.impl!r}")
        if self.fp8_kernel is not None and self.fp8_kernel not in FP8_KERNELS:
            raise ValueError(f"fp8_kernel must be None or one of {FP8_KERNELS}, got "
                             f"{self.fp8_kernel!r}")
        if self.fp8_dx_cast not in CAST_IMPLS:
            raise ValueError(f"fp8_dx_cast must be one of {CAST_IMPLS}, got "
                             f"{self.fp8_dx_cast!r}")
        for name in ("fp8_dx", "fp8_dw"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.fp8_tma_store is not None and not isinstance(self.fp8_tma_store, bool):
            raise ValueError(f"fp8_tma_store must be None or a bool, got {self.fp8_tma_store!r}")
        for name in ("dw_warpgroups", "fwd_warpgroups", "dw_cluster"):
            _check_one_or_two(name, getattr(self, name), "1 or 2")
        if self.expected_rows is not None and (isinstance(self.expected_rows, bool) or
                                               not isinstance(self.expected_rows, int) or
                                               self.expected_rows < 1):
            raise ValueError(f"expected_rows must be None or a positive int, got "
                             f"{self.expected_rows!r}")
        if self.fp8_cluster is not None:   # None: the device's tuned choice
            _check_one_or_two("fp8_cluster", self.fp8_cluster, "None, 1 or 2")
        for name, cls in (("fwd", FwdTiles), ("dx", FwdTiles), ("dw", DwTiles)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, as_tiles(cls, getattr(self, name)))


def _check_one_or_two(name: str, value, allowed: str) -> None:
    if isinstance(value, bool) or value not in (1, 2):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
