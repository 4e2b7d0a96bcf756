"""CPU tests of jax_ep.grouped_matmul (XLA path everywhere; the Pallas kernels
in Mosaic-GPU interpret mode where this jax has it, and lowered for CUDA)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_ep import gmm as gm_mod
from jax_ep.gmm import registry as gm_registry
from jax_ep.gmm import select as gm_select
from jax_ep.gmm import DwTiles, FwdTiles, GroupedMatmulConfig, grouped_matmul
from jax_ep.gmm.devices import device_info
from jax_ep.gmm.tuning import tuning_for
from jax_ep.gmm import rows as gm_rows
from jax_ep.gmm.pallas_common import (group_spans, row_tile_table, row_tiles,
                                       step_has_outside_rows, tile_at)

try:
    from jax.experimental.pallas import mosaic_gpu as _plgpu
    HAS_INTERPRET = hasattr(_plgpu, "InterpretGPUParams")
except Exception:  # pragma: no cover
    HAS_INTERPRET = False

SIZES = {
    "uniform": [16, 16, 16, 16],
    "empty_groups": [0, 30, 0, 20],
    "skew": [50, 1, 0, 7],
    "partial_tail": [5, 0, 17, 3],          # sum < M: NaN-poisoned tail
    "all_empty": [0, 0, 0, 0],
}
M, K, N, G = 64, 24, 40, 4


def _offsets(sizes):
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def np_gmm(x, w, sizes):
    off = _offsets(sizes)
    out = np.zeros((x.shape[0], w.shape[2]), np.float64)
    for g in range(len(sizes)):
        out[off[g]:off[g + 1]] = x[off[g]:off[g + 1]].astype(np.float64) @ w[g]
    return out


def np_dw(x, dy, sizes):
    """float64 ``[G, K, N]``: ``x[rows of g]^T @ dy[rows of g]``."""
    off = _offsets(sizes)
    return np.stack([x[off[g]:off[g + 1]].astype(np.float64).T @ dy[off[g]:off[g + 1]]
                     for g in range(len(sizes))])


def np_grads(x, w, sizes, dy):
    off = _offsets(sizes)
    dx = np.zeros(x.shape, np.float64)
    for g in range(len(sizes)):
        r = slice(off[g], off[g + 1])
        dx[r] = dy[r].astype(np.float64) @ w[g].T
    return dx, np_dw(x, dy, sizes)


def make(sizes, m=M, k=K, n=N, seed=0, poison=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    tot = int(np.sum(sizes))
    if poison:
        x[tot:] = np.nan
        dy[tot:] = np.inf
    return x, w, dy, np.asarray(sizes, np.int32)


def clean(a, sizes):
    a = np.array(a)
    a[int(np.sum(sizes)):] = 0
    return a


def loss_fn(fn):
    def loss(x, w, gs, dy):
        return jnp.sum(fn(x, w, gs).astype(jnp.float32) * dy)
    return loss


def xla_grads(x, w, gs, dy):
    """VJP of our function with a poison-free cotangent path (dy tail may be inf)."""
    y, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, impl="xla"), x, w)
    return y, vjp(dy)


@pytest.mark.parametrize("case", sorted(SIZES))
def test_forward_matches_numpy_and_ragged_dot(case):
    sizes = SIZES[case]
    x, w, _, gs = make(sizes)
    y = np.asarray(jax.jit(lambda a, b, s: grouped_matmul(a, b, s))(x, w, gs))
    ref = np_gmm(clean(x, sizes), w, sizes)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
    assert np.all(y[int(np.sum(sizes)):] == 0)
    rd = np.asarray(jax.lax.ragged_dot(jnp.asarray(clean(x, sizes)), w, gs))
    np.testing.assert_allclose(y, rd, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", sorted(SIZES))
def test_gradients_match_numpy_and_ragged_dot(case):
    sizes = SIZES[case]
    x, w, dy, gs = make(sizes)
    y, (dx, dw) = jax.jit(xla_grads)(x, w, gs, dy)
    dx, dw = np.asarray(dx), np.asarray(dw)
    assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))
    rdx, rdw = np_grads(clean(x, sizes), w, sizes, clean(dy, sizes))
    np.testing.assert_allclose(dx, rdx, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-4)
    assert np.all(dx[int(np.sum(sizes)):] == 0)
    # against autodiff of jax.lax.ragged_dot on poison-free inputs
    xc, dyc = jnp.asarray(clean(x, sizes)), jnp.asarray(clean(dy, sizes))
    _, rvjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs), xc, jnp.asarray(w))
    jdx, jdw = rvjp(dyc)
    np.testing.assert_allclose(dx, np.asarray(jdx), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw, np.asarray(jdw), rtol=1e-5, atol=1e-4)


def test_grad_under_checkpoint_and_jit():
    sizes = SIZES["partial_tail"]
    x, w, dy, gs = make(sizes)

    @jax.jit
    def g(x, w):
        f = jax.checkpoint(lambda a, b: jnp.tanh(grouped_matmul(a, b, gs)))
        return jax.grad(lambda a, b: jnp.sum(f(a, b) * jnp.asarray(clean(dy, sizes))),
                        argnums=(0, 1))(x, w)

    dx, dw = g(x, w)
    assert np.all(np.isfinite(np.asarray(dx))) and np.all(np.isfinite(np.asarray(dw)))

    def ref(xc, w):
        return jnp.sum(jnp.tanh(jax.lax.ragged_dot(xc, w, gs)) * clean(dy, sizes))
    rdx, rdw = jax.grad(ref, argnums=(0, 1))(jnp.asarray(clean(x, sizes)), w)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(rdx), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(rdw), rtol=1e-5, atol=1e-4)


def test_bf16_output_dtype_and_preferred_element_type():
    sizes = SIZES["skew"]
    x, w, dy, gs = make(sizes)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    y = grouped_matmul(xb, wb, gs)
    assert y.dtype == jnp.bfloat16
    y32 = grouped_matmul(xb, wb, gs, preferred_element_type=jnp.float32)
    assert y32.dtype == jnp.float32
    ref = np_gmm(clean(np.asarray(xb, np.float32), sizes), np.asarray(wb, np.float32), sizes)
    np.testing.assert_allclose(np.asarray(y32), ref, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2e-2, atol=2e-1)
    dx, dw = jax.grad(lambda a, b: jnp.sum(grouped_matmul(a, b, gs).astype(jnp.float32)),
                      argnums=(0, 1))(xb, wb)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(dx, np.float32)))
    assert np.all(np.isfinite(np.asarray(dw, np.float32)))


def test_shard_map_check_vma_grad_remat():
    devs = jax.devices()
    if len(devs) < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = Mesh(np.array(devs[:8]), ("ep",))
    rng = np.random.default_rng(1)
    R, m = 8, 32
    sizes = rng.integers(0, 9, size=(R, G)).astype(np.int32)
    sizes[0] = 0                                           # a rank with nothing
    x = rng.standard_normal((R, m, K)).astype(np.float32)
    w_sh = rng.standard_normal((R, G, K, N)).astype(np.float32)   # per-rank experts
    w_rep = rng.standard_normal((G, K, N)).astype(np.float32)     # replicated
    dy = rng.standard_normal((R, m, N)).astype(np.float32)
    for r in range(R):
        x[r, sizes[r].sum():] = np.nan

    def per_rank(x, w, wr, gs, dy):
        x, w, gs, dy = x[0], w[0], gs[0], dy[0]
        f = jax.checkpoint(lambda a, b, c: grouped_matmul(a, b, gs) + grouped_matmul(a, c, gs))
        y, (dx, dw, dwr) = jax.value_and_grad(
            lambda a, b, c: jnp.sum(f(a, b, c) * dy), argnums=(0, 1, 2))(x, w, wr)
        return f(x, w, wr)[None], dx[None], dw[None], dwr

    fn = jax.jit(jax.shard_map(per_rank, mesh=mesh,
                               in_specs=(P("ep"), P("ep"), P(), P("ep"), P("ep")),
                               out_specs=(P("ep"), P("ep"), P("ep"), P()),
                               check_vma=True))
    y, dx, dw, dwr = (np.asarray(a) for a in fn(x, w_sh, w_rep, sizes, dy))
    dwr_ref = np.zeros_like(w_rep, np.float64)
    for r in range(R):
        xc = clean(x[r], sizes[r])
        np.testing.assert_allclose(y[r], np_gmm(xc, w_sh[r], sizes[r]) + np_gmm(xc, w_rep, sizes[r]),
                                   rtol=1e-4, atol=1e-3)
        rdx1, rdw1 = np_grads(xc, w_sh[r], sizes[r], clean(dy[r], sizes[r]))
        rdx2, rdw2 = np_grads(xc, w_rep, sizes[r], clean(dy[r], sizes[r]))
        np.testing.assert_allclose(dx[r], rdx1 + rdx2, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(dw[r], rdw1, rtol=1e-4, atol=1e-3)
        dwr_ref += rdw2
    # w replicated: its gradient is summed over ranks (pcast's transpose)
    np.testing.assert_allclose(dwr, dwr_ref, rtol=1e-4, atol=1e-3)


def test_gnk_weight_layout():
    """w_layout="gnk" (w [G, N, K]) is the same matmul on the transposed weight,
    its gradient transposed back."""
    sizes = SIZES["partial_tail"]
    x, w, dy, gs = make(sizes)
    wt = np.swapaxes(w, 1, 2)
    y, (dx, dw) = jax.jit(xla_grads)(x, w, gs, dy)
    yt, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, w_layout="gnk"), x, wt)
    dxt, dwt = vjp(jnp.asarray(dy))
    np.testing.assert_allclose(np.asarray(yt), np.asarray(y), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dxt), np.asarray(dx), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dwt), np.swapaxes(np.asarray(dw), 1, 2),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="w_layout"):
        grouped_matmul(x, w, gs, w_layout="nk")


def test_sum_larger_than_m_is_clipped():
    x, w, _, _ = make([10, 10, 10, 10], poison=False)
    gs = np.array([30, 30, 30, 30], np.int32)                 # sum 120 > M = 64
    y = np.asarray(grouped_matmul(x, w, gs))
    np.testing.assert_allclose(y, np_gmm(x, w, [30, 30, 4, 0]), rtol=1e-5, atol=1e-4)


def test_config_and_validation():
    cfg = GroupedMatmulConfig(fwd=[128, 128, 64, 4, 2])
    assert cfg.fwd == FwdTiles(128, 128, 64, 4, 2) and hash(cfg)
    assert cfg.dw is None and GroupedMatmulConfig(dw=cfg.fwd).dw == DwTiles(128, 128, 64, 4, 2)
    with pytest.raises(ValueError):
        GroupedMatmulConfig(impl="cuda")
    with pytest.raises(ValueError):
        GroupedMatmulConfig(dx=(1, 2, 3))
    for bad in (3, 0, True):
        with pytest.raises(ValueError, match="dw_cluster"):
            GroupedMatmulConfig(dw_cluster=bad)
    with pytest.raises(ValueError, match="dw_pipeline"):
        GroupedMatmulConfig(dw_pipeline="per_sm")
    # dw defaults: the ring on 2-CTA clusters, the per-group pipeline for small groups
    d = GroupedMatmulConfig()
    assert d.dw_cluster == 2
    big, small = jnp.zeros((128 * 200, 8)), jnp.zeros((128 * 90, 8))
    assert gm_select.dw_pipeline(d, big, 128) == "ring"
    assert gm_select.dw_pipeline(d, small, 128) == "per_group"
    assert gm_select.dw_pipeline(GroupedMatmulConfig(dw_pipeline="ring"), small, 128) == "ring"
    x, w, _, gs = make(SIZES["uniform"])
    with pytest.raises(ValueError):
        grouped_matmul(x, w[:, :3], gs)
    with pytest.raises(ValueError):
        grouped_matmul(x, w, gs[:2])
    # f32 is not a Pallas dtype: forcing it is an error, auto quietly uses XLA
    with pytest.raises(ValueError, match="16-bit"):
        grouped_matmul(x, w, gs, impl="pallas")
    assert gm_select.plan(GroupedMatmulConfig(), "fwd", jnp.asarray(x), jnp.asarray(w),
                          w.shape[0], jnp.dtype(jnp.float32)).variant is gm_registry.XLA


# ---------------------------------------------------------------- Pallas path

PALLAS_CFG = GroupedMatmulConfig(impl="pallas", interpret=True, fwd=(64, 64, 64, 2, 2),
                                 dx=(64, 64, 32, 2, 1), dw=(64, 64, 16, 2, 2))
PSIZES = {
    "unaligned_empty_tail": [70, 0, 33, 1, 60],        # sum 164 < 200
    "skew_full": [0, 190, 10, 0, 0],
    "all_empty": [0, 0, 0, 0, 0],
    "ends_at_m": [70, 0, 33, 1, 96],                   # sum 200 = m: last tiles moved back
}


def _plan(cfg, op, x, w, groups=None):
    """The kernel the config runs ``op`` with (``w`` is ``dy`` for dw)."""
    return gm_select.plan(cfg, op, x, w, w.shape[0] if groups is None else groups, x.dtype)


@pytest.mark.parametrize("bk", [32, 64])
def test_dw_zeroing_runs_exactly_on_steps_with_foreign_rows(bk):
    """step_has_outside_rows (the dw kernels' zeroing predicate) against the
    rows each k-step stages: from the group's start rounded down to 8, bk rows
    per step; a step needs the pass iff one of its rows is outside the group."""
    cases, want = [], []
    for start in range(0, 40):
        for size in range(1, 3 * bk + 9):
            lead = start % 8
            nsteps = -(-(size + lead) // bk)
            for st in range(nsteps):
                rows = np.arange(st * bk, (st + 1) * bk)          # relative to start - lead
                want.append(bool(np.any((rows < lead) | (rows >= lead + size))))
                cases.append((st, nsteps, lead, size))
    st, nsteps, lead, size = (jnp.asarray(c, jnp.int32) for c in zip(*cases))
    got = np.asarray(step_has_outside_rows(st, nsteps, lead, size, bk))
    bad = np.nonzero(got != np.asarray(want))[0]
    assert bad.size == 0, [cases[i] for i in bad[:5]]


@pytest.mark.slow
@pytest.mark.parametrize("bm", [64, 128])
def test_row_tiles_cover_every_row_once(bm):
    """The forward/dx tile table: every row of [0, m) stored by exactly one tile
    of its own group (tail: group -1), loads 8-aligned and inside [0, m),
    < one extra tile per group, unused entries last."""
    rng = np.random.default_rng(bm)
    for trial in range(40):
        G = int(rng.integers(1, 20))
        m = 8 * int(rng.integers(bm // 8, 120))
        sizes = rng.integers(0, 3 * bm, size=G)
        sizes[rng.random(G) < 0.3] = 0
        if trial % 3 == 0:     # fill exactly m
            sizes = np.floor(sizes / max(sizes.sum(), 1) * m).astype(int)
            sizes[-1] += m - sizes.sum()
        off = np.concatenate([[0], np.minimum(np.cumsum(sizes), m)]).astype(np.int32)
        row, lo, hi, g = (np.asarray(a) for a in row_tiles(jnp.asarray(off), m, bm))
        owner = np.full(m, -2)
        used = hi > lo
        assert not np.any(used[np.argmin(used):]) or used.all()   # unused entries last
        for r0, a, b, gg in zip(row[used], lo[used], hi[used], g[used]):
            assert r0 % 8 == 0 and 0 <= r0 and r0 + bm <= m and r0 <= a < b <= r0 + bm
            assert np.all(owner[a:b] == -2)
            owner[a:b] = gg
        want = np.full(m, -1)
        for gi in range(G):
            want[off[gi]:off[gi + 1]] = gi
        np.testing.assert_array_equal(owner, want)
        n_groups = sum(-(-(off[i + 1] - off[i] // 8 * 8) // bm) for i in range(G)
                       if off[i + 1] > off[i])
        assert int(used.sum()) == n_groups + -(-(m - off[-1] // 8 * 8) // bm)


@pytest.mark.skipif(not HAS_INTERPRET, reason="needs jax with Mosaic-GPU interpret mode")
@pytest.mark.parametrize("case", sorted(PSIZES))
def test_pallas_kernels_interpret(case):
    sizes = PSIZES[case]
    x, w, dy, gs = make(sizes, m=200, k=128, n=128, seed=3)
    xb, wb, dyb = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, dy))
    xf, wf, dyf = (np.asarray(a, np.float32) for a in (xb, wb, dyb))
    y, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, config=PALLAS_CFG), xb, wb)
    dx, dw = vjp(dyb)
    y, dx, dw = (np.asarray(a, np.float32) for a in (y, dx, dw))
    ref = np_gmm(clean(xf, sizes), wf, sizes)
    rdx, rdw = np_grads(clean(xf, sizes), wf, sizes, clean(dyf, sizes))
    tol = dict(rtol=2e-2, atol=0.3)
    np.testing.assert_allclose(y, ref, **tol)
    np.testing.assert_allclose(dx, rdx, **tol)
    np.testing.assert_allclose(dw, rdw, **tol)
    tot = int(np.sum(sizes))
    assert np.all(y[tot:] == 0) and np.all(dx[tot:] == 0)
    for g in np.flatnonzero(np.asarray(sizes) == 0):
        assert np.all(dw[g] == 0)


@pytest.mark.parametrize("op", ["fwd", "dx", "dw", "fwd_ws", "dx_ws", "dw_1wg", "fwd_small_ws",
                                "dx_small", "dx_small_ws", "dw_small", "dw_small_1wg", "dw_c2",
                                "dw_small_c2", "dw_ring", "dw_small_ring", "dw_ring_c2"])
def test_pallas_lowers_for_cuda(op):
    """Every kernel traces and lowers to a CUDA module (no GPU needed);
    ``*_small*``: 64 rows per group, the small-group tiles."""
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    m, k, n, g = (512 if "small" in op else 1024), 512, 256, 8
    cfg = GroupedMatmulConfig(impl="pallas", fwd_warpgroups=2 if op.endswith("_ws") else 1,
                              dw_warpgroups=1 if op.endswith("_1wg") else 2,
                              dw_cluster=2 if op.endswith("_c2") else 1,
                              dw_pipeline="ring" if "_ring" in op else "per_group")
    op = op.split("_")[0]
    gsd = sds((g,), jnp.int32)
    if op == "fwd":
        f = functools.partial(gm_mod.gmm, config=cfg)
        args = (sds((m, k), bf), sds((g, k, n), bf), gsd)
    elif op == "dx":
        f = functools.partial(gm_mod.gmm, transpose_rhs=True, config=cfg)
        args = (sds((m, n), bf), sds((g, k, n), bf), gsd)
    else:
        f = functools.partial(gm_mod.tgmm, config=cfg)
        args = (sds((m, k), bf), sds((m, n), bf), gsd)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_small_group_tiles():
    """fwd, dx and dw take the small-group tiles where the config leaves their
    tiles unset and rows / groups <= small_group_rows (the V3 layer at T 128:
    9088 rows, 128 groups); the default at T 1024 (16256 rows), for tiles the
    user set, and where the small tiles do not fit the shape."""
    tuned = tuning_for(device_info().kind)
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    w = sds((128, 7168, 4096), bf)          # dx: dy [M, 4096] @ w[g]^T
    small, dflt = tuned.small.dx, tuned.default.dx
    cfg = GroupedMatmulConfig()
    assert gm_select.op_tiles(cfg, "dx", sds((9088, 4096), bf), w, 128) == small
    assert gm_select.op_tiles(cfg, "dx", sds((16256, 4096), bf), w, 128) == dflt
    w_up = sds((128, 7168, 4096), bf)       # fwd: x [M, 7168] @ w[g]
    small_fwd = tuned.small.fwd
    assert gm_select.op_tiles(cfg, "fwd", sds((9088, 7168), bf), w_up, 128) == small_fwd
    assert gm_select.op_tiles(cfg, "fwd", sds((16256, 7168), bf), w_up, 128) \
        == tuned.default.fwd
    # the 2-consumer kernel runs the small forward tiles as they are (2 stages fit)
    assert gm_registry.GMM_WS.fit("fwd", small_fwd, sds((9088, 7168), bf), w_up,
                                  device_info()) == small_fwd
    mine = GroupedMatmulConfig(dx=(128, 128, 64, 4, 2))
    assert gm_select.op_tiles(mine, "dx", sds((9088, 4096), bf), w, 128) == FwdTiles(128, 128, 64, 4, 2)
    odd = sds((128, 7168, 4160), bf)        # K = 4160: not a multiple of block_k 128
    assert gm_select.op_tiles(cfg, "dx", sds((9088, 4160), bf), odd, 128) == dflt
    # dw: x [M, H] ^T @ dy [M, 2F], the group count from group_sizes
    x, dy = sds((9088, 7168), bf), sds((9088, 4096), bf)
    small_dw = tuned.small.dw
    assert gm_select.op_tiles(cfg, "dw", x, dy, 128) == small_dw
    assert gm_select.op_tiles(cfg, "dw", x, dy, 64) == tuned.default.dw
    assert gm_select.op_tiles(GroupedMatmulConfig(dw=(128, 128, 64, 3, 4)), "dw", x, dy, 128) \
        == DwTiles(128, 128, 64, 3, 4)
    # the 2-consumer kernel runs them as they are (5 stages fit)
    assert gm_registry.TGMM_WS.fit("dw", small_dw, x, dy, device_info()) == small_dw


def test_expected_rows_sizes_the_tiles():
    """``expected_rows`` replaces rows / groups in the tile choice: the masked
    layout at decode (32 groups of capacity 1024 holding ~32 rows) gets the
    small-group tiles and the per-group dw pipeline; a bad value is refused."""
    tuned = tuning_for(device_info().kind)
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    x, w = sds((32 * 1024, 7168), bf), sds((32, 7168, 4096), bf)
    assert gm_select.op_tiles(GroupedMatmulConfig(), "fwd", x, w, 32) == tuned.default.fwd
    hint = GroupedMatmulConfig(expected_rows=32)
    assert gm_select.op_tiles(hint, "fwd", x, w, 32) == tuned.small.fwd
    assert gm_select.dw_pipeline(hint, x, 32) == tuned.small.dw_pipeline
    assert gm_select.op_tiles(GroupedMatmulConfig(expected_rows=4096), "fwd",
                              sds((9088, 7168), bf), w, 128) == tuned.default.fwd
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="expected_rows must be None or a positive int"):
            GroupedMatmulConfig(expected_rows=bad)


def test_pallas_constraints_fall_back_to_xla():
    bf = jnp.bfloat16
    x = jax.ShapeDtypeStruct((260, 512), bf)          # M % 8 != 0
    w = jax.ShapeDtypeStruct((4, 512, 256), bf)
    check = functools.partial(gm_registry.GMM.check, dev=device_info())
    assert "M % 8" in check("fwd", FwdTiles(128, 128, 64, 4, 4), x, w, jnp.dtype(bf))
    x = jax.ShapeDtypeStruct((264, 512), bf)
    assert check("fwd", FwdTiles(128, 128, 64, 4, 4), x, w, jnp.dtype(bf)) is None
    assert check("fwd", FwdTiles(128, 128, 64, 4, 4), x, w, jnp.dtype(jnp.float32))
    assert check("fwd", FwdTiles(128, 384, 64, 4, 4), x, w, jnp.dtype(bf))
    # not on a Hopper GPU here: auto uses XLA
    assert gm_select.plan(GroupedMatmulConfig(), "fwd", x, w, w.shape[0],
                          jnp.dtype(bf)).variant is gm_registry.XLA


@pytest.mark.skipif(not HAS_INTERPRET, reason="needs jax with Mosaic-GPU interpret mode")
@pytest.mark.parametrize("sizes", [[70, 0, 33, 1, 60], [0, 3, 197, 50], [7, 0, 0, 193],
                                   [0, 0, 0, 0, 0]])
def test_pallas_fwd_dx_two_warpgroups_interpret(sizes):
    """The 2-consumer forward/dx kernel (fwd_warpgroups=2, the default; one
    pipeline per SM across its tiles): empty groups, sizes past M (clipped), a
    group ending at M, no rows at all, NaN/Inf tail -- matches numpy. k = 3
    block_k with 2 stages: tiles change mid-ring."""
    x, w, dy, gs = make(sizes, m=200, k=192, n=256, seed=7)
    xb, wb, dyb = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, dy))
    cfg = GroupedMatmulConfig(impl="pallas", interpret=True, fwd=(64, 64, 64, 2, 1),
                              dx=(64, 64, 64, 2, 1), fwd_warpgroups=2)
    assert _plan(cfg, "fwd", xb, wb).variant is gm_registry.GMM_WS
    y = np.asarray(gm_mod.gmm(xb, wb, gs, config=cfg), np.float32)
    dx = np.asarray(gm_mod.gmm(dyb, wb, gs, transpose_rhs=True, config=cfg), np.float32)
    xf, wf, dyf = (np.asarray(a, np.float32) for a in (xb, wb, dyb))
    s = np.diff(np.concatenate([[0], np.minimum(np.cumsum(sizes), 200)]))   # clipped to M
    ref = np_gmm(clean(xf, s), wf, s)
    rdx, _ = np_grads(clean(xf, s), wf, s, clean(dyf, s))
    np.testing.assert_allclose(y, ref, rtol=2e-2, atol=0.3)
    np.testing.assert_allclose(dx, rdx, rtol=2e-2, atol=0.3)
    tot = int(np.sum(s))
    assert np.all(y[tot:] == 0) and np.all(dx[tot:] == 0)


def dw_race_detector(monkeypatch):
    """The dw kernels' own kernel params with the interpreter's race detector
    on; returns the interpreter module whose ``get_races()`` reports."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from jax_ep.gmm import pallas_dw

    plain = pallas_dw.kernel_params

    def params(plgpu, interpret):
        return dict(plain(plgpu, interpret), interpret=plgpu.InterpretGPUParams(detect_races=True))
    monkeypatch.setattr(pallas_dw, "kernel_params", params)
    return ipc


@pytest.mark.skipif(not HAS_INTERPRET, reason="needs jax with Mosaic-GPU interpret mode")
def test_pallas_dw_output_slot_no_races(monkeypatch):
    """The 2-consumer dw kernel under the interpreter's race detector: no
    consumer writes its output slot before the TMA store of the chunk before
    has read it, across tiles and groups (1-2 tiles per SM per group, empty
    groups). The plain interpret tests cannot see this: there
    TMA stores finish at once. Sizes are whole k-steps: the zeroing pass's
    identical writes by both consumers are reported as races by design."""
    ipc = dw_race_detector(monkeypatch)
    sizes = [32, 64, 0, 96, 32, 0, 64, 0, 32]
    x, _, dy, gs = make(sizes, m=424, k=256, n=192, seed=8)
    xb, dyb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    tiles = (64, 64, 32, 3, 1)
    out = np.asarray(gm_mod.tgmm(xb, dyb, gs, config=GroupedMatmulConfig(
        impl="pallas", interpret=True, dw=tiles, dw_cluster=1, dw_pipeline="per_group")), np.float32)
    assert not ipc.get_races().races_found
    ref = np_dw(np.asarray(xb, np.float32), np.asarray(dyb, np.float32), sizes)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=0.3)


@pytest.mark.parametrize("sizes", [[130, 0, 190, 64, 1, 7], [0, 0, 0], [256] * 4, [5, 700],
                                   "masked"])
def test_group_order_visits_each_tile_once_by_group(sizes):
    """The forward's group order (band 0, ``pallas_common.tile_at``) over the
    row-tile table, on the 1-warpgroup kernel's grid (every entry) and the
    2-consumer kernel's (the group tiles, ``row_tile_table``'s first count):
    every (row tile, column tile) once; the linear order runs group by group,
    and inside a group its row tiles side by side at each column tile (column
    tiles ascending), so a ``w[g]`` tile is wanted by consecutive work items
    only. "masked": the masked layout's fixed starts, sizes clipped."""
    bm, grid_n, m = 64, 3, 1200
    if sizes == "masked":
        off = gm_rows.masked(jnp.asarray([0, 200, 7, 64, 1], jnp.int32), 160)
        m = 5 * 160
    else:
        off = jnp.asarray(np.concatenate([[0], np.minimum(np.cumsum(sizes), m)]), jnp.int32)
    counts, _, _, _, grp = row_tile_table(off, m, bm)
    spans = group_spans(grp)
    for nf in (grp.shape[0], int(counts[0])):
        t = jnp.arange(nf * grid_n, dtype=jnp.int32)
        r, c = (np.asarray(a) for a in tile_at(None, t, (nf, grid_n), 0, spans))
        assert sorted(zip(r.tolist(), c.tolist())) == [(i, j) for i in range(nf)
                                                       for j in range(grid_n)]
        g = np.asarray(grp)[r]
        assert np.all(np.diff(np.where(g < 0, nf, g)) >= 0)    # group by group, the tail last
        for gi in np.unique(g):
            rows, cols = r[g == gi], c[g == gi]
            n_g = len(np.unique(rows))
            assert np.all(np.diff(cols) >= 0) and np.all(np.bincount(cols) == n_g)


@pytest.mark.skipif(not HAS_INTERPRET, reason="needs jax with Mosaic-GPU interpret mode")
@pytest.mark.parametrize("warpgroups", [2, 1])
def test_pallas_group_order_interpret(warpgroups):
    """Forward and dx in the group order (band 0) on both forward kernels:
    groups of 1-3 row tiles, an empty group, a 1-row group, a tail -- match
    numpy, and the snake's (band 1) outputs (to the interpreter's rounding:
    its accumulation differs by an ulp between tile orders)."""
    sizes = [130, 0, 190, 64, 1]
    x, w, dy, gs = make(sizes, m=448, k=128, n=256, seed=13)
    xb, wb, dyb = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, dy))

    def run(band):
        t = (64, 64, 64, 2, band)
        cfg = GroupedMatmulConfig(impl="pallas", interpret=True, fwd=t, dx=t,
                                  fwd_warpgroups=warpgroups)
        want = gm_registry.GMM_WS if warpgroups == 2 else gm_registry.GMM
        assert _plan(cfg, "fwd", xb, wb).variant is want
        assert _plan(cfg, "dx", dyb, wb).variant is want
        return [np.asarray(a, np.float32) for a in (
            gm_mod.gmm(xb, wb, gs, config=cfg),
            gm_mod.gmm(dyb, wb, gs, transpose_rhs=True, config=cfg))]
    (y, dx), (y1, dx1) = run(0), run(1)
    xf, wf, dyf = (np.asarray(a, np.float32) for a in (xb, wb, dyb))
    rdx, _ = np_grads(clean(xf, sizes), wf, sizes, clean(dyf, sizes))
    np.testing.assert_allclose(y, np_gmm(clean(xf, sizes), wf, sizes), rtol=2e-2, atol=0.3)
    np.testing.assert_allclose(dx, rdx, rtol=2e-2, atol=0.3)
    np.testing.assert_allclose(y, y1, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(dx, dx1, rtol=1e-2, atol=1e-2)
    tot = int(np.sum(sizes))
    assert np.all(y[tot:] == 0) and np.all(dx[tot:] == 0)


@pytest.mark.skipif(not HAS_INTERPRET, reason="needs jax with Mosaic-GPU interpret mode")
@pytest.mark.parametrize("sizes", [[70, 0, 150, 1, 100, 33], [70, 0, 150, 1, 129, 40]])
def test_pallas_128_row_two_consumer_interpret(sizes):
    """The 2-consumer kernels at 128-row consumer tiles, whose output goes
    to HBM in two 64-row chunks (EPILOGUE_ROWS), groups whose stored rows start
    and end inside either chunk -- forward, dx and dw match numpy; the chunks
    leave room for a 4th stage at the default tiles. Second case: tiles
    whose stored rows lie in the upper chunk only (the last tiles, moved back
    to end at M)."""
    x, w, dy, gs = make(sizes, m=400, k=256, n=256, seed=11)
    xb, wb, dyb = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, dy))
    tiles = (128, 64, 64, 3, 1)
    cfg = GroupedMatmulConfig(impl="pallas", interpret=True, fwd=tiles, dx=tiles, dw=tiles)
    assert _plan(cfg, "fwd", xb, wb).variant is gm_registry.GMM_WS
    assert _plan(cfg, "dx", dyb, wb).variant is gm_registry.GMM_WS
    y, dx, dw = (np.asarray(a, np.float32) for a in (
        gm_mod.gmm(xb, wb, gs, config=cfg),
        gm_mod.gmm(dyb, wb, gs, transpose_rhs=True, config=cfg),
        gm_mod.tgmm(xb, dyb, gs, config=cfg)))
    xf, wf, dyf = (np.asarray(a, np.float32) for a in (xb, wb, dyb))
    rdx, rdw = np_grads(clean(xf, sizes), wf, sizes, clean(dyf, sizes))
    tol = dict(rtol=2e-2, atol=0.3)
    np.testing.assert_allclose(y, np_gmm(clean(xf, sizes), wf, sizes), **tol)
    np.testing.assert_allclose(dx, rdx, **tol)
    np.testing.assert_allclose(dw, rdw, **tol)
    tot = int(np.sum(sizes))
    assert np.all(y[tot:] == 0) and np.all(dx[tot:] == 0)
    bf, sds, dev = jnp.bfloat16, jax.ShapeDtypeStruct, device_info()
    assert gm_registry.GMM_WS.fit("fwd", FwdTiles(128, 128, 64, 5, 2), sds((1024, 7168), bf),
                                  sds((8, 7168, 4096), bf), dev).stages == 4
    assert gm_registry.TGMM_WS.fit("dw", DwTiles(128, 128, 64, 4, 4), sds((1024, 7168), bf),
                                   sds((1024, 4096), bf), dev).stages == 4


@pytest.mark.skipif(not HAS_INTERPRET, reason="needs jax with Mosaic-GPU interpret mode")
def test_pallas_small_group_interpret():
    """Forward and dx with the small-group tiles (unset, 64 rows per group on
    average): block_m 64 (dx: block_k 128) with the 2-consumer kernel --
    match numpy, tail zero."""
    sizes = [64, 0, 37, 100, 19]
    x, w, dy, gs = make(sizes, m=256, k=256, n=512, seed=9)   # n: 2 x block_n 256
    wb, dyb = jnp.asarray(w, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    cfg = GroupedMatmulConfig(impl="pallas", interpret=True)
    small = tuning_for(device_info().kind).small
    assert gm_select.op_tiles(cfg, "dx", dyb, wb, wb.shape[0]) == small.dx
    assert _plan(cfg, "dx", dyb, wb).variant is gm_registry.GMM_WS
    xb = jnp.asarray(x, jnp.bfloat16)
    assert _plan(cfg, "fwd", xb, wb) == gm_select.Plan(gm_registry.GMM_WS, small.fwd)
    dx = np.asarray(gm_mod.gmm(dyb, wb, gs, transpose_rhs=True, config=cfg), np.float32)
    y = np.asarray(gm_mod.gmm(xb, wb, gs, config=cfg), np.float32)
    xf, wf, dyf = (np.asarray(a, np.float32) for a in (xb, wb, dyb))
    rdx, _ = np_grads(clean(xf, sizes), wf, sizes, clean(dyf, sizes))
    np.testing.assert_allclose(dx, rdx, rtol=2e-2, atol=0.3)
    np.testing.assert_allclose(y, np_gmm(clean(xf, sizes), wf, sizes), rtol=2e-2, atol=0.3)
    tot = int(np.sum(sizes))
    assert np.all(dx[tot:] == 0) and np.all(y[tot:] == 0)


@pytest.mark.skipif(not HAS_INTERPRET, reason="needs jax with Mosaic-GPU interpret mode")
@pytest.mark.parametrize("sizes", [[70, 0, 33, 1, 60], [8, 8, 100, 50, 0], [32, 64, 0, 96],
                                   [5, 17, 0, 9, 40, 3, 0, 31, 60, 2, 33]])
def test_pallas_dw_interpret(sizes):
    """dw, both kernels (1 and 2 consumer warpgroups): several tiles per SM,
    empty groups, NaN/Inf tail, groups that start off the 8-row boundary or
    end inside a k-step (zeroing pass) and groups on step boundaries (none) --
    matches numpy."""
    x, _, dy, gs = make(sizes, m=200, k=256, n=192, seed=5)
    xb, dyb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    tiles = (64, 64, 32, 3, 1)            # 4 x 3 (1 wg) or 2 x 3 (2 wg) tiles on 4 "SMs"
    outs = [np.asarray(gm_mod.tgmm(xb, dyb, gs, config=GroupedMatmulConfig(
        impl="pallas", interpret=True, dw=tiles, dw_warpgroups=wgs)), np.float32)
        for wgs in (1, 2)]
    ref = np_dw(np.asarray(xb, np.float32), np.asarray(dyb, np.float32), sizes)
    for out in outs:
        assert np.all(np.isfinite(out))
        np.testing.assert_allclose(out, ref, rtol=2e-2, atol=0.3)
    for out in outs:
        np.testing.assert_array_equal(out[np.asarray(sizes) == 0], 0)


@pytest.mark.skipif(not HAS_INTERPRET, reason="needs jax with Mosaic-GPU interpret mode")
@pytest.mark.parametrize("sizes", [[70, 0, 33, 1, 60], [5, 17, 0, 9, 40, 3, 0, 31, 60, 2, 33],
                                   [64, 0, 32, 96]])
@pytest.mark.parametrize("pipeline", ["per_group", "ring"])
def test_pallas_dw_cluster_interpret(sizes, pipeline):
    """dw on 2-CTA clusters (the x tile multicast to both CTAs, buffers and
    barriers reused by every group's pipeline): several k-steps per group
    beyond the stages, empty groups, groups off the 8-row boundary (zeroing in
    each CTA's copy of x), NaN/Inf tail, 1-2 cluster tiles per cluster, with
    either pipeline (per group, or the ring across groups) -- matches numpy. (Interpret mode carries each accumulator across tiles with a
    running base, so it is not bit-comparable with the 1-CTA kernel, whose SMs
    take other tiles; the GPU test compares them bit for bit.)"""
    x, _, dy, gs = make(sizes, m=200, k=256, n=256, seed=5)
    xb, dyb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    tiles = (64, 64, 32, 3, 1)    # cluster tile 128 x 128: 2 x 2 on 2 clusters of 2 "SMs"
    cfg = GroupedMatmulConfig(impl="pallas", interpret=True, dw=tiles, dw_cluster=2,
                              dw_pipeline=pipeline)
    assert _plan(cfg, "dw", xb, dyb, len(sizes)).cluster == 2
    assert _plan(cfg, "dw", xb, dyb[:, :192], len(sizes)).cluster == 1   # N % (2 block_n)
    out = np.asarray(gm_mod.tgmm(xb, dyb, gs, config=cfg), np.float32)
    ref = np_dw(np.asarray(xb, np.float32), np.asarray(dyb, np.float32), sizes)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=0.3)
    np.testing.assert_array_equal(out[np.asarray(sizes) == 0], 0)


@pytest.mark.skipif(not HAS_INTERPRET, reason="needs jax with Mosaic-GPU interpret mode")
@pytest.mark.parametrize("sizes", [[70, 0, 33, 1, 60], [5, 17, 0, 9, 40, 3, 0, 31, 60, 2, 33]])
def test_pallas_dw_ring_interpret(sizes):
    """dw with one ring of stages per SM across groups (``dw_pipeline="ring"``):
    the ring wraps inside and across groups (3 stages, 1-3 k-steps per tile,
    up to 3 tiles per SM per group), empty groups store zeros, zeroing steps --
    matches numpy."""
    x, _, dy, gs = make(sizes, m=200, k=256, n=192, seed=5)
    xb, dyb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    out = np.asarray(gm_mod.tgmm(xb, dyb, gs, config=GroupedMatmulConfig(
        impl="pallas", interpret=True, dw=(64, 64, 32, 3, 1), dw_pipeline="ring")), np.float32)
    ref = np_dw(np.asarray(xb, np.float32), np.asarray(dyb, np.float32), sizes)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=0.3)
    np.testing.assert_array_equal(out[np.asarray(sizes) == 0], 0)


@pytest.mark.skipif(not HAS_INTERPRET, reason="needs jax with Mosaic-GPU interpret mode")
@pytest.mark.parametrize("cluster,pipeline", [(1, "ring"), (2, "ring"), (2, "per_group")])
def test_pallas_dw_ring_no_races(monkeypatch, cluster, pipeline):
    """The ring dw kernel, and the per-group one on clusters (its buffers and
    barriers reused by every group's pipeline, no CTA barrier between groups),
    under the interpreter's race detector: no stage is refilled before every
    consumer (of both CTAs, with clusters) released it, across tiles and
    groups; a group of 5 k-steps (beyond the 3 stages), sizes summing to M.
    The interpreter drops the multicast (each CTA copies the whole x tile), so
    the multicast's own ordering is covered by the GPU bit-equality test only.
    Whole k-steps only (the zeroing pass's identical writes by both consumers
    are races by design)."""
    ipc = dw_race_detector(monkeypatch)
    sizes = [32, 64, 0, 96, 32, 0, 64, 0, 32, 160, 32]
    x, _, dy, gs = make(sizes, m=sum(sizes), k=256, n=256, seed=8)
    xb, dyb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    out = np.asarray(gm_mod.tgmm(xb, dyb, gs, config=GroupedMatmulConfig(
        impl="pallas", interpret=True, dw=(64, 64, 32, 3, 1), dw_pipeline=pipeline,
        dw_cluster=cluster)), np.float32)
    assert not ipc.get_races().races_found
    ref = np_dw(np.asarray(xb, np.float32), np.asarray(dyb, np.float32), sizes)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=0.3)
