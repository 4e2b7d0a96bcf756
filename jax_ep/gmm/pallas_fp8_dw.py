"""FP8 dw kernel (Pallas Mosaic GPU, Hopper): a contraction cut into groups
along its length, both operands fp8-e4m3 and K-major, per-row scales for each
128 of the contraction on both sides, f32 accumulation.

``out[g] = Σ_{b in segment g} (a[:, b] · as[b]) @ (c[:, b] · cs[b])^T``

- ``a`` ``[Ka, P]`` e4m3, ``as`` ``[P/128, Ka]`` f32 (per 128-column block, per row);
- ``c`` ``[Nc, P]`` e4m3, ``cs`` ``[P/128, Nc]`` f32;
- ``segments`` int32 ``[G+1]``: group ``g`` owns columns ``[segments[g],
  segments[g+1])`` of ``P``, multiples of 128 (``fp8_columns``: the rows of
  ``x`` and ``dy`` regrouped so each group starts on a block, transposed, the
  gaps zero);
- ``out`` ``[G, Ka, Nc]``; an empty group's ``out[g]`` is zero.

dw of the fp8 path is ``a = x^T``, ``c = dy^T``: ``dw[g] = x[rows of g]^T
@ dy[rows of g]``. fp8 WGMMA takes K-major operands only, so both come
transposed, and a scale that varies along the contraction has to be per
128-block of it: the forward's per-row scales of ``x`` vary along dw's
contraction, hence the recast (DeepSeek-V3 recasts its backward activations
the same way).

Promotion as ``pallas_fp8``: each 128-wide k-step's WGMMA runs into a fresh
f32 accumulator, which is scaled by ``as[b, row] * cs[b, col]`` (an outer
product: a multiply and an FMA per register) and added to the tile's sum.

Structure as ``pallas_dw.tgmm_pallas_ws``: a producer warpgroup and two
consumers; per group, one warp-specialized pipeline over this SM's tiles of
``out[g]`` (dealt round-robin, rotated per group) and the group's k-steps. A
CTA owns a ``128 x 128`` tile, each consumer 64 of its rows.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from ..fp8 import FP8_BLOCK
from .devices import device_info
from .pallas_common import (dealt_tiles, dw_transforms, num_sms, pallas_modules, transposed,
                            two_consumer_kernel)
from .pallas_fp8 import load_vector, stages_that_fit, zero_sum
from .tiles import FwdTiles

# 128 x 128 tiles, one scale block of the contraction per stage: 33 KB a stage
DW8_TILES = FwdTiles(block_m=128, block_n=128, block_k=128, stages=5, band=4)


def dw8_stages(tiles, out_dtype, smem_bytes: int) -> int:
    """The most stages (at most ``tiles.stages``) beside the output slots
    (each consumer's rows of the tile): a stage holds both tiles and a row of
    scales for each."""
    return stages_that_fit(tiles, 4 * (tiles.block_m + tiles.block_n), out_dtype, smem_bytes)


def check_fp8_dw(a, a_s, c, c_s, segments=None, tiles=DW8_TILES):
    """None if the kernel runs these operands, else why not."""
    if a.dtype != jnp.float8_e4m3fn or c.dtype != jnp.float8_e4m3fn:
        return f"fp8 dw kernel needs float8_e4m3fn operands, got {a.dtype} and {c.dtype}"
    if a.ndim != 2 or c.ndim != 2 or a.shape[1] != c.shape[1]:
        return f"a [Ka, P] and c [Nc, P] must share P, got {a.shape} and {c.shape}"
    (ka, p), nc = a.shape, c.shape[0]
    if (tiles.block_m, tiles.block_n, tiles.block_k) != (128, 128, 128):
        return f"fp8 dw tiles are 128 x 128 x 128, got {tiles}"
    if ka % tiles.block_m or nc % tiles.block_n or p % FP8_BLOCK:
        return f"Ka ({ka}), Nc ({nc}) and P ({p}) must be multiples of 128"
    if a_s.shape != (p // FP8_BLOCK, ka) or c_s.shape != (p // FP8_BLOCK, nc):
        return f"scales {a_s.shape} / {c_s.shape} do not match a {a.shape} / c {c.shape}"
    if segments is not None and (segments.ndim != 1 or segments.shape[0] < 2):
        return f"segments must be [G+1], got {segments.shape}"
    return None


def tgmm_fp8_nt(a, a_s, c, c_s, segments, *, tiles=None, out_dtype=None, interpret=False):
    """``[G, Ka, Nc]`` in ``out_dtype`` (default bfloat16; see the module docstring)."""
    tiles = tiles or DW8_TILES
    err = check_fp8_dw(a, a_s, c, c_s, segments, tiles)
    if err is not None:
        raise ValueError(f"tgmm_fp8_nt: {err}")
    out_dtype = jnp.dtype(out_dtype or jnp.bfloat16)
    stages = dw8_stages(tiles, out_dtype, device_info().smem_per_block)
    kernel = _kernel(a.shape[0], c.shape[0], segments.shape[0] - 1,
                     dataclasses.replace(tiles, stages=stages), out_dtype, interpret)
    # block b's scales of a tile's rows: one contiguous run per tile and step
    return kernel(segments.astype(jnp.int32), a, c, a_s.astype(jnp.float32).reshape(-1),
                  c_s.astype(jnp.float32).reshape(-1))


@dataclasses.dataclass(frozen=True)
class _Static:
    ka: int
    nc: int
    bm: int
    bn: int
    half: int           # rows of one consumer warpgroup
    grid_n: int
    n_tiles: int        # tiles of one out[g]
    units: int          # the CTAs the tiles are dealt to
    band: int
    stages: int


def _kernel(ka, nc, g_count, tiles, out_dtype, interpret):
    pl, plgpu = pallas_modules()
    bm, bn = tiles.block_m, tiles.block_n
    st = _Static(ka, nc, bm, bn, bm // 2, nc // bn, (ka // bm) * (nc // bn), num_sms(interpret),
                 tiles.band, tiles.stages)

    def body(seg_ref, a_ref, c_ref, as_ref, cs_ref, o_ref):
        def scoped(o_smem):
            wg = lax.axis_index("wg")
            store = _tile_store(pl, plgpu, o_smem, o_ref, st, wg)

            def group(g, carry):
                _group(pl, plgpu, st, g, seg_ref, (a_ref, c_ref, as_ref, cs_ref), store, wg)
                return carry

            lax.fori_loop(0, g_count, group, jnp.int32(0))

            @pl.when(wg < 2)
            def _():
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((2, st.half, bn), out_dtype), collective_axes="wg")

    return two_consumer_kernel(plgpu, body, (g_count, ka, nc), out_dtype, st.units, 1, interpret)


def _tile_of(plgpu, st):
    """``t -> (row tile, column tile)`` of ``out[g]`` along a snake of ``band`` row tiles."""
    return lambda t: plgpu.planar_snake(t, (st.ka // st.bm, st.grid_n), 0, st.band)


def _group(pl, plgpu, st, g, seg_ref, gmem, store, wg):
    """Group ``g`` on this SM: one pipeline over its tiles here and its k-steps;
    zeros for an empty group."""
    blk0 = lax.div(seg_ref[g], jnp.int32(FP8_BLOCK))
    nsteps = lax.div(seg_ref[g + 1], jnp.int32(FP8_BLOCK)) - blk0
    t0, cnt = dealt_tiles(g, st.n_tiles, st.units)
    tile_of = _tile_of(plgpu, st)

    def tile(j):
        return tile_of(t0 + j * st.units)

    @pl.when((nsteps > 0) & (cnt > 0))
    def _():
        step = _promoting_step(pl, plgpu, st, tile, store, g, wg, nsteps)
        plgpu.emit_pipeline_warp_specialized(
            step, grid=(cnt, nsteps), memory_registers=40, in_specs=_in_specs(pl, plgpu, st, tile,
                                                                             blk0),
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=st.stages,
            compute_context=lambda run: run(zero_sum(plgpu, st.half, st.bn)),
        )(*gmem)

    @pl.when((nsteps <= 0) & (cnt > 0) & (wg < 2))
    def _():
        @pl.loop(0, cnt)
        def _(j):
            mi, ni = tile(j)
            store(g, mi, ni, jnp.zeros((st.half, st.bn), jnp.float32))


def _in_specs(pl, plgpu, st, tile, blk0):
    """Per (tile ``j``, k-step ``s``): the a and c tiles of block ``blk0 + s``
    and that block's scales of the tile's rows and columns."""
    bm, bn, bk = st.bm, st.bn, FP8_BLOCK
    tr, _ = dw_transforms(plgpu, jnp.float8_e4m3fn, bk, bn)
    return [plgpu.BlockSpec((bm, bk), lambda j, s: (tile(j)[0], blk0 + s), transforms=tr),
            plgpu.BlockSpec((bn, bk), lambda j, s: (tile(j)[1], blk0 + s), transforms=tr),
            plgpu.BlockSpec((pl.Element(bm),),
                            lambda j, s: ((blk0 + s) * st.ka + tile(j)[0] * bm,)),
            plgpu.BlockSpec((pl.Element(bn),),
                            lambda j, s: ((blk0 + s) * st.nc + tile(j)[1] * bn,))]


def _promoting_step(pl, plgpu, st, tile, store, g, wg, nsteps):
    """The consumer's step: this block's product of its rows into a fresh
    accumulator; while the WGMMA runs, a tile's first step drops the carried
    sum; then the product times the outer product of the rows' and columns'
    scales is added. On the tile's last step the sum is stored."""
    half = st.half

    def step(idx, a_smem, c_smem, as_smem, cs_smem, acc):
        j, s = idx
        rows = a_smem.at[pl.ds(wg * half, half)]
        shape = acc.shape
        rs = lax.broadcast_in_dim(load_vector(plgpu, as_smem.at[pl.ds(wg * half, half)], 0),
                                  shape, [0])
        cs = lax.broadcast_in_dim(load_vector(plgpu, cs_smem, 1), shape, [1])
        first = plgpu.layout_cast(lax.broadcast(s == 0, shape), plgpu.Layout.WGMMA)

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, rows, transposed(plgpu, c_smem))
            kept = jnp.where(first, jnp.zeros_like(acc), acc)   # under the WGMMA
            return acc_ref[...], kept

        prod, kept = pl.run_scoped(mma, plgpu.ACC(shape))
        acc = kept + (prod * rs) * cs

        @pl.when(s == nsteps - 1)
        def _():
            mi, ni = tile(j)
            store(g, mi, ni, acc)
        return acc
    return step


def _tile_store(pl, plgpu, o_smem, o_ref, st, wg):
    """``store(g, mi, ni, val)``: a consumer's ``half x bn`` rows of tile
    ``(mi, ni)`` of ``out[g]`` to HBM through its slot."""
    def store(g, mi, ni, val):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # our slot is free
        o_smem[wg] = val.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem.at[wg], o_ref.at[g, pl.ds(mi * st.bm + wg * st.half, st.half),
                                    pl.ds(ni * st.bn, st.bn)])
    return store
