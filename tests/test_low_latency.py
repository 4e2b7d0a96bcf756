"""Low-latency (decode) mode, reference backend, against a NumPy model of
docs/semantics.md §12: layout [L, R*Tmax, H] packed per expert, counts,
fp8 with f32 / UE8M0 scales, combine (k ascending, f32), repeated ids, -1 and
out-of-range slots, T < Tmax, skewed routing; clear errors; forward-only."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ep_testing import make_mesh, random_routing, run_per_rank
from jax_ep import EpConfig, fp8_cast, low_latency_combine, low_latency_dispatch

CASES = [  # R, T, Tmax, H, K, E, fp8, scale_format, skew
    (4, 16, 16, 256, 4, 16, True, "f32", False),
    (4, 13, 24, 256, 4, 32, True, "ue8m0", True),
    (2, 7, 8, 128, 2, 8, False, "f32", True),
    (8, 5, 8, 384, 8, 64, True, "ue8m0", False),
    (1, 9, 12, 128, 3, 6, False, "f32", False),
]


def _cfg(R, T, Tmax, H, K, E):
    return EpConfig(num_experts=E, topk=K, max_tokens_per_rank=Tmax, hidden=H,
                    backend="reference")


def _pairs(idx, s, t, E):
    """The experts token (s, t) is sent to: valid ids, each once (first slot)."""
    seen = []
    for e in idx[s, t]:
        if 0 <= e < E and int(e) not in seen:
            seen.append(int(e))
    return seen


def np_dispatch(x, idx, R, Tmax, E):
    """The model: per destination rank [L, R*Tmax, W], expert l's rows packed
    from row 0 by source then token (unused rows NaN), src_count [L, R]."""
    L, W = E // R, x.shape[-1]
    out = np.full((R, L, R * Tmax, W), np.nan, np.float32)
    n = np.zeros((R, L, R), np.int64)
    for s in range(R):
        for t in range(x.shape[1]):
            for e in _pairs(idx, s, t, E):
                r, l = divmod(e, L)
                out[r, l, n[r, l].sum()] = x[s, t]
                n[r, l, s] += 1
    return out, n


def np_combine(y, idx, w, R, Tmax, E):
    """out[s, t] = sum_k w'_k y[rank of e][l, row of the pair], k ascending, in
    f32; the pair's row: the rows of e's earlier sources, then its slot."""
    L = E // R
    T = idx.shape[1]
    cnt = np.zeros((R, E), np.int64)
    for s in range(R):
        for t in range(T):
            for e in _pairs(idx, s, t, E):
                cnt[s, e] += 1
    pre = np.cumsum(cnt, axis=0) - cnt            # [s, e]: rows of e's earlier sources
    out = np.zeros((R, T, y.shape[-1]), np.float32)
    for s in range(R):
        n = pre[s].copy()
        for t in range(T):
            firsts = {}
            for k, e in enumerate(idx[s, t]):
                if 0 <= e < E and e not in firsts:
                    firsts[int(e)] = k
            merged = {e: sum(w[s, t, j] for j, ej in enumerate(idx[s, t]) if ej == e)
                      for e in firsts}
            acc = np.zeros(y.shape[-1], np.float32)
            for e, k in sorted(firsts.items(), key=lambda kv: kv[1]):
                r, l = divmod(e, L)
                acc = acc + np.float32(merged[e]) * y[r, l, n[e]].astype(np.float32)
                n[e] += 1
            out[s, t] = acc
    return out


def _routing(rng, R, T, K, E, skew):
    idx = random_routing(rng, R, T, K, E, minus_one=0.2, skew=skew, invalid=0.05)
    if K > 1:   # a repeated id in a few tokens
        idx[:, ::5, 1] = idx[:, ::5, 0]
    return idx


@pytest.mark.parametrize("case", CASES, ids=lambda c: "R{}_T{}_Tm{}_H{}_K{}_E{}_{}_{}".format(
    *c[:6], "fp8" if c[6] else "bf16", c[7]))
@pytest.mark.slow
def test_low_latency_matches_model(case):
    R, T, Tmax, H, K, E, fp8, fmt, skew = case
    rng = np.random.default_rng(11)
    cfg = _cfg(R, T, Tmax, H, K, E)
    idx = _routing(rng, R, T, K, E, skew)
    x = (rng.standard_normal((R, T, H)) * rng.exponential(3.0, (R, T, 1))).astype(np.float32)
    x = x.astype(jnp.bfloat16)
    w = rng.random((R, T, K)).astype(np.float32)
    mesh = make_mesh((R,), ("ep",))

    def fn(x, i):
        d = low_latency_dispatch(x, i, cfg, fp8=fp8, scale_format=fmt)
        return d.x, (d.x_scales if fp8 else jnp.zeros((1,), jnp.float32)), d.count, d.src_count, \
            d.valid_rows(), d.handle.slot
    got_x, got_s, count, src_count, valid, slot = run_per_rank(fn, mesh, "ep", x, idx)

    if fp8:
        q, s = jax.vmap(functools.partial(fp8_cast, scale_format=fmt))(jnp.asarray(x))
        send = np.concatenate([np.asarray(q).view(np.uint8).astype(np.float32),
                               np.asarray(s)], axis=-1)
    else:
        send = np.asarray(x).astype(np.float32)
    model, n = np_dispatch(send, idx, R, Tmax, E)
    assert np.array_equal(src_count, n)
    assert np.array_equal(count, n.sum(-1))
    assert np.array_equal(valid, ~np.isnan(model[..., 0]))
    for r in range(R):
        m = valid[r]
        if fp8:
            gq = got_x[r].view(np.uint8).astype(np.float32)
            got = np.concatenate([gq, got_s[r]], axis=-1)
        else:
            got = got_x[r].astype(np.float32)
        assert np.array_equal(got[m], model[r][m]), f"rank {r}"

    # combine of an expert output y (per destination rank, in the dispatch layout)
    y = (rng.standard_normal((R, E // R, R * Tmax, H))).astype(np.float32)
    y[~valid] = np.nan                          # rows past count: never read
    y = y.astype(jnp.bfloat16)

    def comb(y, i, w, sl, sc):
        from jax_ep import LowLatencyHandle
        h = LowLatencyHandle(slot=sl, src_count=sc, num_ranks=R, max_tokens=Tmax)
        return low_latency_combine(y, i, w, h, cfg)
    out = run_per_rank(comb, mesh, "ep", y, idx, w, slot, src_count)
    ref = np_combine(np.asarray(y).astype(np.float32), idx, w, R, Tmax, E)
    assert np.all(np.isfinite(out.astype(np.float32)))
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=1e-2, atol=1e-2)
    assert np.array_equal(out, ref.astype(jnp.bfloat16)) or \
        np.max(np.abs(out.astype(np.float32) - ref)) <= 1e-2 * (np.max(np.abs(ref)) + 1)


def test_ue8m0_cast_exact_and_power_of_two():
    """UE8M0 scales are powers of two, the smallest with 448 * s >= amax, and
    q * s reproduces x up to e4m3 rounding (the multiply is exact)."""
    rng = np.random.default_rng(3)
    mags = np.array([1e-6, 1e-3, 1.0, 447.9, 448.0, 449.0, 3e5, 1e30], np.float32)
    x = (rng.standard_normal((len(mags), 256)).astype(np.float32) * mags[:, None])
    x[2, :128] = 0.0   # an all-zero group: amax clamps to 1e-4
    x[3, :128] = np.clip(x[3, :128], -1.0, 1.0)
    x[3, 0] = 56.0   # amax = 0.875 * 2^6: 448 * 2^-3 == amax exactly (the branch boundary)
    q, s = fp8_cast(jnp.asarray(x), scale_format="ue8m0")
    q, s = np.asarray(q).astype(np.float32), np.asarray(s)
    m, _ = np.frexp(s)
    assert np.all(m == 0.5)   # powers of two
    amax = np.maximum(np.abs(x.reshape(len(mags), 2, 128)).max(-1), 1e-4)
    assert np.all(448 * s >= amax) and np.all(448 * s / 2 < amax)
    assert np.all(np.abs(q) <= 448)
    back = (q.reshape(len(mags), 2, 128) * s[..., None]).reshape(x.shape)
    tol = np.repeat(s, 128, axis=1) * 448 * 2.0 ** -4   # e4m3: 3 mantissa bits
    assert np.all(np.abs(back - x) <= tol)


def test_low_latency_errors_and_forward_only():
    R, T, Tmax, H, K, E = 2, 4, 4, 128, 2, 8
    cfg = _cfg(R, T, Tmax, H, K, E)
    mesh = make_mesh((R,), ("ep",))
    x = np.ones((R, T, H), np.float32)
    idx = np.zeros((R, T, K), np.int32)
    idx[..., 1] = 3

    def run(fn, *a):
        return run_per_rank(fn, mesh, "ep", *a)

    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        run(lambda x, i: low_latency_dispatch(x, i, EpConfig(
            num_experts=E, topk=K, max_tokens_per_rank=2, hidden=H)).count, x, idx)
    with pytest.raises(ValueError, match="H % 128"):
        run(lambda x, i: low_latency_dispatch(x[:, :100], i, EpConfig(
            num_experts=E, topk=K, max_tokens_per_rank=T, hidden=100)).count, x, idx)
    with pytest.raises(ValueError, match="scale_format"):
        run(lambda x, i: low_latency_dispatch(x, i, cfg, scale_format="e5m2").count, x, idx)
    with pytest.raises(RuntimeError, match="not initialised"):
        run(lambda x, i: low_latency_dispatch(x, i, EpConfig(
            num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, backend="native")).count,
            x, idx)

    def combine_with(handle_of):
        def fn(x, i):
            d = low_latency_dispatch(x, i, cfg, fp8=False)
            w = jnp.ones(i.shape, jnp.float32)
            return low_latency_combine(d.x, i, w, handle_of(d.handle), cfg)
        return run(fn, x, idx)
    with pytest.raises(ValueError, match="has no src_count"):
        combine_with(lambda h: dataclasses.replace(h, src_count=None))
    with pytest.raises(ValueError, match=r"src_count must be \[L, R\]"):   # L = 4, R = 2
        combine_with(lambda h: dataclasses.replace(h, src_count=h.src_count.T))

    def loss(x, i):
        d = low_latency_dispatch(x, i, cfg, fp8=False)
        return jnp.sum(d.x.astype(jnp.float32))
    with pytest.raises(TypeError, match="forward-only"):
        run(lambda x, i: jax.grad(loss)(x, i), x, idx)


def test_normal_dispatch_ue8m0_scales():
    """EpConfig.fp8_scale_format="ue8m0" in normal-mode fp8 dispatch: the rows
    and scales are those of fp8_cast(x, "ue8m0") dispatched as given fp8."""
    from jax_ep import dispatch

    R, T, H, K, E = 4, 12, 256, 4, 16
    rng = np.random.default_rng(5)
    idx = random_routing(rng, R, T, K, E, minus_one=0.2)
    x = (rng.standard_normal((R, T, H)) * 50).astype(np.float32).astype(jnp.bfloat16)
    w = rng.random((R, T, K)).astype(np.float32)
    base = dict(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, backend="reference")
    cast_cfg = EpConfig(**base, fp8_dispatch=True, fp8_scale_format="ue8m0")
    plain_cfg = EpConfig(**base)

    def fn(x, i, w):
        a = dispatch(x, i, w, cast_cfg)
        q, s = fp8_cast(x, scale_format="ue8m0")
        b = dispatch(q, i, w, plain_cfg, x_scales=s)
        return a.x, a.x_scales, b.x, b.x_scales
    ax, as_, bx, bs = run_per_rank(fn, make_mesh((R,), ("ep",)), "ep", x, idx, w)
    assert np.array_equal(ax.view(np.uint8), bx.view(np.uint8))
    assert np.array_equal(as_, bs)
    m, _ = np.frexp(as_[as_ != 0])
    assert np.all(m == 0.5)
    with pytest.raises(ValueError, match="fp8_scale_format"):
        EpConfig(**base, fp8_scale_format="e8m0")


def test_low_latency_hook_reference():
    """The send / receive halves give the one-shot ops' values (reference
    backend: the send does the work), and a receive rejects the other op's pending."""
    import jax_ep

    R, T, Tmax, H, K, E = 2, 6, 8, 256, 3, 8
    cfg = _cfg(R, T, Tmax, H, K, E)
    mesh = make_mesh((R,), ("ep",))
    rng = np.random.default_rng(11)
    idx = _routing(rng, R, T, K, E, True)
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(jnp.bfloat16)
    w = rng.random((R, T, K)).astype(np.float32)

    def step(x, i, w, hooked):
        if hooked:
            d = jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(x, i, cfg))
        else:
            d = low_latency_dispatch(x, i, cfg)
        y = (d.x.astype(jnp.float32) * jnp.repeat(d.x_scales, 128, axis=-1)).astype(jnp.bfloat16)
        if hooked:
            out = jax_ep.low_latency_combine_recv(
                jax_ep.low_latency_combine_send(y, i, w, d.handle, cfg))
        else:
            out = low_latency_combine(y, i, w, d.handle, cfg)
        return out, d.count

    def ordered(x, i, w):   # after= only orders: same values
        d1 = low_latency_dispatch(x, i, cfg)
        d2 = low_latency_dispatch(x, i, cfg, after=d1.count)
        y = d2.x.astype(jnp.float32) * jnp.repeat(d2.x_scales, 128, axis=-1)
        o1 = low_latency_combine(y.astype(jnp.bfloat16), i, w, d2.handle, cfg)
        o2 = low_latency_combine(y.astype(jnp.bfloat16), i, w, d2.handle, cfg, after=o1)
        return o1, o2, d1.count, d2.count

    o1, o2, c1, c2 = run_per_rank(ordered, mesh, "ep", x, idx, w)
    assert np.array_equal(np.asarray(o1), np.asarray(o2))
    assert np.array_equal(np.asarray(c1), np.asarray(c2))

    a = run_per_rank(functools.partial(step, hooked=True), mesh, "ep", x, idx, w)
    b = run_per_rank(functools.partial(step, hooked=False), mesh, "ep", x, idx, w)
    for u, v in zip(a, b):
        assert np.array_equal(np.asarray(u), np.asarray(v))

    def wrong(x, i):
        p = jax_ep.low_latency_dispatch_send(x, i, cfg)
        return jax_ep.low_latency_combine_recv(p)
    with pytest.raises(ValueError, match="pending 'dispatch'"):
        run_per_rank(wrong, mesh, "ep", x, idx)


def test_ll_transport_config():
    """EpConfig.ll_transport: "auto" by default, the abi's names only (a clear
    ValueError otherwise), part of the config's identity; the reference
    backend ignores it (same values for every transport)."""
    from jax_ep import abi
    from jax_ep.config import LL_TRANSPORTS

    base = dict(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=128)
    assert LL_TRANSPORTS == ("auto", "p2p", "put") == tuple(abi.LL_TRANSPORTS)
    assert EpConfig(**base).ll_transport == "auto"
    assert sorted(abi.ll_transport(t) for t in LL_TRANSPORTS) == [0, 1, 2]
    msg = r"ll_transport must be one of \('auto', 'p2p', 'put'\)"
    for bad in ("nvlink", "PUT", None, 2):
        with pytest.raises(ValueError, match=msg):
            EpConfig(**base, ll_transport=bad)
    assert EpConfig(**base, ll_transport="put") != EpConfig(**base)
    assert hash(EpConfig(**base, ll_transport="put")) == hash(EpConfig(**base, ll_transport="put"))

    R, T = 2, 4
    mesh = make_mesh((R,), ("ep",))
    rng = np.random.default_rng(3)
    idx = _routing(rng, R, T, 2, 8, False)
    x = rng.standard_normal((R, T, 128)).astype(np.float32).astype(jnp.bfloat16)
    w = rng.random((R, T, 2)).astype(np.float32)
    outs = []
    for t in LL_TRANSPORTS:
        cfg = EpConfig(**base, backend="reference", ll_transport=t)

        def step(x, i, w, cfg=cfg):
            d = low_latency_dispatch(x, i, cfg)
            y = (d.x.astype(jnp.float32) * jnp.repeat(d.x_scales, 128, axis=-1)).astype(x.dtype)
            return low_latency_combine(y, i, w, d.handle, cfg)
        outs.append(np.asarray(run_per_rank(step, mesh, "ep", x, idx, w)).view(np.uint16))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_low_latency_config_equals_ep_config():
    """A LowLatencyConfig runs low latency as the EpConfig it is made from
    (low_latency.config.of keeps the fields low latency reads), bit for bit;
    its own fields are checked; an unrelated type is refused."""
    from jax_ep import LowLatencyConfig
    from jax_ep.low_latency import config as ll_config
    from jax_ep.low_latency import region as low_latency_region

    ep = EpConfig(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=128, backend="reference",
                  ll_transport="put", num_sms=3, layout="rank_major", capacity=7)
    ll = ll_config.of(ep)
    assert ll == LowLatencyConfig(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=128,
                                  backend="reference", ll_transport="put", num_sms=3)
    assert ll_config.of(ll) is ll and ll.shape == (8, 4, 2, 128)
    with pytest.raises(ValueError, match="LowLatencyConfig.ll_transport must be one of"):
        LowLatencyConfig(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=128,
                         ll_transport="nvlink")
    with pytest.raises(ValueError, match="LowLatencyConfig.hidden must be a positive int"):
        LowLatencyConfig(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=0)
    with pytest.raises(TypeError, match="LowLatencyConfig or an EpConfig"):
        ll_config.of((8, 4, 2, 128))
    with pytest.raises(TypeError, match="LowLatencyConfig, an EpConfig or None"):
        low_latency_region.shape_of((8, 4, 2, 128))

    R, T = 2, 4
    mesh = make_mesh((R,), ("ep",))
    rng = np.random.default_rng(5)
    idx = _routing(rng, R, T, 2, 8, False)
    x = rng.standard_normal((R, T, 128)).astype(np.float32).astype(jnp.bfloat16)
    w = rng.random((R, T, 2)).astype(np.float32)
    outs = []
    for cfg in (ep, ll):
        def step(x, i, w, cfg=cfg):
            d = low_latency_dispatch(x, i, cfg)
            y = (d.x.astype(jnp.float32) * jnp.repeat(d.x_scales, 128, axis=-1)).astype(x.dtype)
            return low_latency_combine(y, i, w, d.handle, cfg)
        outs.append(np.asarray(run_per_rank(step, mesh, "ep", x, idx, w)).view(np.uint16))
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("T,K,E,skew", [(128, 8, 256, False), (64, 8, 16, True), (37, 3, 6, False),
                                        (1, 4, 8, False), (256, 8, 256, True)])
@pytest.mark.slow
def test_slots_pairwise_equals_cumsum(T, K, E, skew):
    """The two formulations of the send's slots (pairwise compare for T*K <=
    _PAIRWISE_SLOTS_MAX, exclusive cumsum otherwise) give the same integers,
    with -1, invalid and repeated ids, and the counts per expert."""
    from jax_ep.low_latency import api as ll
    from jax_ep.routing import sanitize_topk

    idx = _routing(np.random.default_rng(T * K + E), 1, T, K, E, skew)[0].astype(np.int32)
    assert T * K <= ll._PAIRWISE_SLOTS_MAX
    slot, count = jax.jit(ll._slots, static_argnums=1)(idx, E)
    s_idx, _ = sanitize_topk(jnp.asarray(idx), E)
    first = s_idx >= 0
    slot2, count2 = ll._slots_cumsum(jnp.where(first, s_idx, E), first, E)
    np.testing.assert_array_equal(np.asarray(slot), np.asarray(slot2))
    np.testing.assert_array_equal(np.asarray(count), np.asarray(count2))
    assert (np.asarray(slot) >= 0).sum() == int(np.asarray(count).sum()) > 0


@pytest.mark.parametrize("values", ["spread", "cancel"])
def test_low_latency_combine_is_k_ascending_bit_for_bit(values):
    """The reference combine's bits are §12's sum in its order (k ascending over
    every slot, f32, one rounding per multiply and add, one cast at the end),
    repeated ids merged onto their first slot. Power-of-two weights (or ones)
    keep each product exact, so an FMA does not change the bits; "cancel"
    puts +-2^24 beside O(1) values, where another order shows even in bf16."""
    R, T, Tmax, H, K, E = 2, 12, 12, 64, 6, 8
    rng = np.random.default_rng(5)
    cfg = _cfg(R, T, Tmax, H, K, E)
    idx = _routing(rng, R, T, K, E, skew=True)
    w = (2.0 ** rng.integers(-3, 2, (R, T, K)) if values == "spread"
         else np.ones((R, T, K))).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(jnp.bfloat16)
    mesh = make_mesh((R,), ("ep",))
    slot, src_count = run_per_rank(
        lambda x, i: (lambda h: (h.slot, h.src_count))(low_latency_dispatch(x, i, cfg,
                                                                            fp8=False).handle),
        mesh, "ep", x, idx)
    shape = (R, E // R, R * Tmax, H)
    if values == "spread":
        y = rng.standard_normal(shape) * 2.0 ** rng.integers(-8, 9, shape)
    else:
        big = np.where(rng.random(shape) < 0.5, 2.0 ** 24, -(2.0 ** 24))
        y = np.where(rng.random(shape) < 0.5, big, rng.standard_normal(shape))
    y = y.astype(jnp.bfloat16)

    def comb(y, i, w, sl, sc):
        from jax_ep import LowLatencyHandle
        h = LowLatencyHandle(slot=sl, src_count=sc, num_ranks=R, max_tokens=Tmax)
        return low_latency_combine(y, i, w, h, cfg)
    out = np.asarray(run_per_rank(comb, mesh, "ep", y, idx, w, slot, src_count))
    want = np_combine(y.astype(np.float32), idx, w, R, Tmax, E).astype(jnp.bfloat16)
    diff = out.view(np.uint16) != want.view(np.uint16)
    assert not diff.any(), f"{int(diff.sum())} of {diff.size} elements differ"
