"""dw Pallas kernels: ``dw[g] = x[rows of g]^T @ dy[rows of g]`` (a ragged
contraction); one warpgroup, or a producer and two consumer warpgroups."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .pallas_common import (carried_acc_context, dw_transforms, flush_on_last_step,
                            kernel_params, num_sms, pallas_modules, round_robin_count,
                            step_has_outside_rows, transposed, zero_rows_outside)


def tgmm_pallas(x, dy, offsets, tiles, out_dtype, interpret):
    pl, plgpu = pallas_modules()
    bm, bn, bk, steps, band = tiles
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


def _ws_mma(pl, plgpu, sh, x_smem, dy_smem, carry, s, nsteps, lead, size, store_tile):
    """One k-step of a 2-consumer dw kernel (``sh``: the kernel's static shape
    values; ``s`` of the group's ``nsteps``): zero the rows outside the group
    on its first and last k-steps, one wgmma per consumer half, and on a
    tile's last k-step ``store_tile(acc)`` and reset the accumulator. Returns
    the next accumulator carry."""
    bm, bn, bk, cm, nsm, interpret = sh
    wg = lax.axis_index("wg")
    acc_ref = carry[0] if interpret else carry

    @pl.when(step_has_outside_rows(s, nsteps, lead, size, bk))
    def _():
        # Both consumers select the same rows to zero (identical writes):
        # neither reads a half-masked tile. (Zeroing only the consumer's
        # own half of x would halve that pass; not yet compiled on a GPU.)
        zero_rows_outside(plgpu, x_smem, cm, s, bk, lead, size)
        zero_rows_outside(plgpu, dy_smem, bn, s, bk, lead, size)
        plgpu.commit_smem()

    xs = x_smem.at[:, pl.ds(pl.multiple_of(wg * bm, bm), bm)]
    plgpu.wgmma(acc_ref, transposed(plgpu, xs), dy_smem)
    # wait(0), stages released at once: every stage but this one is loading.
    # (wait(1) + delay_release=1, a stage held a step longer for the wgmma
    # in flight, measured 10-18% slower at T 4096: bench/results/README.md.)
    plgpu.wgmma_wait(0)
    return flush_on_last_step(pl, plgpu, carry, s == nsteps - 1, store_tile, interpret,
                              (bm, bn), wait=True)


def _ws_step(pl, plgpu, sh, g, t0, lead, size, nsteps, store):
    """Pipeline body of the 2-consumer dw kernel for group ``g``: tile ``j`` of
    this SM's, k-step ``s`` (:func:`_ws_mma`)."""
    nsm = sh[4]

    def step(idx, x_smem, dy_smem, carry):
        j, s = idx
        return _ws_mma(pl, plgpu, sh, x_smem, dy_smem, carry, s, nsteps, lead, size,
                       lambda val: store(g, t0 + j * nsm, val))

    return step


def _ws_geometry(x, dy, offsets, tiles, interpret):
    """The static values of a 2-consumer dw kernel: (pl, plgpu, sh = (bm, bn,
    bk, cm, nsm, interpret), stages, groups, K, N, CTA tiles per group, input
    and output smem transforms, tile_of: CTA tile index -> (row, column) tile,
    swept in bands)."""
    pl, plgpu = pallas_modules()
    bm, bn, bk, steps, band = tiles
    k, n = x.shape[1], dy.shape[1]
    cm = 2 * bm
    grid_m, grid_n = k // cm, n // bn
    sh = (bm, bn, bk, cm, num_sms(interpret), interpret)
    tr, o_tr = dw_transforms(plgpu, x.dtype, bk, bn)

    def tile_of(t):
        return plgpu.planar_snake(t, (grid_m, grid_n), 0, band)
    return (pl, plgpu, sh, steps, offsets.shape[0] - 1, k, n, grid_m * grid_n, tr, o_tr,
            tile_of)


def _ws_kernel(pl, plgpu, sh, tile_of, g_count, k, n, out_dtype, o_tr, inner):
    """The 2-consumer dw kernel around ``inner(store, *refs)``: one CTA per SM,
    a producer and two consumer warpgroups, each consumer's output half
    staged in shared memory; ``store(g, t, val)`` stores this consumer's
    half of tile ``t`` of ``dw[g]``. Every consumer's stores are waited for
    at the end."""
    bm, bn, bk, cm, nsm, interpret = sh

    def body(*refs):
        o_ref = refs[-1]

        def scoped(o_smem):
            wg = lax.axis_index("wg")

            def store(g, t, val):
                mi, ni = tile_of(t)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # this warpgroup's slot free
                o_smem[wg] = val.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem.at[wg], o_ref.at[g, pl.ds(mi * cm + wg * bm, bm), pl.ds(ni * bn, bn)])

            inner(store, *refs[:-1])

            @pl.when(wg < 2)
            def _():
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((2, bm, bn), out_dtype, transforms=o_tr),
                      collective_axes="wg")

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g_count, k, n), out_dtype),
        grid=(nsm,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        **kernel_params(plgpu, interpret),
    )


def _ws_group_span(pl, sh, off_ref, g, n_tiles, rot_step):
    """Group ``g`` on this SM, as both 2-consumer dw kernels deal it: ``(size,
    t0, cnt, astart, lead, nsteps)``: its rows, the SM's first tile of it
    (tiles dealt round-robin, rotated per group) and tile count, the 8-aligned
    first row, the rows before the group in the first k-step, and its k-steps.
    (``_unit_starts`` computes the same per (SM, group) in XLA.)"""
    bk, nsm = sh[2], sh[4]
    start = off_ref[g]
    size = off_ref[g + 1] - start
    rot = lax.rem(g * jnp.int32(rot_step), jnp.int32(nsm))
    t0 = lax.rem(lax.axis_index("sm") - rot + nsm, jnp.int32(nsm))
    cnt = round_robin_count(n_tiles, t0, nsm)
    astart = pl.multiple_of(lax.div(start, jnp.int32(8)) * 8, 8)
    lead = start - astart
    nsteps = lax.div(size + lead + (bk - 1), jnp.int32(bk))
    return size, t0, cnt, astart, lead, nsteps


def _ws_group(pl, plgpu, sh, refs, g, tile_of, store, n_tiles, rot_step, steps, tr):
    """Group ``g`` of the 2-consumer dw kernel on this SM: one warp-specialized
    pipeline over (this SM's tiles of g) x (g's k-steps); zeros for an empty group."""
    bm, bn, bk, cm, nsm, interpret = sh
    off_ref, x_ref, dy_ref = refs
    m = x_ref.shape[0]
    size, t0, cnt, astart, lead, nsteps = _ws_group_span(pl, sh, off_ref, g, n_tiles, rot_step)

    # No allocations= here on purpose: the pipeline's own scoped allocation
    # synchronises the CTA on entry, which is what keeps this group's producer
    # from refilling a slot of the previous group while a consumer may still
    # read it. Hoisting the allocations out of the group loop needs an
    # explicit barrier here.
    @pl.when((size > 0) & (cnt > 0))
    def _():
        rows = pl.ds(astart, m)  # may run past M; steps past the group are never issued
        plgpu.emit_pipeline_warp_specialized(
            _ws_step(pl, plgpu, sh, g, t0, lead, size, nsteps, store),
            grid=(cnt, nsteps),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((bk, cm), lambda j, s: (s, tile_of(t0 + j * nsm)[0]),
                                transforms=tr),
                plgpu.BlockSpec((bk, bn), lambda j, s: (s, tile_of(t0 + j * nsm)[1]),
                                transforms=tr),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=steps,
            compute_context=carried_acc_context(pl, plgpu, (bm, bn), interpret),
        )(x_ref.at[rows, :], dy_ref.at[rows, :])

    @pl.when((size <= 0) & (cnt > 0) & (lax.axis_index("wg") < 2))
    def _():
        @pl.loop(0, cnt)
        def _(j):
            store(g, t0 + j * nsm, jnp.zeros((bm, bn), jnp.float32))


def tgmm_pallas_ws(x, dy, offsets, tiles, out_dtype, interpret):
    """dw with two consumer warpgroups and a producer warpgroup (warp-specialized).

    A CTA owns a ``2 block_m x block_n`` tile of ``dw[g]`` (each consumer
    warpgroup one ``block_m x block_n`` half); per group, the SM's tiles (dealt
    round-robin, rotated per group) and the group's k-steps form ONE pipeline
    whose loads are issued by the producer warpgroup, so the next tile's loads
    are in flight while the consumers run the previous tile's epilogue (a
    group has only ~4 k-steps of 64 rows at V3 shapes: the epilogue and the
    pipeline fill are what the one-warpgroup kernel waits on).
    """
    pl, plgpu, sh, steps, g_count, k, n, n_tiles, tr, o_tr, tile_of = _ws_geometry(
        x, dy, offsets, tiles, interpret)

    def inner(store, off_ref, x_ref, dy_ref):
        def group(g, carry):
            _ws_group(pl, plgpu, sh, (off_ref, x_ref, dy_ref), g, tile_of, store, n_tiles,
                      n_tiles % sh[4], steps, tr)
            return carry

        lax.fori_loop(0, g_count, group, jnp.int32(0))

    kernel = _ws_kernel(pl, plgpu, sh, tile_of, g_count, k, n, out_dtype, o_tr, inner)
    return kernel(offsets.astype(jnp.int32), x, dy)


def _unit_starts(offsets, n_tiles, nsm, rot_step, bk):
    """[nsm, G + 1] int32: the prefix sums over groups of each SM's units of
    :func:`tgmm_pallas_ws_sm` (a unit is one (tile, k-step); SM ``i`` owns
    ``round_robin_count(n_tiles, t0, nsm)`` tiles of group ``g``, ``t0`` the
    rotated first tile, as in ``_ws_group``, times the group's k-steps)."""
    off = offsets.astype(jnp.int32)
    start, size = off[:-1], off[1:] - off[:-1]
    lead = start - (start // 8) * 8
    nsteps = jnp.where(size > 0, (size + lead + (bk - 1)) // bk, 0)
    g = jnp.arange(start.shape[0], dtype=jnp.int32)
    rot = (g * rot_step) % nsm
    t0 = (jnp.arange(nsm, dtype=jnp.int32)[:, None] - rot[None, :] + nsm) % nsm
    cnt = jnp.where(t0 < n_tiles, (n_tiles - t0 + (nsm - 1)) // nsm, 0)
    units = cnt * nsteps[None, :]
    return jnp.concatenate([jnp.zeros((nsm, 1), jnp.int32),
                            jnp.cumsum(units, axis=1, dtype=jnp.int32)], axis=1)


def _unit_groups(ustart, u_max):
    """[nsm, u_max] int32: the group of each SM's unit (entries past the SM's
    units are unspecified): each non-empty group's number scattered to its
    first unit, then a running max along the units (groups start in order)."""
    nsm, g_count = ustart.shape[0], ustart.shape[1] - 1
    g = jnp.broadcast_to(jnp.arange(g_count, dtype=jnp.int32), (nsm, g_count))
    first = ustart[:, :-1]
    has = ustart[:, 1:] > first
    col = jnp.where(has & (first < u_max), first, u_max)      # column u_max: a bin for the rest
    rows = jnp.broadcast_to(jnp.arange(nsm, dtype=jnp.int32)[:, None], (nsm, g_count))
    tab = jnp.zeros((nsm, u_max + 1), jnp.int32).at[rows, col].max(jnp.where(has, g, 0))
    return lax.cummax(tab[:, :u_max], axis=1)


def tgmm_pallas_ws_sm(x, dy, offsets, tiles, out_dtype, interpret):
    """dw as :func:`tgmm_pallas_ws` (a producer and two consumer warpgroups, the
    same tiles dealt to the same SMs, the same arithmetic) but with ONE
    pipeline per SM across all groups: the SM's units (tile, k-step) run group
    by group (all SMs sweep the same group at a time, so x and dy rows come
    from L2, unlike the deleted tile-major variant), with no pipeline drain and
    refill at group boundaries. A unit's group comes from a per-SM table
    (``_unit_groups``, built before the kernel from the SM's unit prefix sums
    ``_unit_starts``): one load in the index maps and in the consumers.
    ``GroupedMatmulConfig.dw_pipeline="per_sm"``; not yet run on a GPU
    (session 14: written for an A/B against the per-group pipeline, whose
    fill is an estimated 10-20% of dw where groups are one k-step deep).
    """
    pl, plgpu, sh, steps, g_count, k, n, n_tiles, tr, o_tr, tile_of = _ws_geometry(
        x, dy, offsets, tiles, interpret)
    bm, bn, bk, cm, nsm, _ = sh
    rot_step = n_tiles % nsm
    ustart = _unit_starts(offsets, n_tiles, nsm, rot_step, bk)
    # units of one SM: its tiles of a group (at most ceil(n_tiles / nsm)) times
    # the group's k-steps, summed: sum_g nsteps_g <= (M + 7 G) / bk + G
    u_max = -(-n_tiles // nsm) * (-(-(x.shape[0] + 7 * g_count) // bk) + g_count)
    ugroup = _unit_groups(ustart, u_max)

    def inner(store, off_ref, us_ref, ug_ref, x_ref, dy_ref):
        sm = lax.axis_index("sm")
        wg = lax.axis_index("wg")
        total = us_ref[sm, g_count]

        def unit(u, g):
            """(t, s, astart, lead, size, nsteps) of this SM's unit u of group g."""
            size, t0, _, astart, lead, nsteps = _ws_group_span(pl, sh, off_ref, g, n_tiles,
                                                               rot_step)
            local = u - us_ref[sm, g]
            j = lax.div(local, nsteps)
            s = local - j * nsteps
            return t0 + j * nsm, s, astart, lead, size, nsteps

        def index(side):
            def index_map(u):
                t, s, astart, *_ = unit(u, ug_ref[sm, u])
                return pl.multiple_of(astart + s * bk, 8), tile_of(t)[side]
            return index_map

        def step(idx, x_smem, dy_smem, carry):
            u = idx[0]
            g = ug_ref[sm, u]
            t, s, _, lead, size, nsteps = unit(u, g)
            return _ws_mma(pl, plgpu, sh, x_smem, dy_smem, carry, s, nsteps, lead, size,
                           lambda val: store(g, t, val))

        @pl.when(total > 0)
        def _():
            plgpu.emit_pipeline_warp_specialized(
                step, grid=(total,), memory_registers=40,
                in_specs=[plgpu.BlockSpec((pl.Element(bk), cm), index(0), transforms=tr),
                          plgpu.BlockSpec((pl.Element(bk), bn), index(1), transforms=tr)],
                wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps,
                compute_context=carried_acc_context(pl, plgpu, (bm, bn), interpret),
            )(x_ref, dy_ref)

        @pl.when(wg < 2)
        def _():   # empty groups: this SM's tiles of them are zeros, no matmul
            @pl.loop(0, g_count)
            def _(g):
                size, t0, cnt, *_ = _ws_group_span(pl, sh, off_ref, g, n_tiles, rot_step)

                @pl.when(size <= 0)
                def _():
                    @pl.loop(0, cnt)
                    def _(j):
                        store(g, t0 + j * nsm, jnp.zeros((bm, bn), jnp.float32))

    kernel = _ws_kernel(pl, plgpu, sh, tile_of, g_count, k, n, out_dtype, o_tr, inner)
    return kernel(offsets.astype(jnp.int32), ustart, ugroup, x, dy)
