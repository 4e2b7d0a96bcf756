"""Forward / dx Pallas kernels: ``out[rows of g] = x[rows of g] @ w[g]`` (or ``w[g]^T``),
per-group row tiles; one warpgroup, or a producer and two consumer warpgroups
(one pipeline per SM across its tiles)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .pallas_common import (EPILOGUE_ROWS, carried_acc_context, dw_transforms,
                            flush_on_last_step, kernel_params, num_sms, pallas_modules,
                            round_robin_count, row_tile_table, row_tiles, spans_of,
                            store_rows, store_tail_tiles, tile_at, transposed,
                            two_consumer_kernel)


def gmm_pallas(x, w, offsets, transpose_rhs, tiles, out_dtype, interpret):
    pl, plgpu = pallas_modules()
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    steps, band = tiles.stages, tiles.band
    m, k = x.shape
    if transpose_rhs:
        _, n, k2 = w.shape     # w [G, N_out, K_contract]
    else:
        _, k2, n = w.shape
    assert k == k2, (x.shape, w.shape, transpose_rhs)
    rs, r0, r1, grp = row_tiles(offsets, m, bm)
    spans = spans_of(grp, band)
    nf = r0.shape[0]
    grid_n = n // bn
    top = 1 << int(math.log2(bm))     # largest power of two <= bm

    def body(rs_ref, r0_ref, r1_ref, g_ref, *refs):
        *span_refs, x_ref, w_ref, o_ref = refs

        @plgpu.nd_loop((nf * grid_n,), collective_axes="sm")
        def _item(info):
            fi, ni = tile_at(plgpu, info.index[0], (nf, grid_n), band, span_refs)
            lo = r0_ref[fi]
            hi = r1_ref[fi]
            g = g_ref[fi]

            @pl.when(hi > lo)
            def _():
                row0 = pl.multiple_of(rs_ref[fi], 8)

                def mma_scope(acc_ref):
                    @pl.when(g >= 0)
                    def _():
                        def step(_, x_smem, w_smem):
                            rhs = transposed(plgpu, w_smem) if transpose_rhs else w_smem
                            plgpu.wgmma(acc_ref, x_smem, rhs)

                        w_spec = (plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk), delay_release=1)
                                  if transpose_rhs else
                                  plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=1))
                        plgpu.emit_pipeline(
                            step,
                            grid=(k // bk,),
                            in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk),
                                                      delay_release=1), w_spec],
                            max_concurrent_steps=steps,
                        )(x_ref.at[pl.ds(row0, bm), :], w_ref.at[jnp.maximum(g, 0)])
                    return acc_ref[...]

                acc = pl.run_scoped(mma_scope, plgpu.ACC((bm, bn)))

                def store_scope(o_smem):
                    o_smem[...] = acc.astype(o_smem.dtype)
                    plgpu.commit_smem()
                    store_rows(pl, plgpu, o_smem, o_ref.at[:, pl.ds(ni * bn, bn)], lo, hi,
                                row0, top)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                pl.run_scoped(store_scope, plgpu.SMEM((bm, bn), out_dtype))

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_sms(interpret),),
        grid_names=("sm",),
        **kernel_params(plgpu, interpret),
    )
    return kernel(rs, r0, r1, grp, *spans, x, w)


def _ws_store(pl, plgpu, o_smem, o_ref, row_refs, wg, bm, bn):
    """``store(fi, ni, val)``: consumer ``wg``'s ``bm x bn`` f32 half of the
    output tile (row tile ``fi``, column tile ``ni``) to HBM through its one
    shared-memory slot, in ``EPILOGUE_ROWS`` row chunks, one after the other;
    only the row tile's rows ``[lo, hi)`` are stored."""
    rs_ref, r0_ref, r1_ref = row_refs
    rows = EPILOGUE_ROWS
    top = 1 << int(math.log2(rows))

    def store(fi, ni, val):
        lo, hi = r0_ref[fi], r1_ref[fi]
        row0 = pl.multiple_of(rs_ref[fi], 8)
        col = pl.multiple_of(ni * (2 * bn) + wg * bn, bn)
        for c in range(bm // rows):   # the tile's row chunks, one after the other
            c0 = row0 + c * rows
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # our slot is free
            o_smem[wg] = val[c * rows:(c + 1) * rows].astype(o_smem.dtype)
            plgpu.commit_smem()
            store_rows(pl, plgpu, o_smem.at[wg], o_ref.at[:, pl.ds(col, bn)],
                       jnp.clip(lo, c0, c0 + rows), jnp.clip(hi, c0, c0 + rows), c0, top)
    return store


def _ws_step(pl, plgpu, wg, tile, store, ksteps, bm, bn, transpose_rhs, interpret):
    """Pipeline body of the 2-consumer forward/dx kernel: consumer ``wg``'s
    wgmma on its ``block_n`` half of the staged ``w`` tile; on a tile's last
    k-step store the accumulator and reset it."""
    def step(idx, x_smem, w_smem, carry):
        j, kk = idx
        acc_ref = carry[0] if interpret else carry
        cols = pl.ds(pl.multiple_of(wg * bn, bn), bn)
        rhs = (transposed(plgpu, w_smem.at[cols, :]) if transpose_rhs
               else w_smem.at[:, cols])
        plgpu.wgmma(acc_ref, x_smem, rhs)
        # wait(0), no delay_release: a stage held one step longer for an
        # in-flight wgmma is a stage fewer of loads in flight (measured:
        # with delay_release=1 and 3 stages, 5-30% slower than per-tile).
        plgpu.wgmma_wait(0)
        return flush_on_last_step(pl, plgpu, carry, kk == ksteps - 1,
                                  lambda val: store(*tile(j), val), interpret, (bm, bn))
    return step


def gmm_pallas_ws(x, w, offsets, transpose_rhs, tiles, out_dtype, interpret):
    """Forward / dx with two consumer warpgroups and a producer warpgroup,
    ONE pipeline per SM across all of its tiles.

    Per-group row tiles (``row_tiles``, as :func:`gmm_pallas`); a CTA owns
    ``block_m x 2 block_n`` of the output (each consumer warpgroup one
    ``block_m x block_n`` half, sharing the staged ``x`` tile). The SM's tiles
    (dealt round-robin) and their k-steps form a single warp-specialized
    pipeline of grid ``(tiles of this SM, K / block_k)``: the producer loads the
    next tile's first stages while the consumers store and reset the previous
    tile's accumulator, so no tile pays a pipeline fill with nothing in flight.
    Row offsets of tiles are 8-aligned element offsets (``pl.Element``), read
    from the tile table in the index maps. Tail tiles (rows past the groups)
    store zeros after the pipeline. Against a pipeline per tile (deleted,
    bench/results/README.md): the V3 layer at T 128 1-3% faster, at T 4096
    equal; outputs bit-identical. The output tile goes to HBM in
    ``EPILOGUE_ROWS`` row chunks.
    """
    pl, plgpu = pallas_modules()
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    steps, band = tiles.stages, tiles.band
    m, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    tables = row_tile_table(offsets, m, bm)
    tables += spans_of(tables[4], band)
    grid_n, ksteps = n // (2 * bn), k // bk
    nsm = num_sms(interpret)
    tr, _ = dw_transforms(plgpu, x.dtype, bk, bn)
    w_block = (None, 2 * bn, bk) if transpose_rhs else (None, bk, 2 * bn)

    def body(cnt_ref, rs_ref, r0_ref, r1_ref, g_ref, *refs):
        *span_refs, x_ref, w_ref, o_ref = refs
        sm = lax.axis_index("sm")
        n_grp = cnt_ref[0]

        def tile(j):   # this SM's j-th tile -> (row tile, column tile)
            return tile_at(plgpu, sm + j * nsm, (n_grp, grid_n), band, span_refs)

        def x_index(j, kk):
            return pl.multiple_of(rs_ref[tile(j)[0]], 8), kk

        def w_index(j, kk):
            fi, ni = tile(j)
            g = jnp.maximum(g_ref[fi], 0)
            return (g, ni, kk) if transpose_rhs else (g, kk, ni)

        def scoped(o_smem):
            wg = lax.axis_index("wg")
            store = _ws_store(pl, plgpu, o_smem, o_ref, (rs_ref, r0_ref, r1_ref), wg, bm, bn)
            step = _ws_step(pl, plgpu, wg, tile, store, ksteps, bm, bn, transpose_rhs,
                            interpret)
            mine = round_robin_count(n_grp * grid_n, sm, nsm)

            @pl.when(mine > 0)
            def _():
                plgpu.emit_pipeline_warp_specialized(
                    step, grid=(mine, ksteps), memory_registers=40,
                    in_specs=[plgpu.BlockSpec((pl.Element(bm), bk), x_index, transforms=tr),
                              plgpu.BlockSpec(w_block, w_index, transforms=tr)],
                    wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps,
                    compute_context=carried_acc_context(pl, plgpu, (bm, bn), interpret),
                )(x_ref, w_ref)

            @pl.when(wg < 2)
            def _():
                store_tail_tiles(pl, plgpu, cnt_ref, n_grp, store, sm, nsm, grid_n, (bm, bn))

        pl.run_scoped(scoped, plgpu.SMEM((2, EPILOGUE_ROWS, bn), out_dtype),
                      collective_axes="wg")

    kernel = two_consumer_kernel(plgpu, body, (m, n), out_dtype, nsm, 1, interpret)
    return kernel(*tables, x, w)
