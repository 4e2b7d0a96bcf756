"""Issue 10: repeated expert ids, checked overflow, T = 0, input dtypes and messages."""
import logging
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
import numpy_model as npm
from ep_testing import make_mesh, run_per_rank

R, H = 8, 16


def _cfg(**kw):
    base = dict(num_experts=16, topk=4, max_tokens_per_rank=6, hidden=H, backend="reference")
    base.update(kw)
    return jax_ep.EpConfig(**base)


def _dup_routing(rng, n, T, K, E):
    """ids drawn with replacement (many repeats), some -1 and some invalid ids."""
    idx = rng.integers(0, E, size=(n, T, K))
    idx[:, :, 1] = idx[:, :, 0]  # every token repeats its first expert at least once
    r = rng.random((n, T, K))
    idx = np.where(r < 0.15, -1, idx)
    idx = np.where((r >= 0.15) & (r < 0.22), rng.choice([-3, E, E + 5], size=(n, T, K)), idx)
    return idx.astype(np.int32)


def _dense(x, idx, w, W, E):
    """Dense MoE: out[t] = sum_k [0 <= e_k < E] w_k tanh(x W[e_k]) (repeats count per slot)."""
    valid = (idx >= 0) & (idx < E)
    h = jnp.tanh(jnp.einsum("nh,nkhf->nkf", x, W[jnp.clip(idx, 0, E - 1)]))
    return jnp.sum(jnp.where(valid[..., None], w[..., None] * h, 0.0), axis=1)


# -- 1. repeated expert ids -----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_repeated_ids_follow_dense_moe(layout):
    T, K, E = 6, 4, 16
    L = E // R
    rng = np.random.default_rng(1 + (layout == "rank_major"))
    mesh = make_mesh((R,), ("ep",))
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = _dup_routing(rng, R, T, K, E).reshape(R * T, K)
    w = rng.random((R * T, K)).astype(np.float32)
    W = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)
    ct = rng.standard_normal((R * T, H)).astype(np.float32)
    cfg = _cfg(layout=layout, expert_alignment=2 if layout == "expert_major" else 1)
    tok = P("ep")

    def per_rank(x, idx, w, W):
        d = jax_ep.dispatch(x, idx, w, cfg)
        if layout == "expert_major":
            h = jnp.tanh(jax.lax.ragged_dot(d.x, W, d.group_sizes))
        else:
            hk = jnp.tanh(jnp.einsum("ch,lhf->clf", d.x, W))
            sel = jax.nn.one_hot(d.topk_idx, L) * d.topk_weights[..., None]
            h = jnp.einsum("ckl,clf->cf", sel, hk)
        return jax_ep.combine(h, d, cfg)

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=(tok, tok, tok, tok), out_specs=tok)
    loss_ep = lambda x, w, W: jnp.sum(f(x, idx, w, W) * ct)
    loss_dense = lambda x, w, W: jnp.sum(_dense(x, idx, w, W, E) * ct)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, tok))
    v_ep, g_ep = jax.jit(jax.value_and_grad(loss_ep, argnums=(0, 1, 2)))(put(x), put(w), put(W))
    v_d, g_d = jax.jit(jax.value_and_grad(loss_dense, argnums=(0, 1, 2)))(x, w, W)
    np.testing.assert_allclose(v_ep, v_d, rtol=1e-5)
    for name, a, b in zip(("x", "topk_weights", "W"), g_ep, g_d):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5, err_msg=name)
    # every duplicate slot gets the same gradient <d_out, f_e(x)>
    gw = np.asarray(g_ep[1])
    for t in range(R * T):
        for k in range(K):
            same = [j for j in range(K) if idx[t, j] == idx[t, k] and 0 <= idx[t, k] < E]
            assert np.allclose(gw[t, same], gw[t, k]), (t, k)


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_repeated_ids_merge_weights_on_first_slot(layout):
    """The dispatched weights are the model's with each repeat's weight added to
    its first slot (rank_major: repeats show -1 / 0); nothing else changes."""
    T, K, E = 6, 4, 16
    rng = np.random.default_rng(7)
    mesh = make_mesh((R,), ("ep",))
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    idx = _dup_routing(rng, R, T, K, E)
    w = rng.random((R, T, K)).astype(np.float32)
    cfg = _cfg(layout=layout)

    def fn(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        if layout == "expert_major":
            return d.x, d.weights, d.num_dropped
        return d.x, d.topk_idx, d.topk_weights, d.num_dropped

    got = run_per_rank(fn, mesh, "ep", x, idx, w)
    want = npm.dispatch(x, idx, w, E, layout=layout)   # the model merges repeats (§2)
    np.testing.assert_array_equal(got[0].reshape(want["x"].shape), want["x"])
    if layout == "expert_major":
        np.testing.assert_array_equal(got[1].reshape(want["weights"].shape), want["weights"])
    else:
        np.testing.assert_array_equal(got[1].reshape(want["topk_idx"].shape), want["topk_idx"])
        np.testing.assert_array_equal(got[2].reshape(want["topk_weights"].shape),
                                      want["topk_weights"])
    np.testing.assert_array_equal(got[-1].reshape(-1), want["num_dropped"])


def test_layout_counts_repeats_once():
    T, K, E = 6, 4, 16
    rng = np.random.default_rng(3)
    mesh = make_mesh((R,), ("ep",))
    idx = _dup_routing(rng, R, T, K, E)
    got = run_per_rank(lambda i: jax_ep.get_dispatch_layout(i, _cfg()), mesh, "ep", idx)
    for g, w_ in zip(got, npm.layout(idx, E, R)):
        np.testing.assert_array_equal(np.asarray(g).reshape(w_.shape), w_)


# -- 2. checked overflow -----------------------------------------------------------
_OVERFLOW_SCRIPT = r"""
import sys, numpy as np, jax, jax.numpy as jnp, jax_ep
from jax.sharding import PartitionSpec as P
from ep_testing import make_mesh, run_per_rank
mode = sys.argv[1]
R, T, H, K, E = 8, 8, 8, 2, 16
mesh = make_mesh((R,), ("ep",))
cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, capacity=8,
                      check_overflow=True, backend="reference")
x = np.ones((R, T, H), np.float32)
w = np.ones((R, T, K), np.float32)
idx = np.full((R, T, K), -1, np.int32)
idx[:, 0, 0] = 0
if mode in ("some", "ckpt"):  # rank 0 receives 7 + 8 rows for expert 0: only it overflows
    idx[3, :, 0] = 0
elif mode == "all":  # every rank receives 16 rows per expert
    idx[:, :, 0] = (np.arange(T) % R) * 2
    idx[:, :, 1] = (np.arange(T) % R) * 2 + 1
elif mode == "invalid":  # ids outside [-1, E), nothing over capacity
    idx[2, 1, 0], idx[5, 3, 1] = E + 3, -5

def f(a, b, c):  # only the combined output is used: the check must not be dead code
    d = jax_ep.dispatch(a, b, c, cfg)
    return jax_ep.combine(d.x, d, cfg)

def valid_call():  # after a caught overflow, a valid call works and nothing prints at exit
    ok = np.full((R, T, K), -1, np.int32)
    ok[:, 0, 0] = 1
    run_per_rank(f, mesh, "ep", x, ok, w)

try:
    if mode == "ckpt":
        g = jax.shard_map(jax.checkpoint(f), mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))
        loss = lambda a: jnp.sum(g(a, idx.reshape(R * T, K), w.reshape(R * T, K)))
        np.asarray(jax.jit(jax.grad(loss))(x.reshape(R * T, H)))
    else:
        run_per_rank(f, mesh, "ep", x, idx, w)
except Exception as e:
    msg = str(e)
    print("RAISED", type(e).__name__, len(msg.splitlines()), msg.splitlines()[-1])
    valid_call()
else:
    print("NO ERROR")
sys.stdout.flush()
"""


def _run_script(script, *args, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] + sys.path))
    p = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                       text=True, timeout=timeout)  # a hang fails the test here
    return p.stdout, p.stderr


_CAUSES = {  # mode -> what the one error must name
    "some": ["7 (token, expert) pair(s) over capacity: rank 0 of axis 'ep' needs 15 rows but "
             "has C=8 (7 over; its busiest expert, 0, received 15 pairs); use "
             "EpConfig.capacity >= 15, or capacity=None (dropless)"],
    "ckpt": ["rank 0 of axis 'ep' needs 15 rows but has C=8"],
    "all": ["64 (token, expert) pair(s) over capacity", "needs 16 rows but has C=8 (8 over"],
    "invalid": ["2 expert id(s) outside [-1, 16) (smallest -5, largest 19): the router must "
                "give ids in [0, num_experts=16), or -1 for an unused slot"],
}


@pytest.mark.parametrize("mode,count", [("some", 7), ("all", 64), ("ckpt", 7), ("invalid", 2),
                                        ("ok", 0)])
@pytest.mark.slow
def test_checked_overflow_is_collective(mode, count):
    """One error, on every rank alike, naming its cause and the remedy that
    applies (invalid ids: no capacity advice); a valid call after it works and
    nothing is printed again at exit."""
    out, err = _run_script(_OVERFLOW_SCRIPT, mode)
    if mode == "ok":
        assert "NO ERROR" in out, out + err
        return
    assert "RAISED" in out, out + err
    line = out.split("RAISED", 1)[1]
    assert (f"OverflowError: jax_ep.dispatch (EpConfig.check_overflow): dropped {count} "
            "pair(s): ") in line, line
    for cause in _CAUSES[mode]:
        assert cause in line, (cause, line)
    assert ("capacity" in line) == (mode != "invalid"), line
    assert int(line.split()[1]) <= 12, line  # short message
    assert "jax.pure_callback failed" not in err  # no per-device logged tracebacks
    assert "Exception ignored" not in err and "OverflowError" not in err, err  # not again at exit


def test_num_dropped_shape_and_total():
    """num_valid / num_dropped are [1] (returnable with out_specs=P(axes)) and
    equal to the NumPy model's per rank (capacity drops at the receiver plus
    the sender's invalid ids, each EP group of the data axis on its own);
    total_dropped is the psum over every mesh axis, returnable with out_specs=P()."""
    D, Rr, T, K, E = 2, 4, 8, 2, 8
    mesh = make_mesh((D, Rr), ("data", "ep"))
    cfg = _cfg(num_experts=E, topk=K, max_tokens_per_rank=T, capacity=4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((D * Rr * T, H)).astype(np.float32)
    idx = rng.integers(0, E, size=(D * Rr * T, K)).astype(np.int32)
    idx[:, 1] = np.where(idx[:, 1] == idx[:, 0], -1, idx[:, 1])
    idx[5, 0], idx[41, 1] = E + 2, -4   # invalid ids, counted by their sender
    w = np.ones((D * Rr * T, K), np.float32)
    tok = P(("data", "ep"))

    def fn(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        assert d.num_dropped.shape == (1,) and d.num_valid.shape == (1,)
        return d.num_dropped, d.num_valid, d.total_dropped

    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(tok,) * 3, out_specs=(tok, tok, P())))
    dropped, valid, total = f(x, idx, w)
    assert dropped.shape == (D * Rr,) and valid.shape == (D * Rr,) and total.shape == ()
    per_group = [npm.dispatch(*(a.reshape(D, Rr, T, -1)[g] for a in (x, idx, w)), E, C=4)
                 for g in range(D)]
    want_dropped = np.concatenate([m["num_dropped"] for m in per_group])
    want_valid = np.concatenate([m["num_valid"] for m in per_group])
    capacity_drops = want_dropped.sum() - 2
    assert capacity_drops > 0
    np.testing.assert_array_equal(np.asarray(dropped), want_dropped)
    np.testing.assert_array_equal(np.asarray(valid), want_valid)
    assert int(total) == int(want_dropped.sum())


# -- 3. T = 0 ------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_zero_tokens(layout):
    K, E = 2, 16
    mesh = make_mesh((R,), ("ep",))
    cfg = _cfg(layout=layout, topk=K)
    spec = P("ep")

    def fn(x, i, w, p):
        d = jax_ep.dispatch(x, i, w, cfg)
        out = jax_ep.combine(d.x * p, d, cfg)
        gs = d.group_sizes if layout == "expert_major" else jnp.zeros((E // R,), jnp.int32)
        ntr, nte, itr = jax_ep.get_dispatch_layout(i, cfg)
        return out, d.num_valid, d.num_dropped, gs, ntr, nte, itr, jnp.sum(d.x)[None]

    # p: XLA rejects a shard_map whose every operand is empty, so give it one real one
    f = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
    p = jnp.full((R,), 2.0, jnp.float32)
    x = jnp.zeros((0, H), jnp.float32)
    i = jnp.zeros((0, K), jnp.int32)
    w = jnp.zeros((0, K), jnp.float32)
    out, nv, nd, gs, ntr, nte, itr, s = jax.jit(f)(x, i, w, p)
    assert out.shape == (0, H) and itr.shape == (0, R)
    for a in (nv, nd, gs, ntr, nte, s):
        assert not np.any(np.asarray(a)), a
    gx, gw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, i, w, p)[0]), argnums=(0, 1)))(x, w)
    assert gx.shape == (0, H) and gw.shape == (0, K)


# -- 4. inputs and messages --------------------------------------------------------------
@pytest.mark.parametrize("idx_dtype,w_dtype", [(np.int16, jnp.bfloat16), (np.uint8, jnp.float16),
                                               (np.int32, jnp.bfloat16)])
def test_any_int_idx_any_float_weights(idx_dtype, w_dtype):
    T, K, E = 6, 2, 16
    rng = np.random.default_rng(5)
    mesh = make_mesh((R,), ("ep",))
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).reshape(R, T, K)
    idx[0, 0, 0] = 200  # out of range: dropped and counted, never wrapped into [0, E)
    w = rng.random((R, T, K)).astype(np.float32)
    w_cast = np.asarray(jnp.asarray(w, w_dtype).astype(jnp.float32))
    cfg = _cfg(topk=K)
    fn = lambda a, b, c: (lambda d: (d.x, d.weights, d.num_dropped))(jax_ep.dispatch(a, b, c, cfg))
    got = run_per_rank(fn, mesh, "ep", x, idx.astype(idx_dtype), jnp.asarray(w, w_dtype))
    want = npm.dispatch(x, idx.astype(np.int32), w_cast, E)
    np.testing.assert_array_equal(got[0].reshape(want["x"].shape), want["x"])
    np.testing.assert_array_equal(got[1].reshape(want["weights"].shape), want["weights"])
    np.testing.assert_array_equal(got[2].reshape(-1), want["num_dropped"])


@pytest.mark.slow
def test_int64_idx_under_x64():
    script = r"""
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, jax_ep
from ep_testing import make_mesh, run_per_rank
cfg = jax_ep.EpConfig(num_experts=16, topk=2, max_tokens_per_rank=4, hidden=8, backend="reference")
mesh = make_mesh((8,), ("ep",))
scores = np.random.default_rng(0).random((8, 4, 16))
idx = np.argsort(-scores, axis=-1)[..., :2]  # int64
idx[0, 0, 0] = 2**40  # must stay invalid, not wrap
out = run_per_rank(lambda x, i, w: (jax_ep.dispatch(x, i, w, cfg).num_dropped,), mesh, "ep",
                   np.ones((8, 4, 8), np.float32), idx, np.ones((8, 4, 2), np.float64))
print("DROPPED", int(np.sum(out[0])), idx.dtype)
"""
    out, err = _run_script(script)
    assert "DROPPED 1 int64" in out, out + err


def _trace(fn, *avals, mesh=None):
    mesh = mesh or make_mesh((R,), ("ep",))
    spec = P(tuple(mesh.axis_names))
    f = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(avals), out_specs=spec)
    return jax.eval_shape(f, *[jax.ShapeDtypeStruct((R * a.shape[0],) + a.shape[1:], a.dtype)
                               for a in avals])


def _avals(T=4, K=4, H_=H):
    return (jax.ShapeDtypeStruct((T, H_), jnp.float32), jax.ShapeDtypeStruct((T, K), jnp.int32),
            jax.ShapeDtypeStruct((T, K), jnp.float32))


def test_unknown_axis_lists_bound_axes():
    mesh = make_mesh((2, 4), ("data", "expert"))
    cfg = _cfg()
    with pytest.raises(ValueError, match=r"axis_name 'ep'.*\('data', 'expert'\)"):
        _trace(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg).x, *_avals(), mesh=mesh)


def test_huge_alignment_warns_with_bytes():
    cfg = _cfg(expert_alignment=2**20, hidden=256)
    with pytest.warns(RuntimeWarning, match=r"expert_alignment=1048576\) allocate [\d,]+ bytes"):
        _trace(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg).x, *_avals(H_=256))
    with warnings.catch_warnings():  # the default sizes do not warn
        warnings.simplefilter("error")
        _trace(lambda x, i, w: jax_ep.dispatch(x, i, w, _cfg()).x, *_avals())


def test_fallback_notice_is_logged_once(caplog, capsys, monkeypatch):
    """With the extension built but the runtime down, "auto" says so once;
    without the extension it falls back silently (nothing at import either)."""
    from jax_ep import backend, extension
    cfg = _cfg(backend="auto")
    for built, want in ((True, 1), (False, 0)):
        monkeypatch.setattr(extension, "available", lambda built=built: built)
        monkeypatch.setattr(backend, "_notice_printed", False)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jax_ep"):
            for family in backend.FAMILIES:   # one notice, whichever family asks
                assert backend.select(family, cfg) is family.reference
        notes = [r for r in caplog.records if "using the reference backend" in r.getMessage()]
        assert len(notes) == want and all("\n" not in r.getMessage() for r in notes)
    assert "reference backend" not in capsys.readouterr().err  # logged, not printed


def test_import_prints_nothing():
    out = subprocess.run([sys.executable, "-c", "import jax_ep"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["jvp", "jacfwd"])
def test_forward_mode_is_a_clear_error(how):
    T, K, E = 4, 2, 16
    mesh = make_mesh((R,), ("ep",))
    cfg = _cfg(topk=K)
    idx = jnp.asarray(np.arange(R * T * K).reshape(R * T, K) % E, jnp.int32)
    w = jnp.ones((R * T, K), jnp.float32)

    def per_rank(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        return jax_ep.combine(d.x, d, cfg)

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    x = jnp.ones((R * T, H), jnp.float32)
    with pytest.raises(TypeError, match="reverse-mode.*jax.vjp"):
        if how == "jvp":
            jax.jvp(lambda x: f(x, idx, w), (x,), (x,))
        else:
            jax.jacfwd(lambda x: jnp.sum(f(x, idx, w)))(x)
    # reverse mode still works
    assert jax.grad(lambda x: jnp.sum(f(x, idx, w)))(x).shape == x.shape


@pytest.mark.parametrize("E,dt", [(256, np.uint8), (128, np.int8), (64, np.int16)])
def test_narrow_int_idx_is_exact(E, dt):
    """Narrow integer ids are cast, never clipped in their own dtype (where E may wrap)."""
    mesh = make_mesh((8,), ("ep",))
    T, H, K = 4, 8, 2
    rng = np.random.default_rng(0)
    idx = np.stack([rng.choice(np.arange(E - 28, E), K, replace=False) for _ in range(8 * T)])
    idx = idx.reshape(8, T, K)
    x = rng.standard_normal((8, T, H)).astype(np.float32)
    w = rng.random((8, T, K)).astype(np.float32)
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                          backend="reference")
    f = lambda a, b, c: (lambda d: (d.group_sizes, d.num_dropped))(jax_ep.dispatch(a, b, c, cfg))
    gs_n, nd_n = run_per_rank(f, mesh, "ep", x, idx.astype(dt), w)
    gs_i, nd_i = run_per_rank(f, mesh, "ep", x, idx.astype(np.int32), w)
    np.testing.assert_array_equal(gs_n, gs_i)
    assert int(np.sum(nd_n)) == 0 and int(np.sum(nd_i)) == 0


def test_check_overflow_partially_manual_is_a_clear_error():
    mesh = make_mesh((2, 4), ("data", "ep"))
    cfg = jax_ep.EpConfig(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=8,
                          backend="reference", check_overflow=True)

    def body(x, i, w):
        return jax_ep.dispatch(x, i, w, cfg).x

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"),
                              axis_names={"ep"}))
    x = np.zeros((16, 8), np.float32)
    i = np.zeros((16, 2), np.int32)
    with pytest.raises(ValueError, match="manual over every mesh axis"):
        f.trace(x, i, np.ones((16, 2), np.float32))


def test_total_dropped_partially_manual():
    mesh = make_mesh((2, 4), ("data", "ep"))
    cfg = jax_ep.EpConfig(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=8,
                          backend="reference", capacity=1)

    def body(x, i, w):
        return jax_ep.dispatch(x, i, w, cfg).total_dropped

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P(),
                              axis_names={"ep"}))
    i = np.tile(np.array([[0, 1]], np.int32), (16, 1))
    out = f(np.ones((16, 8), np.float32), i, np.ones((16, 2), np.float32))
    assert int(np.asarray(out).reshape(-1)[0]) > 0
