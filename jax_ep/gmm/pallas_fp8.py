"""FP8 grouped matmul kernel (Pallas Mosaic GPU, Hopper): both operands
fp8-e4m3 and K-major, per-128 scales, f32 accumulation.

``out[rows of g] = (x · xs)[rows of g] @ ((v · vs)[g])^T``

- ``x`` ``[M, Kc]`` e4m3, ``xs`` ``[M, Kc/128]`` f32 (per row, per 128 of the contraction);
- ``v`` ``[G, Nout, Kc]`` e4m3 (the contraction contiguous: fp8 WGMMA takes
  K-major operands only), ``vs`` ``[G, Nout/128, Kc/128]`` f32 (128 x 128 blocks);
- ``offsets`` int32 ``[G+1]`` (``ops.offsets``); rows past ``offsets[-1]`` are zero.

The forward of ``x @ w`` with ``w [G, K, N]`` calls it with ``v = w^T``
(``[G, N, K]``); dx = ``dy @ w[g]^T`` calls it with ``v = w`` as stored.

Promotion: each 128-wide k-step's WGMMA runs into a fresh f32 accumulator,
which is then scaled by ``xs[row, k] * vs[g, n, k]`` and added to the tile's
f32 sum in registers. The tensor core's fp8 accumulator keeps fewer mantissa
bits than f32 (DeepSeek-V3 measured about 14), so promoting every 128 of the
contraction (4 WGMMA instructions) keeps the error at the bf16 output's level;
the scales cannot be applied later anyway, since they change along k. The
kernel is bound by instruction issue, not by the tensor cores (Nsight
Compute: bench/results/2026-12-04-h200x1-fp8-grouped-matmul.md), so a step
does the fewest instructions per register: the WGMMA starts from zero
(ptxas clears the accumulator by the instruction's own flag), the tile's
first step drops the carried sum by a select while the WGMMA runs, and one
FMA per register adds the scaled product once it lands.

Structure as :func:`pallas_fwd.gmm_pallas_ws`: a producer warpgroup and two
consumers, one warp-specialized pipeline per SM across its tiles. A CTA owns a
``128 x 128`` output tile, each consumer 64 of its rows: two f32 register
tiles a thread (the sum and the WGMMA's accumulator; 64 registers each).
Each stage brings the x and v tiles, the rows' scales and the tile's weight
scales (a scalar load from HBM per k-step stalls the consumer for its
latency). Variants measured slower and deleted: docs/decisions.md.

``cluster=2``: CTAs run in pairs (2-CTA clusters) that own the column tiles
``2 nc`` and ``2 nc + 1`` of one row tile (the same rows of one group, so the
same row-tile table and masking as one CTA): each CTA loads half of the x tile
and of its rows' scales and multicasts it to both, and loads its own v tile
and weight scales. L2 reads per pair and k-step: 64 -> 48 KB. The
pipeline's "stage released" barriers are then cluster barriers (a multicast
never lands in a stage the partner still reads), and both CTAs of a pair run
the same steps. Shared memory per CTA is unchanged. ``Nout % (2 block_n) != 0``
runs on single CTAs (:func:`fp8_cluster`).
"""
from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp
from jax import lax

from ..fp8 import FP8_BLOCK
from .pallas_common import (cluster_member, dw_transforms, multicast_axes, num_sms,
                            pallas_modules, round_robin_count, row_tile_table, store_rows,
                            store_tail_tiles, transposed, two_consumer_kernel)
from .devices import device_info
from .tiles import FwdTiles

# 128 x 128 tiles, 128 of the contraction per stage (one scale block), 33 KB a
# stage: 5 stages and a bf16 epilogue buffer fit in shared memory (f32: 4).
FP8_TILES = FwdTiles(block_m=128, block_n=128, block_k=128, stages=5, band=4)
SCALE_ROW = 32       # f32 weight scales staged per tile: a multiple of 128 bytes
SMEM_SLACK = 2048    # the pipeline's barriers and alignment (measured: about 1.2 KB)
CLUSTERS = (1, 2)    # CTAs per cluster


def _scale_row(ksteps: int) -> int:
    """f32 weight scales staged per tile for ``ksteps`` k-steps (padded to ``SCALE_ROW``)."""
    return ksteps + (-ksteps % SCALE_ROW)


def fp8_stages(tiles, kc: int, out_dtype, smem_bytes: int) -> int:
    """The most pipeline stages (at most ``tiles.stages``) that fit beside the
    epilogue buffer (a consumer's rows of the tile). A stage: the x and v
    tiles, the rows' scales and the tile's weight scales."""
    kbp = _scale_row(-(-kc // FP8_BLOCK))
    return stages_that_fit(tiles, 4 * tiles.block_m + 4 * kbp, out_dtype, smem_bytes)


def stages_that_fit(tiles, scale_bytes: int, out_dtype, smem_bytes: int) -> int:
    """The most stages (at most ``tiles.stages``, at least 1) of the fp8
    kernels that fit beside their output tile in ``out_dtype``: a stage holds
    an fp8 tile of each operand and ``scale_bytes`` of scales."""
    stage = (tiles.block_m + tiles.block_n) * tiles.block_k + scale_bytes
    epilogue = tiles.block_m * tiles.block_n * jnp.dtype(out_dtype).itemsize
    return max(1, min(tiles.stages, (smem_bytes - SMEM_SLACK - epilogue) // stage))


def check_fp8_nt(x, xs, v, vs, tiles=FP8_TILES):
    """None if the kernel runs these operands, else why not."""
    m, kc = x.shape
    if x.dtype != jnp.float8_e4m3fn or v.dtype != jnp.float8_e4m3fn:
        return f"fp8 kernel needs float8_e4m3fn operands, got {x.dtype} and {v.dtype}"
    if v.ndim != 3 or v.shape[2] != kc:
        return f"v must be [G, Nout, {kc}], got {v.shape}"
    n = v.shape[1]
    if (tiles.block_m, tiles.block_n, tiles.block_k) != (128, 128, 128):
        return f"fp8 tiles are 128 x 128 x 128, got {tiles}"
    if kc % FP8_BLOCK or n % tiles.block_n or n % FP8_BLOCK:
        return f"Kc ({kc}) must be a multiple of 128 and Nout ({n}) of {tiles.block_n}"
    if m % 8 or m < tiles.block_m:
        return (f"M ({m}; the masked layout: G * C) must be a multiple of 8 and at least "
                f"{tiles.block_m}")
    if xs.shape != (m, kc // FP8_BLOCK) or vs.shape != (v.shape[0], n // FP8_BLOCK, kc // FP8_BLOCK):
        return f"scales {xs.shape} / {vs.shape} do not match x {x.shape} / v {v.shape}"
    return None


def fp8_cluster(n: int, cluster: int, tiles=FP8_TILES) -> int:
    """The CTAs per cluster the kernel runs for ``cluster``: ``cluster`` where
    ``Nout % (cluster block_n) == 0`` (a pair owns two adjacent column tiles),
    else 1."""
    if isinstance(cluster, bool) or cluster not in CLUSTERS:
        raise ValueError(f"gmm_fp8_nt: cluster must be one of {CLUSTERS}, got {cluster!r}")
    return cluster if n % (cluster * tiles.block_n) == 0 else 1


def gmm_fp8_nt(x, xs, v, vs, offsets, *, tiles=None, out_dtype=None, cluster=1,
               interpret=False):
    """``[M, Nout]`` in ``out_dtype`` (default bfloat16; see the module
    docstring). ``cluster``: 1, or 2 for CTA pairs sharing the x tile (falls
    back to 1 where ``Nout % (2 block_n) != 0``: :func:`fp8_cluster`)."""
    tiles = tiles or FP8_TILES
    err = check_fp8_nt(x, xs, v, vs, tiles)
    if err is not None:
        raise ValueError(f"gmm_fp8_nt: {err}")
    cluster = fp8_cluster(v.shape[1], cluster, tiles)
    out_dtype = jnp.dtype(out_dtype or jnp.bfloat16)
    m, kc = x.shape
    counts, rs, r0, r1, grp = row_tile_table(offsets, m, tiles.block_m)
    # step k's scales of the rows r at k * M + r: one contiguous run per tile and step
    xs_flat = xs.astype(jnp.float32).T.reshape(-1)
    # a tile's weight scales come with each stage, padded to SCALE_ROW: rows
    # of 128 bytes keep the stage buffers aligned
    kb = kc // FP8_BLOCK
    vs = jnp.pad(vs.astype(jnp.float32), ((0, 0), (0, 0), (0, _scale_row(kb) - kb))).reshape(-1)
    stages = fp8_stages(tiles, kc, out_dtype, device_info().smem_per_block)
    kernel = _kernel(m, kc, v.shape[1], dataclasses.replace(tiles, stages=stages), out_dtype,
                     cluster, interpret)
    return kernel(counts, rs, r0, r1, grp, x, v, xs_flat, vs)


def _kernel(m, kc, n, tiles, out_dtype, cluster, interpret):
    pl, plgpu = pallas_modules()
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    half = bm // 2                      # rows of one consumer warpgroup
    grid_n, ksteps = n // bn, kc // bk
    nsm = num_sms(interpret)
    units = nsm // cluster              # the CTAs, or CTA pairs, the tiles are dealt to

    def body(cnt_ref, rs_ref, r0_ref, r1_ref, g_ref, x_ref, v_ref, xs_ref, vs_ref, o_ref):
        unit = lax.axis_index("sm")
        n_grp = cnt_ref[0]
        tile = _tile_of(plgpu, unit, units, n_grp, grid_n, tiles.band, cluster)
        specs = _in_specs(pl, plgpu, tile, rs_ref, g_ref, (m, kc, n), tiles, cluster)

        def scoped(o_smem):
            wg = lax.axis_index("wg")
            store = _tile_store(pl, plgpu, o_smem, o_ref, rs_ref, r0_ref, r1_ref, wg, half, bn)
            step = _promoting_step(pl, plgpu, tile, store, wg, half, ksteps)
            # both CTAs of a pair run the same steps (each stage's x tile needs both)
            mine = round_robin_count(n_grp * (grid_n // cluster), unit, units)

            @pl.when(mine > 0)
            def _():
                plgpu.emit_pipeline_warp_specialized(
                    step, grid=(mine, ksteps), memory_registers=40, in_specs=specs,
                    wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=tiles.stages,
                    compute_context=lambda run: run(zero_sum(plgpu, half, bn)),
                )(x_ref, v_ref, xs_ref, vs_ref)

            @pl.when(wg < 2)
            def _():
                # the tail's zero tiles dealt over every CTA, no pairs
                store_tail_tiles(pl, plgpu, cnt_ref, n_grp, store, cluster_member(unit, cluster),
                                 units * cluster, grid_n, (half, bn))

        pl.run_scoped(scoped, plgpu.SMEM((2, half, bn), out_dtype), collective_axes="wg")

    return two_consumer_kernel(plgpu, body, (m, n), out_dtype, units, cluster, interpret)


def _tile_of(plgpu, unit, units, n_grp, grid_n, band, cluster):
    """``tile(j) -> (row tile, column tile)``: this CTA's ``j``-th tile. The
    tiles (or, on clusters, pairs of adjacent column tiles) go to ``units``
    CTAs (pairs) along a snake of ``band`` row tiles; a pair's CTAs take
    columns ``2 nc`` and ``2 nc + 1`` of the same row tile."""
    def tile(j):
        fi, nc = plgpu.planar_snake(unit + j * units, (n_grp, grid_n // cluster), 0, band)
        return fi, cluster_member(nc, cluster)
    return tile


def _in_specs(pl, plgpu, tile, rs_ref, g_ref, dims, tiles, cluster):
    """The pipeline's inputs per (tile ``j``, k-step ``kk``): the x tile and
    its rows' scales (multicast to both CTAs of a pair: each loads half), the
    v tile and the tile's weight scales (each CTA its own)."""
    m, kc, n = dims
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    ksteps = kc // bk
    kbp = _scale_row(ksteps)
    tr, _ = dw_transforms(plgpu, jnp.float8_e4m3fn, bk, bn)
    shared = multicast_axes(cluster)

    def row0(j):
        return pl.multiple_of(rs_ref[tile(j)[0]], 8)

    def v_index(j, kk):
        fi, ni = tile(j)
        return jnp.maximum(g_ref[fi], 0), ni, kk

    def vs_index(j, kk):   # element offset of the tile's first scale row
        g, ni, _ = v_index(j, kk)
        return ((g * (n // bn) + ni) * kbp,)

    return [plgpu.BlockSpec((pl.Element(bm), bk), lambda j, kk: (row0(j), kk), transforms=tr,
                            **shared),
            plgpu.BlockSpec((None, bn, bk), v_index, transforms=tr),
            plgpu.BlockSpec((pl.Element(bm),), lambda j, kk: (kk * m + row0(j),), **shared),
            plgpu.BlockSpec((pl.Element(kbp),), vs_index)]


def zero_sum(plgpu, half, bn):
    """The consumer's carry: the tile's f32 sum, in the WGMMA layout."""
    return plgpu.layout_cast(jnp.zeros((half, bn), jnp.float32), plgpu.Layout.WGMMA)


def _promoting_step(pl, plgpu, tile, store, wg, half, ksteps):
    """The consumer's pipeline step: this k-step's product of its ``half`` rows
    into a fresh accumulator (ptxas starts it from zero: no register
    clearing); while the WGMMA runs, a tile's first step drops the carried
    sum (the previous tile's, already stored); once it lands, the product,
    scaled, is added to the sum, one FMA per register. On the tile's last
    k-step the sum is stored."""
    def step(idx, x_smem, v_smem, xs_smem, vs_smem, acc):
        j, kk = idx
        fi, ni = tile(j)
        scale = load_vector(plgpu, xs_smem.at[pl.ds(wg * half, half)], 0) * vs_smem[kk]
        shape = acc.shape
        # a select, never a multiply by zero: rows outside the tile's groups may hold NaN
        first = plgpu.layout_cast(lax.broadcast(kk == 0, shape), plgpu.Layout.WGMMA)

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, x_smem.at[pl.ds(wg * half, half)], transposed(plgpu, v_smem))
            kept = jnp.where(first, jnp.zeros_like(acc), acc)   # under the WGMMA
            return acc_ref[...], kept

        prod, kept = pl.run_scoped(mma, plgpu.ACC(shape))
        acc = kept + prod * lax.broadcast_in_dim(scale, shape, [0])

        @pl.when(kk == ksteps - 1)
        def _():
            store(fi, ni, acc)
        return acc
    return step


def load_vector(plgpu, ref, along: int):
    """A vector along dim ``along`` of a WGMMA accumulator tile (0: one value
    per row, 1: per column) in that tile's layout (jax 0.10's ``load`` takes
    an index; 0.11 deprecates it)."""
    layout = plgpu.Layout.WGMMA.reduce(1 - along)
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _tile_store(pl, plgpu, o_smem, o_ref, rs_ref, r0_ref, r1_ref, wg, half, bn):
    """``store(fi, ni, val)``: a consumer's ``half x bn`` rows of tile ``(fi, ni)``
    to HBM, only rows inside ``[lo, hi)`` of the row tile."""
    top = 1 << (half.bit_length() - 1)

    def store(fi, ni, val):
        lo, hi = r0_ref[fi], r1_ref[fi]
        c0 = pl.multiple_of(rs_ref[fi], 8) + wg * half
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # our slot is free
        o_smem[wg] = val.astype(o_smem.dtype)
        plgpu.commit_smem()
        store_rows(pl, plgpu, o_smem.at[wg], o_ref.at[:, pl.ds(pl.multiple_of(ni * bn, bn), bn)],
                   jnp.clip(lo, c0, c0 + half), jnp.clip(hi, c0, c0 + half), c0, top)
    return store
