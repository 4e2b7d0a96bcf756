"""GPU tests of jax_ep.grouped_matmul's Pallas Mosaic-GPU path (one GPU, one process).

    python -m pytest -q -m gpu tests/gpu/test_grouped_matmul_gpu.py

Pallas kernels vs the XLA path (``jax.lax.ragged_dot``), bf16 with an f32
reference, empty groups, skew, NaN-poisoned tail rows, gradients, and one
DeepSeek-V3 shape (128 groups, 32768 rows, 7168 -> 4096).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep import gmm as gm_mod
from jax_ep.gmm import registry as gm_registry
from jax_ep.gmm import select as gm_select
from jax_ep.gmm import DwTiles, GroupedMatmulConfig, grouped_matmul
from jax_ep.gmm.devices import device_info


def _hopper():
    try:
        d = jax.devices()[0]
    except Exception:
        return False
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9")


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) CUDA GPU"),
]

PALLAS = GroupedMatmulConfig(impl="pallas")
XLA = GroupedMatmulConfig(impl="xla")


def sizes_for(kind, g, total, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        s = np.full(g, total // g)
        s[: total - s.sum()] += 1
    elif kind == "skew":                   # Zipf-like, a quarter of the groups empty
        p = 1.0 / np.arange(1, g + 1) ** 1.2
        rng.shuffle(p)
        p[rng.permutation(g)[: g // 4]] = 0
        s = np.floor(p / p.sum() * total).astype(np.int64)
        s[np.argmax(s)] += total - s.sum()
    elif kind == "unaligned":
        s = rng.integers(0, 2 * total // g, size=g)
        s = np.floor(s / max(s.sum(), 1) * total).astype(np.int64)
    else:
        raise ValueError(kind)
    return s.astype(np.int32)


def data(m, k, n, sizes, seed=0, poison=True):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (len(sizes), k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(jnp.bfloat16)
    tot = int(np.sum(sizes))
    if poison and tot < m:
        x = x.at[tot:].set(jnp.nan)
        dy = dy.at[tot:].set(jnp.inf)
    return x, w, dy, jnp.asarray(sizes)


def clean(a, sizes):
    tot = int(np.sum(sizes))
    return a.at[tot:].set(0)


def rel_err(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_auto_picks_pallas_on_hopper():
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((8, 512, 256), jnp.bfloat16)
    p = gm_select.plan(GroupedMatmulConfig(), "fwd", x, w, 8, jnp.dtype(jnp.bfloat16))
    assert p.variant is gm_registry.GMM_WS


@pytest.mark.parametrize("kind,total", [("uniform", 4096), ("skew", 4096), ("unaligned", 3001),
                                        ("skew", 2500)])
@pytest.mark.parametrize("k,n", [(1024, 512), (512, 1024)])
def test_pallas_vs_xla_small(kind, total, k, n):
    m, g = 4096, 16
    sizes = sizes_for(kind, g, total)
    x, w, dy, gs = data(m, k, n, sizes)
    f = jax.jit(lambda a, b, c, cfg: jax.vjp(
        lambda p, q: grouped_matmul(p, q, gs, config=cfg), a, b)[1](c), static_argnums=3)
    fwd = jax.jit(lambda a, b, cfg: grouped_matmul(a, b, gs, config=cfg), static_argnums=2)
    y = fwd(x, w, PALLAS)
    dx, dw = f(x, w, dy, PALLAS)
    # f32 reference on clean inputs through the XLA path
    xc, dyc = clean(x, sizes).astype(jnp.float32), clean(dy, sizes).astype(jnp.float32)
    wf = w.astype(jnp.float32)
    y_ref = fwd(xc, wf, XLA)
    dx_ref, dw_ref = f(xc, wf, dyc, XLA)
    tot = int(np.sum(sizes))
    for name, a in (("y", y), ("dx", dx), ("dw", dw)):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
    assert np.all(np.asarray(y[tot:], np.float32) == 0)
    assert np.all(np.asarray(dx[tot:], np.float32) == 0)
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(dx, dx_ref) < 1e-2
    assert rel_err(dw, dw_ref) < 1e-2
    for gi in np.flatnonzero(sizes == 0):
        assert np.all(np.asarray(dw[gi], np.float32) == 0)


@pytest.mark.parametrize("tiles,fwd_wgs", [((128, 128, 64, 4, 4), 1), ((64, 256, 64, 4, 2), 1),
                                           ((128, 128, 64, 2, 1), 1), ((128, 128, 64, 5, 2), 2),
                                           ((64, 128, 64, 4, 2), 2), ((64, 256, 64, 2, 2), 2),
                                           ((64, 128, 128, 3, 2), 2),
                                           ((128, 128, 64, 3, 1), 2), ((64, 64, 256, 2, 2), 2),
                                           ((64, 256, 64, 3, 4), 2)])
def test_tile_configs(tiles, fwd_wgs):
    """Tile configurations of every kernel (fwd_wgs 2: the 2-consumer forward/dx,
    one pipeline per SM across its tiles) vs an f32 reference; skewed sizes, NaN tail."""
    m, k, n, g = 2048, 512, 512, 8
    sizes = sizes_for("skew", g, 1900, seed=1)
    x, w, dy, gs = data(m, k, n, sizes, seed=1)
    cfg = GroupedMatmulConfig(impl="pallas", fwd=tiles, dx=tiles, dw=tiles, fwd_warpgroups=fwd_wgs)
    if fwd_wgs == 2:
        assert gm_select.plan(cfg, "fwd", x, w, g, x.dtype).variant is gm_registry.GMM_WS
    y = jax.jit(functools.partial(gm_mod.gmm, config=cfg))(x, w, gs)
    dx = jax.jit(functools.partial(gm_mod.gmm, transpose_rhs=True, config=cfg))(dy, w, gs)
    dw = jax.jit(functools.partial(gm_mod.tgmm, config=cfg))(x, dy, gs)
    xc, dyc, wf = clean(x, sizes).astype(jnp.float32), clean(dy, sizes).astype(jnp.float32), w.astype(jnp.float32)
    assert rel_err(y, gm_mod.gmm(xc, wf, gs, config=XLA)) < 1e-2
    assert rel_err(dx, gm_mod.gmm(dyc, wf, gs, transpose_rhs=True, config=XLA)) < 1e-2
    assert rel_err(dw, gm_mod.tgmm(xc, dyc, gs, config=XLA)) < 1e-2


@pytest.mark.parametrize("kind,total", [("skew", 3900), ("unaligned", 3001), ("uniform", 4096)])
def test_dw_tiles(kind, total):
    """dw, both kernels (1 and 2 consumer warpgroups), several tile
    configurations vs an f32 reference; empty groups exactly zero, NaN tail unused."""
    m, k, n, g = 4096, 2048, 2048, 16
    sizes = sizes_for(kind, g, total, seed=2)
    if kind == "skew":
        sizes[3] = 0
    x, _, dy, gs = data(m, k, n, sizes, seed=2)
    outs = {}
    for tiles in [(128, 128, 64, 4, 4), (128, 128, 128, 2, 4), (128, 128, 64, 3, 8)]:
        for wgs in (1, 2):
            if wgs == 2 and gm_registry.TGMM_WS.fit("dw", DwTiles(*tiles), x, dy,
                                                    device_info()) is None:
                continue  # no stage fits: the 2-warpgroup config runs the 1-warpgroup kernel
            cfg = GroupedMatmulConfig(impl="pallas", dw=tiles, dw_warpgroups=wgs)
            outs[tiles, wgs] = jax.jit(functools.partial(gm_mod.tgmm, config=cfg))(x, dy, gs)
    xc, dyc = clean(x, sizes).astype(jnp.float32), clean(dy, sizes).astype(jnp.float32)
    ref = gm_mod.tgmm(xc, dyc, gs, config=XLA)
    for key, out in outs.items():
        assert bool(jnp.all(jnp.isfinite(out))), key
        assert rel_err(out, ref) < 1e-2, key
        for gi in np.flatnonzero(sizes == 0):
            assert not bool(jnp.any(out[gi] != 0)), (key, gi)


@pytest.mark.parametrize("kind,total,g", [("skew", 3900, 16), ("unaligned", 3001, 16),
                                         ("skew", 3900, 64), ("full", 4096, 16),
                                         ("tiny", 400, 128)])
def test_dw_cluster(kind, total, g):
    """dw on 1- and 2-CTA clusters (x tile multicast), each with the
    per-group pipeline and the ring across groups, and the defaults (g 16:
    ring on clusters; g 64, small groups: per-group on clusters):
    bit-identical to each other (same tiles, same k-step order), against XLA
    in f32, empty groups zero, NaN/Inf tail unused. The auto path takes the
    asked-for kernels (they compile here)."""
    m, k, n = 4096, 2048, 2048
    if kind == "full":      # sum == M, the last group ends off a block_k step: TMA rows past M
        sizes = sizes_for("unaligned", g, total - 40, seed=3)
        sizes[-1] += total - int(sizes.sum())
    elif kind == "tiny":    # many tiny groups: fewer k-steps per SM than stages
        sizes = sizes_for("unaligned", g, total, seed=3)
    else:
        sizes = sizes_for(kind, g, total, seed=3)
    sizes[1] = 0
    x, _, dy, gs = data(m, k, n, sizes, seed=3)
    variants = [dict(dw_cluster=1, dw_pipeline="per_group"), dict(dw_cluster=2, dw_pipeline="per_group"),
                dict(dw_cluster=1, dw_pipeline="ring"), dict(dw_pipeline="ring", dw_cluster=2),
                dict()]
    outs = [jax.jit(functools.partial(gm_mod.tgmm, config=GroupedMatmulConfig(**v)))(x, dy, gs)
            for v in variants]
    for v in variants:
        cfg = GroupedMatmulConfig(**v)   # "auto": the plan's kernels passed the compile check
        p = gm_select.plan(cfg, "dw", x, dy, g, x.dtype)
        assert p.variant is gm_registry.DW_PIPELINE_VARIANT[gm_select.dw_pipeline(cfg, x, g)], v
        assert p.cluster == cfg.dw_cluster, v
    xc, dyc = clean(x, sizes).astype(jnp.float32), clean(dy, sizes).astype(jnp.float32)
    ref = gm_mod.tgmm(xc, dyc, gs, config=XLA)
    for v, out in zip(variants, outs):
        assert bool(jnp.array_equal(outs[0], out)), v
        assert not bool(jnp.any(out[1] != 0)), v
        assert rel_err(out, ref) < 1e-2, v


@pytest.mark.parametrize("kind,total", [("skew", 3900), ("unaligned", 3001)])
def test_dw_small_groups(kind, total):
    """dw of small groups (64 rows per group on average: the small-group tiles
    on the 2-consumer kernel) against XLA in f32; empty groups zero."""
    m, k, n, g = 4096, 2048, 2048, 64
    sizes = sizes_for(kind, g, total, seed=6)
    sizes[5] = 0
    x, _, dy, gs = data(m, k, n, sizes, seed=6)
    assert gm_select.plan(PALLAS, "dw", x, dy, g, x.dtype).variant is gm_registry.TGMM_WS
    one = jax.jit(functools.partial(gm_mod.tgmm, config=PALLAS))(x, dy, gs)
    assert bool(jnp.all(jnp.isfinite(one)))
    assert not bool(jnp.any(one[5] != 0))
    xc, dyc = clean(x, sizes).astype(jnp.float32), clean(dy, sizes).astype(jnp.float32)
    assert rel_err(one, gm_mod.tgmm(xc, dyc, gs, config=XLA)) < 1e-2


def test_v3_shape_up_projection():
    """DeepSeek-V3 per-rank shape: 128 experts, 32768 rows, H=7168 -> 2F=4096."""
    m, k, n, g = 32768, 7168, 4096, 128
    sizes = sizes_for("skew", g, m - 1000)
    x, w, dy, gs = data(m, k, n, sizes)
    y = jax.jit(functools.partial(gm_mod.gmm, config=PALLAS))(x, w, gs)
    dx = jax.jit(functools.partial(gm_mod.gmm, transpose_rhs=True, config=PALLAS))(dy, w, gs)
    dw = jax.jit(functools.partial(gm_mod.tgmm, config=PALLAS))(x, dy, gs)
    off = np.concatenate([[0], np.cumsum(sizes)])
    # dense per-group references on a few groups (largest, a small one, the last non-empty)
    nz = np.flatnonzero(sizes)
    check = sorted({int(np.argmax(sizes)), int(nz[np.argmin(sizes[nz])]), int(nz[-1])})
    for gi in check:
        r = slice(int(off[gi]), int(off[gi + 1]))
        xs, dys, wg = x[r].astype(jnp.float32), dy[r].astype(jnp.float32), w[gi].astype(jnp.float32)
        hp = jax.lax.Precision.HIGHEST
        assert rel_err(y[r], jnp.dot(xs, wg, precision=hp)) < 1e-2, gi
        assert rel_err(dx[r], jnp.dot(dys, wg.T, precision=hp)) < 1e-2, gi
        assert rel_err(dw[gi], jnp.dot(xs.T, dys, precision=hp)) < 1e-2, gi
    tot = int(off[-1])
    assert not np.any(np.asarray(y[tot:], np.float32))
    assert not np.any(np.asarray(dx[tot:], np.float32))
    assert bool(jnp.all(jnp.isfinite(dw)))
    empty = np.flatnonzero(sizes == 0)
    if empty.size:
        assert not bool(jnp.any(dw[jnp.asarray(empty)] != 0))


def test_v3_small_groups_down_projection():
    """The V3 layer at T 128 (EP 1, alignment 64): 128 groups of ~64 rows with
    8 empty and 8 double groups and one of 7 rows, 953 tail rows, down
    projection F=2048 -> H=7168, with the small-group fwd, dx and dw tiles:
    every tile of the SM-wide pipeline lands on its own rows (all groups checked
    against a dense f32 product), the tail is zero; dw of every group against
    a dense f32 product, empty groups exactly zero."""
    m, k, n, g = 9088, 2048, 7168, 128
    rng = np.random.default_rng(12)
    sizes = np.full(g, 64, np.int64)
    sizes[rng.permutation(g)[:12]] = 0
    sizes[rng.permutation(g)[:12]] += 64
    sizes[5] = 7
    x, w, dy, gs = data(m, k, n, sizes, seed=12)
    y = jax.jit(functools.partial(gm_mod.gmm, config=PALLAS))(x, w, gs)
    dx = jax.jit(functools.partial(gm_mod.gmm, transpose_rhs=True, config=PALLAS))(dy, w, gs)
    dw = jax.jit(functools.partial(gm_mod.tgmm, config=PALLAS))(x, dy, gs)
    off = np.concatenate([[0], np.cumsum(sizes)])
    tot = int(off[-1])
    hp = jax.lax.Precision.HIGHEST
    # every group against a dense f32 product: a tile stored into another
    # group's rows would show here
    for gi in np.flatnonzero(sizes):
        r = slice(int(off[gi]), int(off[gi + 1]))
        wg = w[gi].astype(jnp.float32)
        assert rel_err(y[r], jnp.dot(x[r].astype(jnp.float32), wg, precision=hp)) < 1e-2, gi
        assert rel_err(dx[r], jnp.dot(dy[r].astype(jnp.float32), wg.T, precision=hp)) < 1e-2, gi
        assert rel_err(dw[gi], jnp.dot(x[r].astype(jnp.float32).T, dy[r].astype(jnp.float32),
                                       precision=hp)) < 1e-2, gi
    assert not bool(jnp.any(dw[jnp.asarray(np.flatnonzero(sizes == 0))] != 0))
    assert not np.any(np.asarray(y[tot:], np.float32))
    assert not np.any(np.asarray(dx[tot:], np.float32))
