"""Edges of the contract (docs/semantics.md) that the other CPU tests leave
loose: the weight gradient's f32 accumulation with repeats and drops (§9),
the argument checks of dispatch / combine (one column too few, y's row count,
axis name and layout differing from dispatch's), the grouped matmul's XLA
fallback masking the rows past sum(group_sizes) itself, the internode model's
node partials (docs/internode.md) bit for bit, and low-latency counts. Each
was written against a deliberately wrong variant of the code and fails on it.
Pure CPU (8 fake host devices)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import internode_model as im
import jax_ep
import numpy_model as npm
from ep_testing import make_mesh, random_routing, run_per_rank

BF16 = ml_dtypes.bfloat16


# -- combine's weight gradient: f32 accumulation, repeats, drops (§9) ---------------
def _row_of(row_src, gs, src, l):
    rows = np.nonzero(row_src == src)[0]
    starts = np.concatenate([[0], np.cumsum(gs)])
    rows = rows[(rows >= starts[l]) & (rows < starts[l + 1])]
    return int(rows[0]) if rows.size else None


@pytest.mark.parametrize("capacity", [None, 40])
def test_combine_weight_grad_is_f32_sum_with_repeats_and_drops(capacity):
    """d loss / d topk_weights for combine(y, dispatch(x, idx, w)) with bf16 y:
    ``dw[row] = sum_h f32(g_row) * f32(y_row)`` accumulated in f32 (§9), the
    merged slot's value on every repeat of it (§2), 0 on -1 / invalid /
    dropped slots (§5). A bf16 accumulator is off by ~2^-9 relative; a missing
    drop mask gives dropped slots another row's gradient."""
    R, T, K, E, H = 4, 20, 4, 16, 256
    L = E // R
    rng = np.random.default_rng(21)
    idx = random_routing(rng, R, T, K, E, minus_one=0.15, skew=True, repeat=0.15, invalid=0.05)
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(BF16)
    w = rng.random((R, T, K)).astype(np.float32)
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                          capacity=capacity, backend="reference")
    C = cfg.capacity_for(R, T)
    y = (rng.standard_normal((R, C, H)) * 3).astype(np.float32).astype(BF16)
    ct = rng.standard_normal((R, T, H)).astype(np.float32).astype(BF16)
    mesh = make_mesh((R,), ("ep",))
    tok = P("ep")

    def per_rank(x, i, w, y, ct):
        def loss(w):
            out = jax_ep.combine(y, jax_ep.dispatch(x, i, w, cfg), cfg)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))
        d = jax_ep.dispatch(x, i, w, cfg)
        return jax.grad(loss)(w), d.handle.row_src, d.group_sizes

    f = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(tok,) * 5,
                              out_specs=(tok, tok, tok)))
    put = lambda a: jax.device_put(jnp.asarray(a.reshape((R * a.shape[1],) + a.shape[2:])),
                                   NamedSharding(mesh, tok))
    gw, row_src, gs = f(put(x), put(idx), put(w), put(y), put(ct))
    gw = np.asarray(gw).reshape(R, T, K)
    row_src = np.asarray(row_src).reshape(R, C)
    gs = np.asarray(gs).reshape(R, L)
    if capacity is not None:
        assert (row_src >= 0).sum() < (npm.clean_routing(idx, E)[0] >= 0).sum()  # drops happen

    cidx, _ = npm.clean_routing(idx, E)
    yf, gf = y.astype(np.float32), ct.astype(np.float32)
    want = np.zeros((R, T, K), np.float32)
    scale = np.zeros((R, T, K), np.float32)
    for s in range(R):
        for t in range(T):
            for k in range(K):
                e = int(cidx[s, t, k])
                if e < 0:
                    continue
                r, l = divmod(e, L)
                row = _row_of(row_src[r], gs[r], s * T + t, l)
                if row is None:
                    continue   # dropped: 0
                prod = gf[s, t].astype(np.float64) * yf[r, row].astype(np.float64)
                v, a = np.float32(prod.sum()), np.float32(np.abs(prod).sum())
                for j in range(K):   # every repeat of this expert gets the merged slot's grad
                    if int(idx[s, t, j]) == e:
                        want[s, t, j], scale[s, t, j] = v, a
    assert np.all(gw[scale == 0] == 0), "unused / invalid / dropped slots must get 0"
    err = np.abs(gw.astype(np.float64) - want)
    assert np.all(err <= 1e-5 * scale + 1e-30), float(np.max(err / np.maximum(scale, 1e-30)))


# -- validation: combine rejects a y of the wrong row count and another axis (§7) ------
def _small_cfg():
    return jax_ep.EpConfig(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=128)


@pytest.mark.parametrize("extra", [1, -1])
def test_combine_rejects_wrong_row_count(extra):
    cfg = _small_cfg()
    mesh = make_mesh((4,), ("ep",))

    def f(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        C = d.x.shape[0]
        y = jnp.zeros((C + extra, cfg.hidden), d.x.dtype)
        return jax_ep.combine(y, d, cfg)

    g = jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    with pytest.raises(ValueError, match=r"y must be \["):
        jax.jit(g).lower(np.ones((16, 128), np.float32), np.zeros((16, 2), np.int32),
                         np.ones((16, 2), np.float32))


def test_combine_names_a_differing_axis_name_even_of_equal_size():
    """Dispatch over 'ep', combine with a config over 'data' (same size 2):
    the handle's rows belong to the 'ep' exchange, so combine must refuse
    (semantics: combine takes the dispatch's config) instead of silently
    exchanging over the other axis."""
    cfg = _small_cfg()
    other = dataclasses.replace(cfg, axis_name="data")
    mesh = make_mesh((2, 2), ("data", "ep"))
    spec = P(("data", "ep"))

    def f(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        return jax_ep.combine(d.x, d, other)

    g = jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    with pytest.raises(ValueError, match=r"EpConfig\.axis_name is 'data' here but the dispatch "
                                         r"ran with 'ep'"):
        jax.jit(g).lower(np.ones((16, 128), np.float32), np.zeros((16, 2), np.int32),
                         np.ones((16, 2), np.float32))


# -- the internode model's node-grouped sum, bit for bit (docs/internode.md) ----------
def _hier_by_hand(p, received, send_mask, N, dt):
    """P_m = cast(sum_{g ascending} f32(partial_(m, g))) over the node's ranks that
    received t; out = cast(sum_{m ascending, t sent to node m} f32(P_m)), one
    f32 rounding per add, written scalar-row by scalar-row."""
    R, _, T, H = p.shape
    G = R // N
    out = np.zeros((R, T, H), dt)
    for s in range(R):
        for t in range(T):
            tot = np.zeros(H, np.float32)
            for m in range(N):
                if not send_mask[s, t, m * G:(m + 1) * G].any():
                    continue
                acc = np.zeros(H, np.float32)
                for g in range(G):
                    r = m * G + g
                    if received[r, s, t]:
                        acc = (acc + p[r, s, t].astype(np.float32)).astype(np.float32)
                tot = (tot + acc.astype(dt).astype(np.float32)).astype(np.float32)
            out[s, t] = tot.astype(dt)
    return out


@pytest.mark.parametrize("N", [2, 4])
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_internode_model_hier_bits(N, layout):
    """``internode_model.combine_hier`` is docs/internode.md's formula bit for bit
    (the GPU loopback tests take their expected bits from it): the node partial
    is cast to y's dtype, nodes and ranks are summed ascending."""
    from jax_ep.intranode import reference

    R, T, K, E, H = 8, 16, 8, 64, 48
    rng = np.random.default_rng(31 + N)
    idx = random_routing(rng, R, T, K, E, minus_one=0.2, skew=True)
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                          layout=layout, backend="reference")

    def fn(i):
        h = reference.BACKEND.router.route(i, cfg, R)[0]
        return h.send_mask, h.recv_local_idx, h.slot_row
    send_mask, li, sr = run_per_rank(fn, make_mesh((R,), ("ep",)), "ep", idx)
    C = int(sr.max()) + 1
    shape = (R, C, H)
    y = (rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 7, shape)).astype(np.float32)
    y = y.astype(BF16)
    w = None if layout == "rank_major" else (2.0 ** rng.integers(-3, 2, (R, C))).astype(np.float32)
    rank_major = layout == "rank_major"
    p, received = im._partials(y, w, li, sr, rank_major)
    want = _hier_by_hand(p, received, send_mask, N, y.dtype)
    got = im.combine_hier(y, w, send_mask, li, sr, N, rank_major)
    diff = got.view(np.uint16) != want.view(np.uint16)
    assert not diff.any(), f"{int(diff.sum())} of {diff.size} elements differ"
    # the node partial's rounding is visible here (the case can tell the formulas apart)
    flat = im.combine_flat(y, w, send_mask, li, sr, rank_major)
    assert (flat.view(np.uint16) != got.view(np.uint16)).any()


# -- fp8 cast: f32 scale format bit-exact on many values (§8) -------------------------
def test_fp8_cast_f32_bits_many_values():
    """q = e4m3(clip(x * (448 / amax), +-448)) with IEEE f32 division on CPU and
    scale = amax * f32(1/448): every bit, over values spread across 2^-20..2^20
    and blocks at the 1e-4 floor."""
    rng = np.random.default_rng(41)
    T, H = 512, 512
    x = (rng.standard_normal((T, H)) * 2.0 ** rng.integers(-20, 21, (T, 1))).astype(np.float32)
    x[:8, :128] = rng.standard_normal((8, 128)) * 1e-6   # amax below the floor
    q, s = jax.jit(jax_ep.fp8_cast)(jnp.asarray(x))
    xf = x.reshape(T, H // 128, 128)
    amax = np.maximum(np.abs(xf).max(-1), np.float32(1e-4)).astype(np.float32)
    inv = (np.float32(448.0) / amax).astype(np.float32)
    wq = np.clip(xf * inv[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn).reshape(T, H)
    ws = (amax * np.float32(1.0 / 448.0)).astype(np.float32)
    assert np.array_equal(np.asarray(s).view(np.uint32), ws.view(np.uint32))
    assert np.array_equal(np.asarray(q).view(np.uint8), wq.view(np.uint8))


# -- validation: topk_idx with fewer columns than EpConfig.topk ------------------------
def test_topk_idx_with_fewer_columns_than_topk_is_rejected():
    """The column count must equal EpConfig.topk (not only be <= it): a narrower
    topk_idx would otherwise route with a K the buffers / native ABI were not
    sized for."""
    R, T, H, K, E = 8, 4, 256, 2, 16
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                          backend="reference")
    mesh = make_mesh((R,), ("ep",))
    spec = P("ep")
    f = jax.shard_map(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg).x, mesh=mesh,
                      in_specs=(spec,) * 3, out_specs=spec)
    args = (jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16),
            jax.ShapeDtypeStruct((R * T, 1), jnp.int32),
            jax.ShapeDtypeStruct((R * T, 1), jnp.float32))
    with pytest.raises(ValueError, match=r"topk_idx has 1 columns, EpConfig\.topk is 2"):
        jax.eval_shape(f, *args)


# -- grouped matmul's XLA fallback masks its operands itself ---------------------------
class _DenseRaggedLax:
    """A ragged_dot that reads every row (group membership applied by multiplying
    with a 0/1 mask, as a dense lowering does): NaN / Inf in rows past
    sum(group_sizes) poison the result unless the caller masked them. XLA:CPU's
    own ragged_dot skips those rows, which hides a missing mask."""

    RaggedDotDimensionNumbers = jax.lax.RaggedDotDimensionNumbers

    @staticmethod
    def _member(sizes, m):
        ends = jnp.cumsum(sizes)
        starts = ends - sizes
        r = jnp.arange(m)
        return ((r[None] >= starts[:, None]) & (r[None] < ends[:, None])).astype(jnp.float32)

    @classmethod
    def ragged_dot(cls, x, w, sizes, preferred_element_type=None):
        mask = cls._member(sizes, x.shape[0])                        # [G, M]
        y = jnp.einsum("mk,gkn->gmn", x.astype(jnp.float32), w.astype(jnp.float32))
        return jnp.sum(mask[..., None] * y, axis=0)

    @classmethod
    def ragged_dot_general(cls, lhs, rhs, sizes, dn, preferred_element_type=None):
        (lc, rc), _ = dn.dot_dimension_numbers
        mask = cls._member(sizes, lhs.shape[0])
        a, b = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
        if tuple(lc) == (1,) and tuple(rc) == (2,):   # x [M, N] . w[g]^T -> [M, K]
            return jnp.sum(mask[..., None] * jnp.einsum("mn,gkn->gmk", a, b), axis=0)
        if tuple(lc) == (0,) and tuple(rc) == (0,):   # per group x^T dy -> [G, K, N]
            return jnp.einsum("gm,mk,mn->gkn", mask, a, b)
        raise NotImplementedError(dn)


class _UnwrittenTailRaggedLax(_DenseRaggedLax):
    """A ragged_dot that leaves output rows past sum(group_sizes) unwritten
    (NaN here): jax.lax.ragged_dot does not document those rows, so
    grouped_matmul's "zero past sum(group_sizes)" must come from its own mask."""

    @classmethod
    def _tail_nan(cls, out, sizes):
        keep = (jnp.arange(out.shape[0]) < jnp.sum(sizes))[:, None]
        return jnp.where(keep, out, jnp.nan)

    @classmethod
    def ragged_dot(cls, x, w, sizes, preferred_element_type=None):
        return cls._tail_nan(super().ragged_dot(x, w, sizes), sizes)

    @classmethod
    def ragged_dot_general(cls, lhs, rhs, sizes, dn, preferred_element_type=None):
        out = super().ragged_dot_general(lhs, rhs, sizes, dn)
        (lc, _), _ = dn.dot_dimension_numbers
        return cls._tail_nan(out, sizes) if tuple(lc) == (1,) else out


@pytest.mark.parametrize("shim", [_DenseRaggedLax, _UnwrittenTailRaggedLax],
                         ids=["reads_tail", "unwritten_tail"])
@pytest.mark.parametrize("sizes", [[5, 0, 17, 3], [50, 1, 0, 7], [0, 0, 0, 0]])
def test_gmm_xla_masks_poisoned_tail_itself(sizes, shim, monkeypatch):
    """grouped_matmul(impl="xla") promises zero output rows past sum(group_sizes)
    and finite dx / dw whatever the tail holds (NaN / Inf), by masking x and dy
    before ragged_dot and the output after it: checked with a ragged_dot that
    reads the tail and with one that leaves the output's tail unwritten."""
    from jax_ep.gmm import grouped_matmul
    from jax_ep.gmm import xla as gx

    monkeypatch.setattr(gx, "lax", shim)
    M, K, N = 64, 24, 40
    rng = np.random.default_rng(7)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((len(sizes), K, N)).astype(np.float32)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    tot = int(np.sum(sizes))
    x[tot:] = np.nan
    dy[tot:] = np.inf
    gs = np.asarray(sizes, np.int32)
    f = lambda a, b: grouped_matmul(a, b, gs, impl="xla")
    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    y, dx, dw = np.asarray(y), np.asarray(dx), np.asarray(dw)
    off = np.concatenate([[0], np.cumsum(sizes)])
    xc, dyc = np.where(np.arange(M)[:, None] < tot, x, 0), np.where(np.arange(M)[:, None] < tot, dy, 0)
    wy = np.zeros((M, N)); wdx = np.zeros((M, K)); wdw = np.zeros(w.shape)
    for g in range(len(sizes)):
        r = slice(off[g], off[g + 1])
        wy[r] = xc[r] @ w[g]
        wdx[r] = dyc[r] @ w[g].T
        wdw[g] = xc[r].T @ dyc[r]
    assert np.all(y[tot:] == 0) and np.all(dx[tot:] == 0)
    assert np.all(np.isfinite(dw))
    np.testing.assert_allclose(y, wy, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dx, wdx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, wdw, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("d_layout,c_layout", [("expert_major", "rank_major"),
                                               ("rank_major", "expert_major")])
def test_combine_rejects_a_layout_other_than_dispatch(d_layout, c_layout):
    """layout is not in the dispatch-config tuple, so combine's own layout check
    is what stops an expert_major handle being combined unweighted (or the reverse)."""
    cfg = jax_ep.EpConfig(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=128,
                          layout=d_layout, backend="reference")
    other = dataclasses.replace(cfg, layout=c_layout)
    mesh = make_mesh((4,), ("ep",))

    def f(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        return jax_ep.combine(d.x, d, other)

    g = jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    with pytest.raises(ValueError, match=rf"dispatched was made with layout '{d_layout}', "
                                         rf"config has '{c_layout}'"):
        jax.jit(g).lower(np.ones((16, 128), np.float32), np.zeros((16, 2), np.int32),
                         np.ones((16, 2), np.float32))


# -- low-latency counts and valid rows, fast (the model test is marked slow) ------------
def test_low_latency_counts_and_valid_rows_fast():
    """count [L] = sum over sources of src_count [L, R]; valid_rows marks exactly
    the first count[l] rows of each expert (§12: packed). L == R here, so a
    count summed over the wrong axis keeps its shape and must show in values."""
    from jax_ep import low_latency_dispatch

    R, T, Tmax, H, K, E = 4, 6, 8, 128, 3, 16
    L = E // R
    rng = np.random.default_rng(3)
    idx = random_routing(rng, R, T, K, E, minus_one=0.2, skew=True, invalid=0.1, repeat=0.2)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=Tmax, hidden=H,
                          backend="reference")

    def fn(x, i):
        d = low_latency_dispatch(x, i, cfg, fp8=False)
        return d.count, d.src_count, d.valid_rows()
    count, src_count, valid = run_per_rank(fn, make_mesh((R,), ("ep",)), "ep", x, idx)
    n = np.zeros((R, L, R), np.int64)       # [dest rank, local expert, source]
    for s in range(R):
        for t in range(T):
            seen = set()
            for e in idx[s, t]:
                if 0 <= e < E and e not in seen:
                    seen.add(int(e))
                    n[e // L, e % L, s] += 1
    assert np.array_equal(src_count.reshape(n.shape), n)
    assert np.array_equal(count.reshape(R, L), n.sum(-1))
    want_valid = np.arange(R * Tmax)[None, None, :] < n.sum(-1)[..., None]
    assert np.array_equal(valid.reshape(want_valid.shape), want_valid)
