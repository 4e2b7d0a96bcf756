"""Pieces the Pallas Mosaic-GPU grouped-matmul kernels share: the lazily
imported modules, kernel parameters, the forward's row-tile table, shared-memory
transforms and row stores."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .devices import device_info
from .rows import FixedStarts


def pallas_modules():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return pl, plgpu


def transposed(plgpu, ref):
    """``ref`` viewed transposed (jax 0.11: ``ref.transpose``; 0.10: ``transpose_ref``)."""
    if hasattr(ref, "transpose"):
        try:
            return ref.transpose((1, 0))
        except (TypeError, NotImplementedError):
            pass
    return plgpu.transpose_ref(ref, (1, 0))


def kernel_params(plgpu, interpret):
    kw = dict(compiler_params=plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    if interpret:
        kw["interpret"] = plgpu.InterpretGPUParams()
    return kw


# The 2-consumer kernels stage a consumer's output tile in shared memory in
# chunks of this many rows (one wgmma row tile), one after the other: at the
# default 128-row tiles that frees 32 KB for a 4th pipeline stage (3 with the
# whole tile staged; bench/results/README.md, deleted variants).
EPILOGUE_ROWS = 64


def num_sms(interpret) -> int:
    """CTAs of a persistent kernel: one per SM (4 "SMs" in interpret mode, so
    the tests' few tiles still spread over several)."""
    if interpret:
        return 4
    return device_info().sm_count


def max_row_tiles(m: int, groups: int, bm: int) -> int:
    """The length of :func:`row_tiles`' table for ``m`` rows in ``groups``
    groups cut at ``bm`` rows: a bound on the tiles in use (each group and
    the tail waste less than ``bm + 7`` rows)."""
    return (m + (groups + 1) * (bm + 7)) // bm + 1


def row_tiles(offsets, m, bm):
    """Row tiles of the forward/dx kernel: int32 ``start, lo, hi, group`` of static length.

    ``offsets``: int32 ``[G+1]`` row offsets (``ops.offsets``), or
    :class:`FixedStarts` (then groups start where it says and there is no tail).

    Each non-empty group ``g`` is cut into ``cdiv(size + lead, bm)`` tiles of
    ``bm`` rows starting at ``off[g]`` rounded down to 8 (``lead`` rows of the
    previous group are computed and not stored: 8-aligned TMA row offsets); the
    tail ``[total, m)`` into ``cdiv(m - total, bm)`` zero-store tiles
    (``group -1``). A tile stores rows ``[lo, hi)``; its loads start at
    ``start`` (moved back so the tile ends inside ``[0, m)``). Unused entries
    (``lo == hi``) come last. Per-group tiles waste < ``bm + 7`` rows per
    group, against up to ``2 bm`` for blocks cut at fixed ``bm`` boundaries.
    """
    if isinstance(offsets, FixedStarts):   # no tail: rows between groups get no tile
        start = offsets.start.astype(jnp.int32)
        end = start + offsets.size.astype(jnp.int32)
        g_count, total = start.shape[0], jnp.int32(m)
    else:
        off = offsets.astype(jnp.int32)
        start, end, total = off[:-1], off[1:], off[-1]
        g_count = off.shape[0] - 1
    a8 = (start // 8) * 8
    n_g = jnp.where(end > start, (end - a8 + (bm - 1)) // bm, 0)
    t8 = (total // 8) * 8
    n_tail = jnp.int32(0) if isinstance(offsets, FixedStarts) else (m - t8 + (bm - 1)) // bm
    counts = jnp.concatenate([n_g, n_tail[None]])
    cum = jnp.cumsum(counts)
    first = cum - counts
    n_max = max_row_tiles(m, g_count, bm)              # bound on sum(counts)
    t = jnp.arange(n_max, dtype=jnp.int32)
    # compare_all: one fused elementwise kernel ([n_max, G+1] compares). The
    # default 'scan' method is a while loop of small kernels on every call.
    grp = jnp.searchsorted(cum, t, side="right", method="compare_all").astype(jnp.int32)
    used = grp <= g_count
    gc = jnp.minimum(grp, g_count)
    base = jnp.concatenate([a8, t8[None]])[gc]
    row = base + (t - first[gc]) * bm
    lo = jnp.maximum(row, jnp.concatenate([start, total[None]])[gc])
    hi = jnp.minimum(row + bm, jnp.concatenate([end, jnp.full((1,), m, jnp.int32)])[gc])
    row = jnp.maximum(jnp.minimum(row, m - bm), 0)      # m % 8 == 0: stays 8-aligned
    lo = jnp.where(used, lo, 0)
    hi = jnp.where(used, hi, 0)
    g = jnp.where(gc == g_count, -1, gc)
    return row.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32), g.astype(jnp.int32)


def row_tile_table(offsets, m, bm):
    """The persistent forward kernels' row-tile table (:func:`row_tiles`) and
    its int32 ``[group tiles, tail tiles]`` counts (the tiles in use, group
    tiles first) -> ``(counts, start, lo, hi, group)``."""
    rs, r0, r1, grp = row_tiles(offsets, m, bm)
    used = r1 > r0
    counts = jnp.stack([jnp.sum(used & (grp >= 0)), jnp.sum(used & (grp < 0))]).astype(jnp.int32)
    return counts, rs, r0, r1, grp


def group_spans(grp):
    """Per row tile of :func:`row_tiles` (a group's tiles contiguous, the tail's
    ``-1`` last): int32 ``(first, count)``, its group's first tile and the
    group's tile count, which the group order (band 0) of :func:`tile_at`
    reads."""
    t = jnp.arange(grp.shape[0], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), bool), grp[1:] != grp[:-1]])
    first = lax.cummax(jnp.where(starts, t, 0), axis=0)
    ends = jnp.concatenate([starts[1:], jnp.ones((1,), bool)])
    last = lax.cummin(jnp.where(ends, t, grp.shape[0]), axis=0, reverse=True)
    return first, last - first + 1


def spans_of(grp, band):
    """The extra tables :func:`tile_at` reads for ``band``: ``group_spans``
    for the group order (band 0), none for a snake."""
    return group_spans(grp) if band == 0 else ()


def tile_at(plgpu, t, grid, band, spans):
    """The forward kernels' work order: linear index ``t`` over ``grid = (row
    tiles, column tiles)`` -> ``(row tile, column tile)``. ``band >= 1``: a
    planar snake of ``band`` row tiles per column tile. ``band 0``: group
    order: group ``g``'s tiles fill ``[first, first + count) x grid[1]`` of the
    linear order, its row tiles side by side at each column tile, so each
    tile of ``w[g]`` is read from HBM once while it is in use; a snake's bands
    straddle groups of 2-3 row tiles (the MoE layer's padded groups), and a
    straddled group meets ``w[g]``'s column tiles at two times
    (``spans``: the refs of :func:`group_spans`)."""
    if band:
        return plgpu.planar_snake(t, grid, 0, band)
    first_ref, count_ref = spans
    row = t // grid[1]   # a row tile of t's group: its span is the group's
    first, count = first_ref[row], count_ref[row]
    local = t - first * grid[1]
    return first + lax.rem(local, count), lax.div(local, count)


def dw_transforms(plgpu, dtype, bk, bn):
    """Shared-memory transforms of the dw kernels: the staged ``[bk, *]`` input
    tiles (swizzled along ``bk`` rows of 8) and the ``[*, bn]`` output tile."""
    item = jnp.dtype(dtype).itemsize

    def tiled(width):
        sw = plgpu.find_swizzle(width * item * 8)
        return (plgpu.TilingTransform((8, sw // item)), plgpu.SwizzleTransform(sw))
    return tiled(bk), tiled(bn)


def step_has_outside_rows(s, nsteps, lead, size, bk):
    """Whether dw k-step ``s`` of a group (``nsteps`` steps of ``bk`` rows from
    the group's start rounded down to 8, ``lead`` rows before it) stages rows
    of another group or of the tail: the first step when the group starts off
    the 8-row boundary, the last when the group does not end on a step
    boundary. Other steps (and every step of aligned groups) skip the zeroing
    pass, which reads and writes the whole staged tile in shared memory."""
    first = (s == 0) & (lead > 0)
    last = (s == nsteps - 1) & (lax.rem(lead + size, jnp.int32(bk)) != 0)
    return first | last


def zero_rows_outside(plgpu, ref, width, s, bk, lead, size):
    """dw k-step ``s`` of a group: zero the rows of the staged ``[bk, width]``
    tile outside ``[lead, lead + size)`` with a select (never a multiply: the
    neighbouring group's or the tail's rows may hold NaN/Inf)."""
    r = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bk, width), 0), plgpu.Layout.WGMMA)
    r = r + s * bk
    v = ref[...]
    ref[...] = jnp.where((r >= lead) & (r < lead + size), v, jnp.zeros_like(v))


def dealt_tiles(g, n_tiles: int, units: int):
    """(``t0``, ``cnt``): this unit's first tile of group ``g``'s ``n_tiles``
    and how many it gets, the tiles dealt round-robin over ``units`` SMs (or
    clusters), the deal rotated per group so the remainders spread."""
    rot = lax.rem(g * jnp.int32(n_tiles % units), jnp.int32(units))
    t0 = lax.rem(lax.axis_index("sm") - rot + units, jnp.int32(units))
    return t0, round_robin_count(n_tiles, t0, units)


def round_robin_count(n, first, nsm: int):
    """int32: how many of ``n`` items dealt round-robin over ``nsm`` SMs fall to
    the SM whose first item is ``first`` (items ``first, first + nsm, ...``)."""
    return jnp.where(first < n, lax.div(n - first + (nsm - 1), jnp.int32(nsm)),
                     0).astype(jnp.int32)


def carried_acc_context(pl, plgpu, shape, interpret):
    """``compute_context`` of a warp-specialized pipeline whose f32
    accumulator carries across tiles (the carry of :func:`flush_on_last_step`)."""
    def context(run):
        if interpret:
            pl.run_scoped(lambda a: run((a, a[...])), plgpu.ACC(shape))
        else:
            pl.run_scoped(run, plgpu.ACC(shape))
    return context


def flush_on_last_step(pl, plgpu, carry, last, store, interpret, shape, wait=False):
    """End of a pipeline step whose f32 accumulator carries across tiles: on a
    tile's ``last`` k-step hand it to ``store(val)`` and reset it to zero
    (``wait``: first wait for the wgmma still in flight). Returns the next carry.
    The interpreter cannot store to an accumulator, so there the carry is
    ``(acc_ref, base)`` and the reset is emulated with a running base (test only)."""
    if interpret:
        acc_ref, base = carry
        val = acc_ref[...]

        @pl.when(last)
        def _():
            store(val - base)
        return acc_ref, jnp.where(last, val, base)

    @pl.when(last)
    def _():
        if wait:
            plgpu.wgmma_wait(0)
        store(carry[...])
        carry[...] = jnp.zeros(shape, jnp.float32)
    return carry


def store_rows(pl, plgpu, src_smem, dst, lo, hi, row0, top):
    """TMA-store rows ``[lo, hi)`` (absolute; the tile starts at ``row0``) of a
    staged tile to ``dst`` (indexed by absolute row) as a sum of power-of-two
    row counts (TMA boxes are static)."""
    count = hi - lo
    src = lo - row0
    p = top
    while p >= 1:
        bit = count & p

        @pl.when(bit != 0)
        def _(src=src, p=p):
            plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(src, p)], dst.at[pl.ds(row0 + src, p)])
        src = src + bit
        p //= 2


def store_tail_tiles(pl, plgpu, cnt_ref, n_grp, store, sm, nsm: int, grid_n: int, shape):
    """The forward kernels' tail tiles (rows past the ``n_grp`` group tiles;
    ``cnt_ref[1]`` row tiles of them) dealt round-robin to the SMs:
    ``store(row tile, column tile, zeros of shape)``, no matmul; then wait for
    this consumer's stores."""
    @pl.loop(0, round_robin_count(cnt_ref[1] * grid_n, sm, nsm))
    def _(j):
        t = sm + j * nsm
        store(n_grp + lax.div(t, jnp.int32(grid_n)), lax.rem(t, jnp.int32(grid_n)),
              jnp.zeros(shape, jnp.float32))

    plgpu.wait_smem_to_gmem(0)


def cluster_member(i, cluster: int):
    """This CTA's share of cluster-level index ``i`` (a pair's column tile, a
    cluster among the grid's): ``i * cluster`` + its index in the cluster;
    ``i`` without clusters."""
    return i * cluster + lax.axis_index("cluster") if cluster > 1 else i


def multicast_axes(cluster: int) -> dict:
    """The keyword arguments that multicast a pipeline input to every CTA of a
    cluster (none without clusters: jax 0.10's BlockSpec takes no
    ``collective_axes=None``)."""
    return dict(collective_axes=("cluster",)) if cluster > 1 else {}


def two_consumer_kernel(plgpu, body, out_shape, out_dtype, nsm: int, cluster: int, interpret,
                        **kw):
    """The 2-consumer kernels' launch: ``nsm`` CTAs (or clusters of
    ``cluster``), a producer and two consumer warpgroups each."""
    if cluster > 1:
        kw.update(cluster=(cluster,), cluster_names=("cluster",))
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
                        grid=(nsm,), grid_names=("sm",), num_threads=3, thread_name="wg",
                        **kw, **kernel_params(plgpu, interpret))
