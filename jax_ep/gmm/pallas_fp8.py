"""FP8 grouped matmul kernel (Pallas Mosaic GPU, Hopper): both operands
fp8-e4m3 and K-major, per-128 scales, f32 accumulation.

``out[rows of g] = (x · xs)[rows of g] @ ((v · vs)[g])^T``

- ``x`` ``[M, Kc]`` e4m3, ``xs`` ``[M, Kc/128]`` f32 (per row, per 128 of the contraction);
- ``v`` ``[G, Nout, Kc]`` e4m3 (the contraction contiguous: fp8 WGMMA takes
  K-major operands only), ``vs`` ``[G, Nout/128, Kc/128]`` f32 (128 x 128 blocks);
- ``offsets`` int32 ``[G+1]`` (``api._offsets``); rows past ``offsets[-1]`` are zero.

The forward of ``x @ w`` with ``w [G, K, N]`` calls it with ``v = w^T``
(``[G, N, K]``); dx = ``dy @ w[g]^T`` calls it with ``v = w`` as stored.

Promotion: each 128-wide k-step's WGMMA runs into a fresh f32 accumulator,
which is then scaled by ``xs[row, k] * vs[g, n, k]`` and added to the tile's
f32 sum in registers. The tensor core's fp8 accumulator keeps fewer mantissa
bits than f32 (DeepSeek-V3 measured about 14), so promoting every 128 of the
contraction (4 WGMMA instructions) keeps the error at the bf16 output's level;
the scales cannot be applied later anyway, since they change along k.

Structure as :func:`pallas_fwd.gmm_pallas_ws`: a producer warpgroup and two
consumers, one warp-specialized pipeline per SM across its tiles. A CTA owns a
``block_m x block_n`` output tile; each consumer takes half of its rows
(``block_m / 2 x block_n``: two f32 register tiles, the sum and the step's
product, of 64 registers each at 128 x 128).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .pallas_common import (dw_transforms, kernel_params, num_sms, pallas_modules,
                            round_robin_count, row_tiles, store_rows, transposed)
from .tiles import FwdTiles

SCALE_BLOCK = 128
# 128 x 128 tiles, 128 of the contraction per stage (one scale block), 32 KB a
# stage: 5 stages and the 32 KB epilogue buffer fit in shared memory.
FP8_TILES = FwdTiles(block_m=128, block_n=128, block_k=128, stages=5, band=4)


def check_fp8_nt(x, xs, v, vs, tiles=FP8_TILES):
    """None if the kernel runs these operands, else why not."""
    m, kc = x.shape
    if x.dtype != jnp.float8_e4m3fn or v.dtype != jnp.float8_e4m3fn:
        return f"fp8 kernel needs float8_e4m3fn operands, got {x.dtype} and {v.dtype}"
    if v.ndim != 3 or v.shape[2] != kc:
        return f"v must be [G, Nout, {kc}], got {v.shape}"
    n = v.shape[1]
    if tiles.block_k != SCALE_BLOCK or tiles.block_m % 128 or tiles.block_n % 64:
        return f"fp8 tiles need block_k 128, block_m a multiple of 128, got {tiles}"
    if kc % SCALE_BLOCK or n % tiles.block_n or n % SCALE_BLOCK:
        return f"Kc ({kc}) must be a multiple of 128 and Nout ({n}) of {tiles.block_n}"
    if m % 8 or m < tiles.block_m:
        return f"M ({m}) must be a multiple of 8 and at least {tiles.block_m}"
    if xs.shape != (m, kc // SCALE_BLOCK) or vs.shape != (v.shape[0], n // SCALE_BLOCK, kc // SCALE_BLOCK):
        return f"scales {xs.shape} / {vs.shape} do not match x {x.shape} / v {v.shape}"
    return None


def gmm_fp8_nt(x, xs, v, vs, offsets, *, tiles=None, out_dtype=None, interpret=False):
    """``[M, Nout]`` in ``out_dtype`` (default bfloat16; see the module docstring)."""
    tiles = tiles or FP8_TILES
    err = check_fp8_nt(x, xs, v, vs, tiles)
    if err is not None:
        raise ValueError(f"gmm_fp8_nt: {err}")
    out_dtype = jnp.dtype(out_dtype or jnp.bfloat16)
    m, kc = x.shape
    rs, r0, r1, grp = row_tiles(offsets, m, tiles.block_m)
    used = r1 > r0
    counts = jnp.stack([jnp.sum(used & (grp >= 0)), jnp.sum(used & (grp < 0))]).astype(jnp.int32)
    # step k's scales of the rows r at k * M + r: one contiguous run per tile and step
    xs_flat = xs.astype(jnp.float32).T.reshape(-1)
    kernel = _kernel(m, kc, v.shape[1], tiles, out_dtype, interpret)
    return kernel(counts, rs, r0, r1, grp, vs.astype(jnp.float32), x, v, xs_flat)


def _kernel(m, kc, n, tiles, out_dtype, interpret):
    pl, plgpu = pallas_modules()
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    half = bm // 2                      # rows of one consumer warpgroup
    grid_n, ksteps = n // bn, kc // bk
    nsm = num_sms(interpret)
    tr, _ = dw_transforms(plgpu, jnp.float8_e4m3fn, bk, bn)

    def body(cnt_ref, rs_ref, r0_ref, r1_ref, g_ref, vs_ref, x_ref, v_ref, xs_ref, o_ref):
        sm = lax.axis_index("sm")
        n_grp = cnt_ref[0]

        def tile(j):   # this SM's j-th tile -> (row tile, column tile)
            return plgpu.planar_snake(sm + j * nsm, (n_grp, grid_n), 0, tiles.band)

        def row0(j):
            return pl.multiple_of(rs_ref[tile(j)[0]], 8)

        def v_index(j, kk):
            fi, ni = tile(j)
            return jnp.maximum(g_ref[fi], 0), ni, kk

        def scoped(o_smem):
            wg = lax.axis_index("wg")
            store = _tile_store(pl, plgpu, o_smem, o_ref, rs_ref, r0_ref, r1_ref, wg, half, bn)
            step = _promoting_step(pl, plgpu, tile, g_ref, vs_ref, store, wg, half, bn, ksteps)
            mine = round_robin_count(n_grp * grid_n, sm, nsm)

            @pl.when(mine > 0)
            def _():
                plgpu.emit_pipeline_warp_specialized(
                    step, grid=(mine, ksteps), memory_registers=40,
                    in_specs=[plgpu.BlockSpec((pl.Element(bm), bk), lambda j, kk: (row0(j), kk),
                                              transforms=tr),
                              plgpu.BlockSpec((None, bn, bk), v_index, transforms=tr),
                              plgpu.BlockSpec((pl.Element(bm),), lambda j, kk: (kk * m + row0(j),))],
                    wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=tiles.stages,
                    compute_context=lambda run: run(
                        plgpu.layout_cast(jnp.zeros((half, bn), jnp.float32), plgpu.Layout.WGMMA)),
                )(x_ref, v_ref, xs_ref)

            @pl.when(wg < 2)
            def _():   # tail tiles (rows past the groups): zeros, no matmul
                @pl.loop(0, round_robin_count(cnt_ref[1] * grid_n, sm, nsm))
                def _(j):
                    t = sm + j * nsm
                    store(n_grp + lax.div(t, jnp.int32(grid_n)), lax.rem(t, jnp.int32(grid_n)),
                          jnp.zeros((half, bn), jnp.float32))

                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((2, half, bn), out_dtype), collective_axes="wg")

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(nsm,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        **kernel_params(plgpu, interpret),
    )


def _promoting_step(pl, plgpu, tile, g_ref, vs_ref, store, wg, half, bn, ksteps):
    """The consumer's pipeline step: this k-step's product of its ``half`` rows
    into a fresh accumulator, scaled and added to the carried f32 sum; on the
    tile's last k-step the sum is stored."""
    def step(idx, x_smem, v_smem, xs_smem, acc):
        j, kk = idx
        fi, ni = tile(j)
        w_scale = vs_ref[jnp.maximum(g_ref[fi], 0), ni, kk]   # read before the MMA: hides the load

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, x_smem.at[pl.ds(wg * half, half)], transposed(plgpu, v_smem))
            return acc_ref[...]

        part = pl.run_scoped(mma, plgpu.ACC((half, bn)))
        x_scale = plgpu.load(xs_smem.at[pl.ds(wg * half, half)], (),
                             layout=plgpu.Layout.WGMMA.reduce(1))
        part = part * lax.broadcast_in_dim(x_scale * w_scale, (half, bn), [0])
        # a tile's first k-step starts the sum: a select, never a multiply by
        # zero (rows outside the tile's groups may hold NaN)
        first = plgpu.layout_cast(lax.broadcast(kk == 0, (half, bn)), plgpu.Layout.WGMMA)
        acc = jnp.where(first, part, acc + part)

        @pl.when(kk == ksteps - 1)
        def _():
            store(fi, ni, acc)
        return acc
    return step


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
