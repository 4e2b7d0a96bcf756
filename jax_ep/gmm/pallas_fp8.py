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
``block_m x block_n`` output tile (128 x 256: 175 flops per staged byte, which
keeps the L2 -> shared-memory traffic under what the fp8 rate asks); each
consumer takes half of its rows and computes its ``block_m / 2 x block_n`` in
128-column parts, one weight-scale block each, one after the other, so only
one part's product is live beside the f32 sum (64 + 128 registers a thread).
"""
from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
from jax import lax

from .pallas_common import (dw_transforms, kernel_params, num_sms, pallas_modules,
                            round_robin_count, row_tiles, store_rows, transposed)
from .devices import device_info
from .tiles import FwdTiles

SCALE_BLOCK = 128
PART = 128           # output columns per promoted product (one weight-scale block)
# 128 x 256 tiles, 128 of the contraction per stage (one scale block), 48.5 KB
# a stage: 4 stages and a bf16 epilogue buffer fit in shared memory (f32: 3).
FP8_TILES = FwdTiles(block_m=128, block_n=256, block_k=128, stages=4, band=4)
SCALE_ROW = 32       # f32 weight scales staged per 128 columns: a multiple of 128 bytes
SMEM_SLACK = 2048    # the pipeline's barriers and alignment (measured: about 1.2 KB)


def fp8_stages(tiles, kc: int, out_dtype, smem_bytes: int) -> int:
    """The most pipeline stages (at most ``tiles.stages``) that fit beside the
    epilogue buffer (one ``64 x 128`` part per consumer). A stage: the x and
    v tiles, the rows' scales and the tile's weight scales."""
    kbp = -(-kc // SCALE_BLOCK // SCALE_ROW) * SCALE_ROW
    stage = (tiles.block_m * tiles.block_k + tiles.block_n * tiles.block_k + 4 * tiles.block_m
             + 4 * (tiles.block_n // PART) * kbp)
    epilogue = 2 * (tiles.block_m // 2) * PART * jnp.dtype(out_dtype).itemsize
    return max(1, min(tiles.stages, (smem_bytes - SMEM_SLACK - epilogue) // stage))


def check_fp8_nt(x, xs, v, vs, tiles=FP8_TILES):
    """None if the kernel runs these operands, else why not."""
    m, kc = x.shape
    if x.dtype != jnp.float8_e4m3fn or v.dtype != jnp.float8_e4m3fn:
        return f"fp8 kernel needs float8_e4m3fn operands, got {x.dtype} and {v.dtype}"
    if v.ndim != 3 or v.shape[2] != kc:
        return f"v must be [G, Nout, {kc}], got {v.shape}"
    n = v.shape[1]
    if tiles.block_k != SCALE_BLOCK or tiles.block_m != 128 or tiles.block_n % PART:
        return f"fp8 tiles need block_k 128, block_m 128, block_n a multiple of 128, got {tiles}"
    if kc % SCALE_BLOCK or n % tiles.block_n or n % SCALE_BLOCK:
        return f"Kc ({kc}) must be a multiple of 128 and Nout ({n}) of {tiles.block_n}"
    if m % 8 or m < tiles.block_m:
        return f"M ({m}) must be a multiple of 8 and at least {tiles.block_m}"
    if xs.shape != (m, kc // SCALE_BLOCK) or vs.shape != (v.shape[0], n // SCALE_BLOCK, kc // SCALE_BLOCK):
        return f"scales {xs.shape} / {vs.shape} do not match x {x.shape} / v {v.shape}"
    return None


def gmm_fp8_nt(x, xs, v, vs, offsets, *, tiles=None, out_dtype=None, interpret=False,
               overlap=False, staged_scales=True):
    """``[M, Nout]`` in ``out_dtype`` (default bfloat16; see the module docstring)."""
    if tiles is None:   # 128-column tiles where N is not a multiple of 256
        tiles = FP8_TILES if v.shape[1] % FP8_TILES.block_n == 0 else dataclasses.replace(
            FP8_TILES, block_n=PART)
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
    # a tile's weight scales come with each stage, one row of SCALE_ROW per
    # 128 columns (a scalar load from HBM per k-step would stall the consumer
    # for its latency); rows of 128 bytes keep the stage buffers aligned
    kb = kc // SCALE_BLOCK
    vs = jnp.pad(vs.astype(jnp.float32), ((0, 0), (0, 0), (0, -kb % SCALE_ROW))).reshape(-1)
    stages = fp8_stages(tiles, kc, out_dtype, device_info().smem_per_block)
    kernel = _kernel(m, kc, v.shape[1], dataclasses.replace(tiles, stages=stages), out_dtype,
                     interpret, overlap and tiles.block_n == PART, staged_scales)
    return kernel(counts, rs, r0, r1, grp, x, v, xs_flat, vs)


def _kernel(m, kc, n, tiles, out_dtype, interpret, overlap, staged):
    pl, plgpu = pallas_modules()
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    half = bm // 2                      # rows of one consumer warpgroup
    parts = bn // PART
    grid_n, ksteps = n // bn, kc // bk
    nsm = num_sms(interpret)
    tr, _ = dw_transforms(plgpu, jnp.float8_e4m3fn, bk, bn)

    kbp = ksteps + (-ksteps % SCALE_ROW)
    nb = n // PART

    def body(cnt_ref, rs_ref, r0_ref, r1_ref, g_ref, x_ref, v_ref, xs_ref, vs_ref, o_ref):
        sm = lax.axis_index("sm")
        n_grp = cnt_ref[0]

        def tile(j):   # this SM's j-th tile -> (row tile, column tile)
            return plgpu.planar_snake(sm + j * nsm, (n_grp, grid_n), 0, tiles.band)

        def row0(j):
            return pl.multiple_of(rs_ref[tile(j)[0]], 8)

        def v_index(j, kk):
            fi, ni = tile(j)
            return jnp.maximum(g_ref[fi], 0), ni, kk

        def vs_index(j, kk):   # element offset of the tile's first scale row
            g, ni, _ = v_index(j, kk)
            return ((g * nb + ni * parts) * kbp,)

        def w_scale(vs_smem, j, p, kk):   # staged, or read from HBM
            if staged:
                return vs_smem[p * kbp + kk]
            return vs_ref[vs_index(j, kk)[0] + p * kbp + kk]

        def scoped(o_smem):
            wg = lax.axis_index("wg")
            store = _tile_store(pl, plgpu, o_smem, o_ref, rs_ref, r0_ref, r1_ref, wg, half, bn)
            step = (_overlapped_step(pl, plgpu, tile, w_scale, store, wg, half, ksteps) if overlap
                    else _promoting_step(pl, plgpu, tile, w_scale, store, wg, half, parts, ksteps))
            if not staged:
                step = _without_scale_stage(step)
            mine = round_robin_count(n_grp * grid_n, sm, nsm)

            @pl.when(mine > 0)
            def _():
                plgpu.emit_pipeline_warp_specialized(
                    step, grid=(mine, ksteps), memory_registers=40,
                    in_specs=[plgpu.BlockSpec((pl.Element(bm), bk), lambda j, kk: (row0(j), kk),
                                              transforms=tr),
                              plgpu.BlockSpec((None, bn, bk), v_index, transforms=tr),
                              plgpu.BlockSpec((pl.Element(bm),), lambda j, kk: (kk * m + row0(j),)),
                              plgpu.BlockSpec((pl.Element(parts * kbp),), vs_index)][:4 if staged else 3],
                    wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=tiles.stages,
                    compute_context=lambda run: run(_zero_carry(plgpu, half, parts, overlap)),
                )(x_ref, v_ref, xs_ref, *([vs_ref] if staged else []))

            @pl.when(wg < 2)
            def _():   # tail tiles (rows past the groups): zeros, no matmul
                @pl.loop(0, round_robin_count(cnt_ref[1] * grid_n, sm, nsm))
                def _(j):
                    t = sm + j * nsm
                    store(n_grp + lax.div(t, jnp.int32(grid_n)), lax.rem(t, jnp.int32(grid_n)),
                          (jnp.zeros((half, PART), jnp.float32),) * parts)

                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((2, half, PART), out_dtype), collective_axes="wg")

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(nsm,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        **kernel_params(plgpu, interpret),
    )


def _without_scale_stage(step):
    def unstaged(idx, x_smem, v_smem, xs_smem, carry):
        return step(idx, x_smem, v_smem, xs_smem, None, carry)
    return unstaged


def _promoting_step(pl, plgpu, tile, w_scale, store, wg, half, parts, ksteps):
    """The consumer's pipeline step: for each 128-column part, this k-step's
    product of its ``half`` rows into a fresh accumulator, scaled and added to
    the part's carried f32 sum; on the tile's last k-step the sums are stored."""
    def step(idx, x_smem, v_smem, xs_smem, vs_smem, acc):
        j, kk = idx
        fi, ni = tile(j)
        w_scales = [w_scale(vs_smem, j, p, kk) for p in range(parts)]
        x_scale = _load_rows(plgpu, xs_smem.at[pl.ds(wg * half, half)])
        # a tile's first k-step starts the sums: a select, never a multiply by
        # zero (rows outside the tile's groups may hold NaN)
        first = plgpu.layout_cast(lax.broadcast(kk == 0, (half, PART)), plgpu.Layout.WGMMA)
        out = []
        for p in range(parts):
            def mma(acc_ref, p=p):
                plgpu.wgmma(acc_ref, x_smem.at[pl.ds(wg * half, half)],
                            transposed(plgpu, v_smem.at[pl.ds(p * PART, PART)]))
                return acc_ref[...]

            prod = pl.run_scoped(mma, plgpu.ACC((half, PART)))
            prod = prod * lax.broadcast_in_dim(x_scale * w_scales[p], (half, PART), [0])
            out.append(jnp.where(first, prod, acc[p] + prod))
        out = tuple(out)

        @pl.when(kk == ksteps - 1)
        def _():
            store(fi, ni, out)
        return out
    return step


def _zero_carry(plgpu, half, parts, overlap):
    def zeros():
        return plgpu.layout_cast(jnp.zeros((half, PART), jnp.float32), plgpu.Layout.WGMMA)
    if overlap:   # (sum, previous step's product, its row scales)
        return zeros(), zeros(), plgpu.layout_cast(jnp.zeros((half,), jnp.float32),
                                                   plgpu.Layout.WGMMA.reduce(1))
    return tuple(zeros() for _ in range(parts))


def _overlapped_step(pl, plgpu, tile, w_scale, store, wg, half, ksteps):
    """As :func:`_promoting_step` for one 128-column part, with the previous
    k-step's product added to the sum while this step's WGMMA runs (the
    carry holds it and its scales: 64 more registers a thread)."""
    def step(idx, x_smem, v_smem, xs_smem, vs_smem, carry):
        acc, prev, prev_scale = carry
        j, kk = idx
        fi, ni = tile(j)
        scale = _load_rows(plgpu, xs_smem.at[pl.ds(wg * half, half)]) * w_scale(vs_smem, j, 0, kk)
        first = plgpu.layout_cast(lax.broadcast(kk == 0, (half, PART)), plgpu.Layout.WGMMA)

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, x_smem.at[pl.ds(wg * half, half)], transposed(plgpu, v_smem))
            # the previous product joins the sum while the tensor cores work; a
            # tile's first step drops it (it was the last tile's, already stored)
            folded = acc + prev * lax.broadcast_in_dim(prev_scale, (half, PART), [0])
            return acc_ref[...], jnp.where(first, jnp.zeros_like(acc), folded)

        prod, acc = pl.run_scoped(mma, plgpu.ACC((half, PART)))

        @pl.when(kk == ksteps - 1)
        def _():
            store(fi, ni, (acc + prod * lax.broadcast_in_dim(scale, (half, PART), [0]),))
        return acc, prod, scale
    return step


def _load_rows(plgpu, ref):
    """A per-row vector in the WGMMA accumulator's row layout (jax 0.10's
    ``load`` takes an index; 0.11 deprecates it)."""
    layout = plgpu.Layout.WGMMA.reduce(1)
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _tile_store(pl, plgpu, o_smem, o_ref, rs_ref, r0_ref, r1_ref, wg, half, bn):
    """``store(fi, ni, parts)``: a consumer's ``half x bn`` rows of tile
    ``(fi, ni)`` (``bn / 128`` parts) to HBM, only rows inside ``[lo, hi)``."""
    top = 1 << (half.bit_length() - 1)

    def store(fi, ni, parts):
        lo, hi = r0_ref[fi], r1_ref[fi]
        c0 = pl.multiple_of(rs_ref[fi], 8) + wg * half
        for p, val in enumerate(parts):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # our slot is free
            o_smem[wg] = val.astype(o_smem.dtype)
            plgpu.commit_smem()
            col = pl.multiple_of(ni * bn + p * PART, PART)
            store_rows(pl, plgpu, o_smem.at[wg], o_ref.at[:, pl.ds(col, PART)],
                       jnp.clip(lo, c0, c0 + half), jnp.clip(hi, c0, c0 + half), c0, top)
    return store
