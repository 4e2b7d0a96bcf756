"""dw Pallas kernels: ``dw[g] = x[rows of g]^T @ dy[rows of g]`` (a ragged
contraction); one warpgroup, or a producer and two consumer warpgroups."""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .pallas_common import (EPILOGUE_ROWS, carried_acc_context, cluster_member, dealt_tiles,
                            dw_transforms, flush_on_last_step, kernel_params, multicast_axes,
                            num_sms, pallas_modules, step_has_outside_rows, transposed,
                            two_consumer_kernel, zero_rows_outside)


def tgmm_pallas(x, dy, offsets, tiles, out_dtype, interpret):
    pl, plgpu = pallas_modules()
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    steps, band = tiles.stages, tiles.band
    m, k = x.shape
    n = dy.shape[1]
    g_count = offsets.shape[0] - 1
    grid_m, grid_n = k // bm, n // bn
    tr, o_tr = dw_transforms(plgpu, x.dtype, bk, bn)

    def body(off_ref, x_ref, dy_ref, o_ref):
        @plgpu.nd_loop((g_count, grid_m * grid_n), collective_axes="sm")
        def _item(info):
            g = info.index[0]
            mi, ni = plgpu.planar_snake(info.index[1], (grid_m, grid_n), 0, band)
            start = off_ref[g]
            size = off_ref[g + 1] - start
            # Tiled (8-row) shared-memory layouts need 8-aligned TMA row
            # offsets: start at the 8-row boundary at or before the group and
            # select away the `lead` rows of the previous group.
            astart = pl.multiple_of(lax.div(start, jnp.int32(8)) * 8, 8)
            lead = start - astart
            nsteps = lax.div(size + lead + (bk - 1), jnp.int32(bk))

            zero_outside = functools.partial(zero_rows_outside, plgpu, bk=bk, lead=lead,
                                             size=size)

            def mma_scope(acc_ref):
                @pl.when(size > 0)
                def _():
                    def step(idx, x_smem, dy_smem):
                        s = idx[0]

                        @pl.when(step_has_outside_rows(s, nsteps, lead, size, bk))
                        def _():
                            zero_outside(x_smem, bm, s)
                            zero_outside(dy_smem, bn, s)
                            plgpu.commit_smem()

                        plgpu.wgmma(acc_ref, transposed(plgpu, x_smem), dy_smem)

                    rows = pl.ds(astart, m)  # may run past M; steps past the group are never issued
                    plgpu.emit_pipeline(
                        step,
                        grid=(nsteps,),
                        in_specs=[
                            plgpu.BlockSpec((bk, bm), lambda s: (s, mi), delay_release=1,
                                            transforms=tr),
                            plgpu.BlockSpec((bk, bn), lambda s: (s, ni), delay_release=1,
                                            transforms=tr),
                        ],
                        max_concurrent_steps=steps,
                    )(x_ref.at[rows, :], dy_ref.at[rows, :])
                return acc_ref[...]

            acc = pl.run_scoped(mma_scope, plgpu.ACC((bm, bn)))

            def store_scope(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, o_ref.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(store_scope, plgpu.SMEM((bm, bn), out_dtype, transforms=o_tr))

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g_count, k, n), out_dtype),
        grid=(num_sms(interpret),),
        grid_names=("sm",),
        **kernel_params(plgpu, interpret),
    )
    return kernel(offsets.astype(jnp.int32), x, dy)


class _Ws(NamedTuple):
    """Static values of a 2-consumer dw kernel (:func:`_ws_static`)."""
    bm: int
    bn: int
    bk: int
    cm: int              # the CTA tile's rows: 2 block_m, one half per consumer
    steps: int           # shared-memory stages
    nsm: int             # the SMs (or clusters) the tiles are dealt to
    n_tiles: int         # (cluster) tiles of one dw[g]
    interpret: bool
    tile_of: Callable    # t -> (mi, ni): the t-th (cluster) tile of dw[g]
    col_tile: Callable   # ni -> this CTA's block_n column tile
    x_axes: dict         # the keyword arguments that multicast an x tile to a CTA pair
    tr: tuple            # shared-memory transforms of the staged input tiles
    o_tr: tuple          # and of the output slots


def _cluster_tiles(plgpu, grid_m, grid_n, band, cluster):
    """``tile_of(t) -> (mi, ni)``: the ``t``-th (cluster) tile of a group's
    ``grid_m x grid_n`` tiles; ``col_tile(ni)``: this CTA's ``block_n`` column
    tile of cluster column tile ``ni`` (adjacent tiles for the CTAs of a pair);
    ``x_axes``: the keyword arguments that multicast an x tile to the pair."""
    def tile_of(t):
        return plgpu.planar_snake(t, (grid_m, grid_n), 0, band)

    return tile_of, lambda ni: cluster_member(ni, cluster), multicast_axes(cluster)


def _ws_static(plgpu, x, dy, tiles, cluster, interpret):
    """The :class:`_Ws` of ``x^T @ dy`` with ``tiles`` on ``cluster``-CTA clusters."""
    bm, bn = tiles.block_m, tiles.block_n
    cm = 2 * bm
    # else columns or rows of dw would go unwritten (registry.Variant.fit never allows it)
    assert x.shape[1] % cm == 0 and dy.shape[1] % (cluster * bn) == 0, (x.shape, dy.shape, tiles)
    grid_m, grid_n = x.shape[1] // cm, dy.shape[1] // (cluster * bn)
    tile_of, col_tile, x_axes = _cluster_tiles(plgpu, grid_m, grid_n, tiles.band, cluster)
    tr, o_tr = dw_transforms(plgpu, x.dtype, tiles.block_k, bn)
    return _Ws(bm, bn, tiles.block_k, cm, tiles.stages, num_sms(interpret) // cluster,
               grid_m * grid_n, interpret, tile_of, col_tile, x_axes, tr, o_tr)


def _out_slots(plgpu, sh, out_dtype):
    """The output tile's shared memory: one ``EPILOGUE_ROWS x block_n`` slot per consumer."""
    return plgpu.SMEM((2, EPILOGUE_ROWS, sh.bn), out_dtype, transforms=sh.o_tr)


def _chunked_store(pl, plgpu, o_smem, o_ref, sh, wg):
    """``store(g, t, val)``: consumer ``wg``'s ``bm x bn`` f32 tile of
    ``dw[g]`` (its half of tile ``t``) to HBM through its one shared-memory
    slot, in ``EPILOGUE_ROWS`` row chunks, one after the other."""
    rows = EPILOGUE_ROWS
    bm, bn = sh.bm, sh.bn

    def store(g, t, val):
        mi, ni = sh.tile_of(t)
        for c in range(bm // rows):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # our slot is free
            o_smem[wg] = val[c * rows:(c + 1) * rows].astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem.at[wg],
                o_ref.at[g, pl.ds(mi * sh.cm + wg * bm + c * rows, rows),
                         pl.ds(sh.col_tile(ni) * bn, bn)])
    return store


def _consumer_mma(pl, plgpu, sh, wg, acc_ref, x_smem, dy_smem, s, nsteps, lead, size):
    """k-step ``s`` of a group for consumer ``wg``: zero the staged rows outside
    the group (first and last k-steps only), then the wgmma of its ``block_m``
    half of the x tile, waited for."""
    @pl.when(step_has_outside_rows(s, nsteps, lead, size, sh.bk))
    def _():
        # Both consumers select the same rows to zero (identical writes):
        # neither reads a half-masked tile. (Zeroing only the consumer's
        # own half of x would halve that pass; not yet compiled on a GPU.)
        zero_rows_outside(plgpu, x_smem, sh.cm, s, sh.bk, lead, size)
        zero_rows_outside(plgpu, dy_smem, sh.bn, s, sh.bk, lead, size)
        plgpu.commit_smem()

    xh = x_smem.at[:, pl.ds(pl.multiple_of(wg * sh.bm, sh.bm), sh.bm)]
    plgpu.wgmma(acc_ref, transposed(plgpu, xh), dy_smem)
    # wait(0), stages released at once: every stage but this one is loading.
    # (wait(1) + delay_release=1, a stage held a step longer for the wgmma
    # in flight, measured 10-18% slower at T 4096: bench/results/README.md.)
    plgpu.wgmma_wait(0)


def _ws_step(pl, plgpu, sh, g, t0, lead, size, nsteps, store):
    """Pipeline body of the 2-consumer dw kernel for group ``g``: a consumer's
    k-step (:func:`_consumer_mma`), and on a tile's last k-step store the
    accumulator and reset it."""
    def step(idx, x_smem, dy_smem, carry):
        j, s = idx
        wg = lax.axis_index("wg")
        acc_ref = carry[0] if sh.interpret else carry
        _consumer_mma(pl, plgpu, sh, wg, acc_ref, x_smem, dy_smem, s, nsteps, lead, size)
        return flush_on_last_step(pl, plgpu, carry, s == nsteps - 1,
                                  lambda val: store(g, t0 + j * sh.nsm, val), sh.interpret,
                                  (sh.bm, sh.bn), wait=True)

    return step


def _group_geometry(pl, off_ref, g, sh):
    """Group ``g`` on this SM (or cluster): ``size``, ``t0`` (its first tile
    here; tiles dealt round-robin, rotated per group), ``cnt`` (its tiles
    here), ``astart`` (its first row rounded down to 8: tiled TMA layouts),
    ``lead`` (rows of the previous group from ``astart`` on) and ``nsteps`` (k-steps of ``bk`` rows from ``astart``;
    meaningless when ``size <= 0``)."""
    nsm, bk = sh.nsm, sh.bk
    start = off_ref[g]
    size = off_ref[g + 1] - start
    t0, cnt = dealt_tiles(g, sh.n_tiles, nsm)
    astart = pl.multiple_of(lax.div(start, jnp.int32(8)) * 8, 8)
    lead = start - astart
    nsteps = lax.div(size + lead + (bk - 1), jnp.int32(bk))
    return size, t0, cnt, astart, lead, nsteps


def _ws_group(pl, plgpu, sh, refs, g, store, pipe):
    """Group ``g`` of the 2-consumer dw kernel on this SM (or cluster): one
    warp-specialized pipeline over (this unit's tiles of g) x (g's k-steps);
    zeros for an empty group. ``pipe(step, grid, t0, refs)`` runs the pipeline."""
    off_ref, x_ref, dy_ref = refs
    m = x_ref.shape[0]
    size, t0, cnt, astart, lead, nsteps = _group_geometry(pl, off_ref, g, sh)

    # Both CTAs of a cluster see the same group, t0 and cnt: they run the same
    # pipeline steps (the multicast x tile needs both).
    @pl.when((size > 0) & (cnt > 0))
    def _():
        rows = pl.ds(astart, m)  # may run past M; steps past the group are never issued
        pipe(_ws_step(pl, plgpu, sh, g, t0, lead, size, nsteps, store), (cnt, nsteps), t0,
             (x_ref.at[rows, :], dy_ref.at[rows, :]))

    @pl.when((size <= 0) & (cnt > 0) & (lax.axis_index("wg") < 2))
    def _():
        @pl.loop(0, cnt)
        def _(j):
            store(g, t0 + j * sh.nsm, jnp.zeros((sh.bm, sh.bn), jnp.float32))


def _ws_pipeline(pl, plgpu, sh, step, grid, t0):
    """The warp-specialized pipeline of one group: ``grid`` (this unit's
    tiles of the group, its k-steps), tiles from ``t0`` dealt round-robin."""
    tile_of, nsm = sh.tile_of, sh.nsm
    return plgpu.emit_pipeline_warp_specialized(
        step,
        grid=grid,
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((sh.bk, sh.cm), lambda j, s: (s, tile_of(t0 + j * nsm)[0]),
                            transforms=sh.tr, **sh.x_axes),
            plgpu.BlockSpec((sh.bk, sh.bn),
                            lambda j, s: (s, sh.col_tile(tile_of(t0 + j * nsm)[1])),
                            transforms=sh.tr),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=sh.steps,
        compute_context=carried_acc_context(pl, plgpu, (sh.bm, sh.bn), sh.interpret),
    )


def tgmm_pallas_ws(x, dy, offsets, tiles, out_dtype, interpret, cluster=1):
    """dw with two consumer warpgroups and a producer warpgroup (warp-specialized).

    A CTA owns a ``2 block_m x block_n`` tile of ``dw[g]`` (each consumer
    warpgroup one ``block_m x block_n`` half); per group, the SM's tiles (dealt
    round-robin, rotated per group) and the group's k-steps form ONE pipeline
    whose loads are issued by the producer warpgroup, so the next tile's loads
    are in flight while the consumers run the previous tile's epilogue (a
    group has only ~4 k-steps of 64 rows at V3 shapes: the epilogue and the
    pipeline fill are what the one-warpgroup kernel waits on). The output tile
    goes to HBM in ``EPILOGUE_ROWS`` row chunks. SMs split into partitions
    that take the groups round-robin (fewer pipeline restarts per SM) measured
    no faster and were deleted, and so were two output slots per consumer
    (two stores in flight; bench/results/README.md): a chunk waits until the
    TMA store of the one before has read the consumer's one slot.

    ``cluster=2``: CTAs run in pairs (a 2-CTA cluster) that own adjacent
    ``block_n`` column tiles of one ``2 block_m x 2 block_n`` cluster tile, so
    they stage the same x tile: each CTA loads half of it and multicasts it to
    both (x's L2 reads per k-step: 32 -> 16 KB per CTA at the default tiles;
    cuBLAS's batched dw runs 2 x 1 clusters). Needs ``N % (2 block_n) == 0``.
    The pipeline's buffers and barriers are allocated once for the kernel and
    reused by every group's pipeline, without the CTA barrier that a
    per-group allocation puts at each group's start (it would not hold the
    partner CTA anyway): a CTA's producer starts group g+1 only after its
    quiesce has seen both CTAs' consumers release every stage of group g (its
    consumed barriers are cluster barriers), so a multicast never lands in a
    stage the partner still reads.
    """
    pl, plgpu = pallas_modules()
    k, n = x.shape[1], dy.shape[1]
    g_count = offsets.shape[0] - 1
    sh = _ws_static(plgpu, x, dy, tiles, cluster, interpret)

    def body(off_ref, x_ref, dy_ref, o_ref):
        def scoped(o_smem, allocs=None):
            wg = lax.axis_index("wg")
            store = _chunked_store(pl, plgpu, o_smem, o_ref, sh, wg)

            def pipe(step, grid, t0, gmem):
                # cluster == 1: no allocations= on purpose (the measured form):
                # the pipeline's own scoped allocation synchronises the CTA on
                # entry.
                _ws_pipeline(pl, plgpu, sh, step, grid, t0)(*gmem, allocations=allocs)

            def group(g, carry):
                _ws_group(pl, plgpu, sh, (off_ref, x_ref, dy_ref), g, store, pipe)
                return carry

            lax.fori_loop(0, g_count, group, jnp.int32(0))

            @pl.when(wg < 2)
            def _():
                plgpu.wait_smem_to_gmem(0)

        out_smem = _out_slots(plgpu, sh, out_dtype)
        if cluster > 1:
            # Buffers and barriers for every group's pipeline (see the docstring);
            # the grid only needs enough steps that no stage is cut.
            alloc = _ws_pipeline(pl, plgpu, sh, None, (sh.steps, sh.steps),
                                 jnp.int32(0)).get_allocations(x_ref, dy_ref)
            pl.run_scoped(scoped, out_smem, alloc, collective_axes="wg")
        else:
            pl.run_scoped(scoped, out_smem, collective_axes="wg")

    kernel = two_consumer_kernel(plgpu, body, (g_count, k, n), out_dtype, sh.nsm, cluster, interpret)
    return kernel(offsets.astype(jnp.int32), x, dy)


class _Ring(NamedTuple):
    """The ring's shared memory: per stage the staged x and dy tiles, a
    barrier for "loaded" (``full``) and one for "released" (``empty``)."""
    xs: Any
    dys: Any
    full: Any
    empty: Any


def _ring_geometry(pl, off_ref, g, sh):
    """:func:`_group_geometry`, with no k-steps for an empty group."""
    size, t0, cnt, astart, lead, nsteps = _group_geometry(pl, off_ref, g, sh)
    return size, t0, cnt, astart, lead, jnp.where(size > 0, nsteps, 0)


def _ring_producer(pl, plgpu, sh, g_count, gmem, ring):
    """The producer warpgroup of the ring: walks (group, this unit's tiles of
    it, its k-steps) and loads the ``i``-th step into stage ``i % stages`` once
    the consumers released it; then waits for every stage's last release."""
    off_ref, x_ref, dy_ref = gmem
    steps = sh.steps
    plgpu.set_max_registers(40, action="decrease")

    def group(g, i):
        _, t0, cnt, astart, _, nsteps = _ring_geometry(pl, off_ref, g, sh)

        def tile(j, i):
            mi, ni = sh.tile_of(t0 + j * sh.nsm)

            def step(s, i):
                slot = lax.rem(i, jnp.int32(steps))

                @pl.when(i >= steps)
                def _():
                    plgpu.barrier_wait(ring.empty.at[slot])   # both consumers (of both CTAs) done
                r = pl.ds(pl.multiple_of(astart + s * sh.bk, 8), sh.bk)
                plgpu.copy_gmem_to_smem(x_ref.at[r, pl.ds(mi * sh.cm, sh.cm)], ring.xs.at[slot],
                                        ring.full.at[slot], **sh.x_axes)
                plgpu.copy_gmem_to_smem(dy_ref.at[r, pl.ds(sh.col_tile(ni) * sh.bn, sh.bn)],
                                        ring.dys.at[slot], ring.full.at[slot])
                return i + 1
            return lax.fori_loop(0, nsteps, step, i)
        return lax.fori_loop(0, jnp.where(nsteps > 0, cnt, 0), tile, i)

    total = lax.fori_loop(0, g_count, group, jnp.int32(0))

    # Every stage's last release (the partner CTA's consumers arrive on
    # our barriers: none may be left in flight when this CTA exits).
    @pl.loop(jnp.maximum(total - steps, 0), total)
    def _(i):
        plgpu.barrier_wait(ring.empty.at[lax.rem(i, jnp.int32(steps))])


def _ring_step(pl, plgpu, sh, ring, wg, size, lead, nsteps, store_tile):
    """k-step ``s`` of the ring for consumer ``wg``: wait for its stage's
    loads, the k-step (:func:`_consumer_mma`), release the stage; on the
    tile's last k-step ``store_tile`` the accumulator and reset it."""
    def step(s, carry):
        i, acc = carry
        slot = lax.rem(i, jnp.int32(sh.steps))
        plgpu.barrier_wait(ring.full.at[slot])
        acc_ref = acc[0] if sh.interpret else acc
        _consumer_mma(pl, plgpu, sh, wg, acc_ref, ring.xs.at[slot], ring.dys.at[slot], s,
                      nsteps, lead, size)
        plgpu.barrier_arrive(ring.empty.at[slot])
        acc = flush_on_last_step(pl, plgpu, acc, s == nsteps - 1, store_tile, sh.interpret,
                                 (sh.bm, sh.bn))
        return i + 1, acc
    return step


def _ring_consumers(pl, plgpu, sh, g_count, off_ref, store, wg, ring):
    """Consumer warpgroup ``wg`` of the ring: the same walk as the producer,
    one accumulator carried across all of it; an empty group's tiles store
    zeros."""
    plgpu.set_max_registers(232, action="increase")

    def run(acc0):
        def group(g, carry):
            size, t0, cnt, _, lead, nsteps = _ring_geometry(pl, off_ref, g, sh)

            @pl.when((size <= 0) & (cnt > 0))
            def _():
                @pl.loop(0, cnt)
                def _(j):
                    store(g, t0 + j * sh.nsm, jnp.zeros((sh.bm, sh.bn), jnp.float32))

            def tile(j, carry):
                step = _ring_step(pl, plgpu, sh, ring, wg, size, lead, nsteps,
                                  lambda val: store(g, t0 + j * sh.nsm, val))
                return lax.fori_loop(0, nsteps, step, carry)
            return lax.fori_loop(0, jnp.where(nsteps > 0, cnt, 0), tile, carry)

        lax.fori_loop(0, g_count, group, (jnp.int32(0), acc0))

    carried_acc_context(pl, plgpu, (sh.bm, sh.bn), sh.interpret)(run)
    plgpu.wait_smem_to_gmem(0)


def tgmm_pallas_ring(x, dy, offsets, tiles, out_dtype, interpret, cluster=1):
    """The 2-consumer dw kernel with ONE ring of stages per SM (or cluster)
    across all groups, written out by hand: the producer warpgroup walks
    (group, this unit's tiles of the group, the group's k-steps) and refills
    stage ``i % stages`` for the ``i``-th step as soon as the consumers have
    released it, so the next group's first loads are in flight while the last
    group's tiles finish (``tgmm_pallas_ws`` drains its pipeline at every group
    boundary: a pipeline's fill per (SM, group), ~1-2 us, 128 times per call at
    V3 shapes, the more that a group has few tiles per SM). Same tiles, tile
    order and k-step order as ``tgmm_pallas_ws`` (bit-identical results), same
    ``cluster`` option (x tile multicast to CTA pairs). The loop nest needs no
    table and no division per step (the table-driven per-SM pipeline
    lost to those)."""
    pl, plgpu = pallas_modules()
    k, n = x.shape[1], dy.shape[1]
    g_count = offsets.shape[0] - 1
    sh = _ws_static(plgpu, x, dy, tiles, cluster, interpret)

    def body(off_ref, x_ref, dy_ref, o_ref, o_smem, xs, dys, full, empty):
        wg = lax.axis_index("wg")
        ring = _Ring(xs, dys, full, empty)

        @pl.when(wg == 2)
        def _producer():
            _ring_producer(pl, plgpu, sh, g_count, (off_ref, x_ref, dy_ref), ring)

        @pl.when(wg < 2)
        def _consumers():
            store = _chunked_store(pl, plgpu, o_smem, o_ref, sh, wg)
            _ring_consumers(pl, plgpu, sh, g_count, off_ref, store, wg, ring)

    barrier = (functools.partial(plgpu.ClusterBarrier, **sh.x_axes) if cluster > 1
               else plgpu.Barrier)
    kernel = two_consumer_kernel(
        plgpu, body, (g_count, k, n), out_dtype, sh.nsm, cluster, interpret,
        scratch_types=(
            _out_slots(plgpu, sh, out_dtype),
            plgpu.SMEM((sh.steps, sh.bk, sh.cm), x.dtype, transforms=sh.tr),
            plgpu.SMEM((sh.steps, sh.bk, sh.bn), dy.dtype, transforms=sh.tr),
            plgpu.Barrier(num_arrivals=2, num_barriers=sh.steps),     # stage loaded
            barrier(num_arrivals=2, num_barriers=sh.steps),           # stage released
        ))
    return kernel(offsets.astype(jnp.int32), x, dy)
