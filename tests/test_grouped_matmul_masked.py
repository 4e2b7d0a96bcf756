"""The grouped matmul's masked layout: ``x [G, C, K]``, group ``g`` its first
``group_sizes[g]`` rows (bf16/f32 and fp8), against the contiguous layout on
the same rows compacted; the row-tile table at fixed starts; the Pallas
kernels on it in Mosaic-GPU interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from jax_ep.gmm import GroupedMatmulConfig
from jax_ep.gmm.pallas_common import row_tiles
from jax_ep.gmm.rows import FixedStarts, masked

try:
    from jax.experimental.pallas import mosaic_gpu as _plgpu
    HAS_INTERPRET = hasattr(_plgpu, "InterpretGPUParams")
except Exception:  # pragma: no cover
    HAS_INTERPRET = False

G, C, K, N = 4, 37, 256, 128          # C not a multiple of 8: groups start off the 8-row grid
SIZES = [5, 0, 37, 60]                # empty, full, over C (clipped to C)


def _valid(sizes, c=C):
    return np.arange(c)[None, :] < np.minimum(np.asarray(sizes), c)[:, None]   # [G, C]


def _operands(seed, sizes, dtype=jnp.float32, c=C, k=K, n=N):
    """x with NaN rows outside the groups, w, and a cotangent with Inf there."""
    rng = np.random.default_rng(seed)
    valid = _valid(sizes, c)
    x = rng.standard_normal((len(sizes), c, k)).astype(np.float32)
    x[~valid] = np.nan
    w = (rng.standard_normal((len(sizes), k, n)) / np.sqrt(k)).astype(np.float32)
    dy = rng.standard_normal((len(sizes), c, n)).astype(np.float32)
    dy[~valid] = np.inf
    return (jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(dy, dtype),
            jnp.asarray(sizes, jnp.int32))


def _compact(a, sizes, c=C):
    """[G, C, *] -> the contiguous layout's rows [sum(sizes), *]."""
    return jnp.concatenate([a[g, :min(int(s), c)] for g, s in enumerate(sizes)])


def _scatter(rows, sizes, c=C):
    """The contiguous layout's rows back to [G, C, *], zero outside the groups."""
    out = np.zeros((len(sizes), c) + rows.shape[1:], np.float32)
    at = 0
    for g, s in enumerate(sizes):
        s = min(int(s), c)
        out[g, :s] = rows[at:at + s]
        at += s
    return out


def _masked_vs_contiguous(call, x, w, dy, gs, sizes, xs=None):
    """(masked y, dx, dw) and the contiguous layout's on the compacted rows,
    scattered back: the same products, so the same bits on XLA."""
    y, f = jax.vjp(lambda a, b: call(a, b, gs, xs), x, w)
    dx, dw = f(dy)
    xc, dyc = _compact(x, sizes), _compact(dy, sizes)
    xsc = None if xs is None else _compact(xs, sizes)
    gsc = jnp.minimum(gs, C)
    yc, fc = jax.vjp(lambda a, b: call(a, b, gsc, xsc), xc, w)
    dxc, dwc = fc(dyc)
    to_np = lambda a: np.asarray(a, np.float32)
    return ((to_np(y), to_np(dx), to_np(dw)),
            (_scatter(to_np(yc), sizes), _scatter(to_np(dxc), sizes), to_np(dwc)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_masked_layout_is_the_contiguous_layout_on_its_rows(dtype):
    x, w, dy, gs = _operands(0, SIZES, dtype)
    got, want = _masked_vs_contiguous(
        lambda a, b, g, _: jax_ep.grouped_matmul(a, b, g), x, w, dy, gs, SIZES)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)   # zero outside the groups on XLA


@pytest.mark.parametrize("fp8_dx,fp8_dw", [(True, False), (False, False), (True, True)],
                         ids=["fp8_dx", "bf16_dx", "fp8_dw"])
def test_masked_fp8_is_the_contiguous_fp8_on_its_rows(fp8_dx, fp8_dw):
    x, w, dy, gs = _operands(1, SIZES, jnp.bfloat16)
    xq, xs = jax_ep.quantize_activations(jnp.nan_to_num(x).reshape(G * C, K))
    xq, xs = xq.reshape(G, C, K), xs.reshape(G, C, K // 128)
    valid = jnp.asarray(_valid(SIZES))[..., None]
    xq = jnp.where(valid, xq, jnp.asarray(jnp.nan, xq.dtype))   # garbage outside the groups
    xs = jnp.where(valid, xs, jnp.inf)
    wq, ws = jax_ep.quantize_weights(w)
    cfg = GroupedMatmulConfig(fp8_dx=fp8_dx, fp8_dw=fp8_dw)
    got, want = _masked_vs_contiguous(
        lambda a, b, g, s: jax_ep.grouped_matmul(a, b, g, x_scales=s, w_scales=ws, config=cfg),
        xq, wq, dy, gs, SIZES, xs)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert np.all(np.isfinite(a)), name
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_masked_layout_under_jit_and_w_layout_gnk():
    x, w, _, gs = _operands(2, SIZES)
    f = jax.jit(lambda a, b, g: jax_ep.grouped_matmul(a, jnp.swapaxes(b, 1, 2), g, w_layout="gnk"))
    np.testing.assert_array_equal(np.asarray(f(x, w, gs)),
                                  np.asarray(jax_ep.grouped_matmul(x, w, gs)))


@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
def test_masked_layout_under_shard_map_check_vma(fp8):
    """Each rank's experts on its own masked buffer inside shard_map(check_vma=
    True), beside a replicated weight: the values and the gradients of x, of
    the sharded w and of the replicated w (summed over ranks) equal the same
    calls rank by rank outside shard_map."""
    devs = jax.devices()
    if len(devs) < 4:
        pytest.skip("needs 4 (fake) devices")
    from jax.sharding import Mesh, PartitionSpec as P
    R = 4
    mesh = Mesh(np.array(devs[:R]), ("ep",))
    sizes = [np.roll(SIZES, r) for r in range(R)]
    ops = [_operands(10 + r, sizes[r]) for r in range(R)]
    x, w, dy, gs = (jnp.stack([o[i] for o in ops]) for i in range(4))
    x = jnp.nan_to_num(x, nan=7.0)                      # finite garbage outside the groups
    dy = jnp.where(jnp.isinf(dy), 3.0, dy)
    w_rep = ops[0][1] * 0.5
    if fp8:
        xq, xs = jax_ep.quantize_activations(x.reshape(R * G * C, K))
        x, xs = xq.reshape(R, G, C, K), xs.reshape(R, G, C, K // 128)
        w, ws = jax_ep.quantize_weights(w.reshape(R * G, K, N))
        w, ws = w.reshape(R, G, K, N), ws.reshape(R, G, K // 128, N // 128)
        w_rep, wrs = jax_ep.quantize_weights(w_rep)
        mm = lambda a, s, b, bs, g: jax_ep.grouped_matmul(a, b, g, x_scales=s, w_scales=bs)
    else:
        xs, ws, wrs = jnp.zeros((R, 1)), jnp.zeros((R, 1)), jnp.zeros(1)
        mm = lambda a, s, b, bs, g: jax_ep.grouped_matmul(a, b, g)

    def one(a, s, b, bs, br, brs, g, d):
        f = lambda a_, b_, br_: mm(a_, s, b_, bs, g) + mm(a_, s, br_, brs, g)
        y, vjp = jax.vjp(f, a, b, br)
        return (y,) + vjp(d.astype(y.dtype))

    def per_rank(a, s, b, bs, br, brs, g, d):
        y, dx, dw, dwr = one(a[0], s[0], b[0], bs[0], br, brs, g[0], d[0])
        return y[None], dx[None], dw[None], dwr

    sh, rep = P("ep"), P()
    fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(sh, sh, sh, sh, rep, rep, sh, sh),
                               out_specs=(sh, sh, sh, rep), check_vma=True))
    got = fn(x, xs, w, ws, w_rep, wrs, gs, dy)
    dwr_ref = 0
    for r in range(R):
        want = one(x[r], xs[r], w[r], ws[r], w_rep, wrs, gs[r], dy[r])
        valid = _valid(sizes[r])
        for name, a, b in zip(("y", "dx", "dw"), got[:3], want[:3]):
            a, b = np.asarray(a[r], np.float32), np.asarray(b, np.float32)
            if name != "dw":
                a, b = a[valid], b[valid]
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{name} rank {r}")
        dwr_ref = dwr_ref + np.asarray(want[3], np.float64)
    np.testing.assert_allclose(np.asarray(got[3], np.float64), dwr_ref, rtol=1e-4, atol=1e-4)


def test_masked_layout_errors():
    x, w, _, gs = _operands(3, SIZES)
    with pytest.raises(ValueError, match="masked layout x"):
        jax_ep.grouped_matmul(x[:3], w, gs)
    xq, xs = jax_ep.quantize_activations(jnp.nan_to_num(x).reshape(G * C, K))
    wq, ws = jax_ep.quantize_weights(w)
    with pytest.raises(ValueError, match=r"x_scales \[G, C, K/128\]"):
        jax_ep.grouped_matmul(xq.reshape(G, C, K), wq, gs, x_scales=xs, w_scales=ws)


@pytest.mark.parametrize("bm", [64, 128])
def test_row_tiles_at_fixed_starts(bm):
    """Each row of a group stored by exactly one tile of that group; no tile
    stores a row outside the groups (no tail tiles); loads 8-aligned, inside
    [0, m); at most one extra tile per group."""
    rng = np.random.default_rng(bm)
    for trial in range(30):
        g = int(rng.integers(1, 12))
        c = int(rng.integers(1, 3 * bm))
        m = g * c
        if m % 8 or m < bm:
            continue
        sizes = rng.integers(0, c + 1, size=g)
        sizes[rng.random(g) < 0.3] = 0
        rows = masked(jnp.asarray(sizes, jnp.int32), c)
        row, lo, hi, grp = (np.asarray(a) for a in row_tiles(rows, m, bm))
        owner = np.full(m, -1)
        used = hi > lo
        for r0, a, b, gg in zip(row[used], lo[used], hi[used], grp[used]):
            assert r0 % 8 == 0 and 0 <= r0 and r0 + bm <= m and r0 <= a < b <= r0 + bm
            assert gg >= 0 and np.all(owner[a:b] == -1)
            owner[a:b] = gg
        want = np.full(m, -1)
        for gi in range(g):
            want[gi * c:gi * c + sizes[gi]] = gi
        np.testing.assert_array_equal(owner, want)
        assert int(used.sum()) <= sum(-(-int(s) // bm) + 1 for s in sizes if s)


@pytest.mark.skipif(not HAS_INTERPRET, reason="needs jax with Mosaic-GPU interpret mode")
@pytest.mark.parametrize("path", ["bf16", "fp8"])
def test_masked_layout_on_the_pallas_kernels_interpret(path):
    """The forward/dx kernels (Mosaic-GPU interpreter) at fixed starts, through
    the public call with gradients, against the XLA path on the groups' rows;
    garbage rows outside the groups (NaN for fp8; for bf16 large finite values:
    the interpreter emulates the 2-consumer kernel's accumulator reset by
    subtracting a running base, which a NaN row poisons for good, where the GPU
    stores zeros); C = 72 (groups start off the 64-row grid)."""
    sizes, c = [5, 0, 72, 40], 72
    x, w, dy, gs = _operands(4, sizes, jnp.bfloat16, c=c, k=256, n=256)
    valid = jnp.asarray(_valid(sizes, c))[..., None]
    if path == "bf16":
        x = jnp.where(valid, x, jnp.asarray(3e4, x.dtype))
        cfg = GroupedMatmulConfig(impl="pallas", interpret=True, fwd=(64, 64, 64, 2, 2),
                                  dx=(64, 64, 32, 2, 1), dw=(64, 64, 16, 2, 2))

        def call(a, b, config):
            return jax_ep.grouped_matmul(a, b, gs, config=config)
        operands = (x, w)
    else:
        cfg = GroupedMatmulConfig(impl="pallas", interpret=True)
        xq, xs = jax_ep.quantize_activations(jnp.nan_to_num(x).reshape(len(sizes) * c, -1))
        xq = jnp.where(valid, xq.reshape(x.shape), jnp.asarray(jnp.nan, xq.dtype))
        xs = xs.reshape(len(sizes), c, -1)
        wq, ws = jax_ep.quantize_weights(w)

        def call(a, b, config):
            return jax_ep.grouped_matmul(a, b, gs, x_scales=xs, w_scales=ws, config=config)
        operands = (xq, wq)

    def run(config):
        y, f = jax.vjp(lambda a, b: call(a, b, config), *operands)
        return (y, *f(dy))
    got, want = run(cfg), run(GroupedMatmulConfig(impl="xla"))
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if name != "dw":   # rows outside the groups: not written by the kernels
            keep = np.broadcast_to(np.asarray(valid), a.shape)
            a, b = a[keep], b[keep]
            if name == "dx":
                assert np.all(np.asarray(got[1], np.float32)[~np.broadcast_to(
                    np.asarray(valid), got[1].shape)] == 0)
        assert np.all(np.isfinite(a)), name
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < 1e-2, (name, rel)
