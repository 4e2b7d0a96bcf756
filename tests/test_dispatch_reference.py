"""Reference dispatch is bit-exact against the NumPy model of docs/semantics.md."""
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_ep
import numpy_model as npm
from ep_testing import make_mesh, random_routing, run_per_rank

BF16 = ml_dtypes.bfloat16


def _run_dispatch(cfg, mesh, x, idx, w, scales=None):
    def fn(x, i, w, *s):
        d = jax_ep.dispatch(x, i, w, cfg, x_scales=s[0] if s else None)
        out = {"x": d.x, "num_valid": d.num_valid, "num_dropped": d.num_dropped,
               "row_src": d.handle.row_src}
        if d.x_scales is not None:
            out["scales"] = d.x_scales
        if cfg.layout == "expert_major":
            out.update(group_sizes=d.group_sizes, weights=d.weights)
        else:
            out.update(topk_idx=d.topk_idx, topk_weights=d.topk_weights)
        return out
    args = (x, idx, w) + ((scales,) if scales is not None else ())
    return run_per_rank(fn, mesh, cfg.axis_name, *args)


def _check(got, want, layout):
    keys = ["x", "num_valid", "num_dropped", "row_src"]
    keys += ["group_sizes", "weights"] if layout == "expert_major" else ["topk_idx", "topk_weights"]
    for k in keys:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        g = g.reshape(w.shape)
        if g.dtype.kind == "f" or g.dtype == BF16:
            # bit-exact: compare the raw bits
            assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=k)
        else:
            np.testing.assert_array_equal(g.astype(np.int64), w.astype(np.int64), err_msg=k)


def _inputs(rng, R, T, H, K, E, dtype=np.float32, **route_kw):
    x = rng.standard_normal((R, T, H)).astype(dtype)
    idx = random_routing(rng, R, T, K, E, **route_kw)
    w = rng.random((R, T, K)).astype(np.float32)
    return x, idx, w


CASES = list(itertools.product(["expert_major", "rank_major"], [1, 7, 64], [1, 2, 8], [8, 64]))


@pytest.mark.parametrize("layout,T,K,E", CASES)
def test_dispatch_matches_model(layout, T, K, E):
    R, H = 8, 24
    rng = np.random.default_rng(hash((layout, T, K, E)) % 2**32)
    mesh = make_mesh((R,), ("ep",))
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                          layout=layout, backend="reference")
    x, idx, w = _inputs(rng, R, T, H, K, E, dtype=BF16, skew=(T == 64), repeat=0.15)
    got = _run_dispatch(cfg, mesh, x, idx, w)
    want = npm.dispatch(x, idx, w, E, layout=layout)
    _check(got, want, layout)
    assert got["x"].shape[1] == cfg.capacity_for(R, T)


@pytest.mark.parametrize("align", [1, 4, 128])
def test_expert_alignment(align):
    R, T, H, K, E = 8, 64, 16, 8, 64
    rng = np.random.default_rng(align)
    mesh = make_mesh((R,), ("ep",))
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                          expert_alignment=align, backend="reference")
    x, idx, w = _inputs(rng, R, T, H, K, E, skew=True, repeat=0.15)
    got = _run_dispatch(cfg, mesh, x, idx, w)
    want = npm.dispatch(x, idx, w, E, align=align)
    _check(got, want, "expert_major")
    gs = got["group_sizes"].reshape(R, -1)
    assert np.all(gs % align == 0)
    # groups tile x: rows past sum(group_sizes) are zero, padding rows are zero with weight 0
    for r in range(R):
        assert np.all(got["x"][r, gs[r].sum():] == 0)
        pad = got["row_src"][r] < 0
        assert np.all(got["weights"][r][pad] == 0) and np.all(got["x"][r][pad] == 0)


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_capacity_overflow_counted(layout):
    R, T, H, K, E = 8, 64, 8, 8, 64
    rng = np.random.default_rng(7)
    mesh = make_mesh((R,), ("ep",))
    C = 40
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                          layout=layout, capacity=C, expert_alignment=4 if layout == "expert_major" else 1,
                          backend="reference")
    x, idx, w = _inputs(rng, R, T, H, K, E, skew=True, invalid=0.05)
    got = _run_dispatch(cfg, mesh, x, idx, w)
    want = npm.dispatch(x, idx, w, E, layout=layout, align=cfg.expert_alignment, C=C)
    _check(got, want, layout)
    assert got["x"].shape[1] == C
    assert np.all(want["num_dropped"] > 0) and np.sum(got["num_dropped"]) == np.sum(want["num_dropped"])


_CHECKED_SCRIPT = """
import numpy as np, jax_ep
from ep_testing import make_mesh, random_routing, run_per_rank
R, T, H, K, E = 8, 16, 8, 4, 8
mesh = make_mesh((R,), ("ep",))
cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, capacity=4,
                      check_overflow=True, backend="reference")
rng = np.random.default_rng(3)
x = rng.standard_normal((R, T, H)).astype(np.float32)
idx = random_routing(rng, R, T, K, E, minus_one=0.0)
w = rng.random((R, T, K)).astype(np.float32)
try:
    # only .x is used: the check must survive XLA's dead-code elimination
    run_per_rank(lambda a, b, c: jax_ep.dispatch(a, b, c, cfg).x, mesh, "ep", x, idx, w)
except Exception as e:
    print("RAISED", type(e).__name__, str(e).splitlines()[-1][:300])
else:
    print("NO ERROR")
"""


@pytest.mark.slow
def test_checked_mode_raises_on_overflow():
    # In a subprocess: a failed host callback leaves JAX's runtime token in error state.
    import os, subprocess, sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] + sys.path))
    p = subprocess.run([sys.executable, "-c", _CHECKED_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=300)
    assert "RAISED" in p.stdout, p.stdout + p.stderr
    assert "dropped" in p.stdout and "capacity" in p.stdout, p.stdout


def test_invalid_ids_are_dropped_and_counted():
    R, T, H, K, E = 8, 7, 8, 2, 8
    rng = np.random.default_rng(11)
    mesh = make_mesh((R,), ("ep",))
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, backend="reference")
    x, idx, w = _inputs(rng, R, T, H, K, E, invalid=0.3)
    got = _run_dispatch(cfg, mesh, x, idx, w)
    want = npm.dispatch(x, idx, w, E)
    _check(got, want, "expert_major")
    bad = ((idx < -1) | (idx >= E)).sum(axis=(1, 2))
    np.testing.assert_array_equal(got["num_dropped"].reshape(-1), bad)


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_sub_axis_mesh(layout):
    """EP over one axis of a ('data', 'ep') mesh: each data replica is its own EP group."""
    D, R, T, H, K, E = 2, 4, 7, 16, 2, 8
    rng = np.random.default_rng(5)
    mesh = make_mesh((D, R), ("data", "ep"))
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                          backend="reference")
    x, idx, w = _inputs(rng, D * R, T, H, K, E)
    got = _run_dispatch(cfg, mesh, x, idx, w)
    for d in range(D):
        sl = slice(d * R, (d + 1) * R)
        want = npm.dispatch(x[sl], idx[sl], w[sl], E, layout=layout)
        _check({k: v[sl] for k, v in got.items()}, want, layout)


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_fp8_input_with_scales(layout):
    R, T, H, K, E = 8, 7, 256, 2, 64
    rng = np.random.default_rng(9)
    mesh = make_mesh((R,), ("ep",))
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                          backend="reference")
    x, idx, w = _inputs(rng, R, T, H, K, E)
    xq = x.astype(ml_dtypes.float8_e4m3fn)
    sc = rng.random((R, T, H // 128)).astype(np.float32)
    got = _run_dispatch(cfg, mesh, xq, idx, w, sc)
    want = npm.dispatch(xq, idx, w, E, layout=layout, scales=sc)
    _check(got, want, layout)
    np.testing.assert_array_equal(got["scales"].reshape(want["scales"].shape), want["scales"])


def _np_fp8_cast(x):
    T, H = x.shape
    xf = x.astype(np.float32).reshape(T, H // 128, 128)
    amax = np.maximum(np.abs(xf).max(-1), np.float32(1e-4))
    inv = (np.float32(448.0) / amax).astype(np.float32)
    q = np.clip(xf * inv[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(T, H), (amax * np.float32(1.0 / 448.0)).astype(np.float32)


def test_fp8_dispatch_casts_like_numpy():
    R, T, H, K, E = 8, 7, 256, 2, 8
    rng = np.random.default_rng(13)
    mesh = make_mesh((R,), ("ep",))
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, fp8_dispatch=True,
                          backend="reference")
    x, idx, w = _inputs(rng, R, T, H, K, E, dtype=BF16)
    x[0, 0, :128] = 0  # an all-zero block takes the 1e-4 floor
    got = _run_dispatch(cfg, mesh, x, idx, w)
    q, s = zip(*(_np_fp8_cast(x[r]) for r in range(R)))
    want = npm.dispatch(np.stack(q), idx, w, E, scales=np.stack(s))
    _check(got, want, "expert_major")
    np.testing.assert_array_equal(got["scales"].reshape(want["scales"].shape), want["scales"])


def test_layout_matches_model():
    R, T, K, E = 8, 64, 8, 64
    rng = np.random.default_rng(17)
    mesh = make_mesh((R,), ("ep",))
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=8, backend="reference")
    idx = random_routing(rng, R, T, K, E, skew=True, invalid=0.05)
    got = run_per_rank(lambda i: jax_ep.get_dispatch_layout(i, cfg), mesh, "ep", idx)
    want = npm.layout(idx, E, R)
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).reshape(w_.shape), w_)


@jax.custom_vjp
def _dequantized(q, s):
    """``q * s`` per 128 columns, with the fp8 cotangent convention: the
    cotangent of ``q`` is that of the dequantized rows (f32), ``s`` gets none."""
    rows = q.astype(jnp.float32).reshape(q.shape[0], -1, 128) * s[..., None]
    return rows.reshape(q.shape)


_dequantized.defvjp(lambda q, s: (_dequantized(q, s), None), lambda _, g: (g, None))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_fp8_dispatch_gradient_is_straight_through(dtype):
    """The fp8 rows' cotangent (that of the dequantized rows) reaches x exactly
    as the bf16/f32 dispatch's row cotangent does; one for the scales is ignored;
    a second-order derivative raises."""
    R, T, H, K, E = 8, 4, 256, 2, 8
    mesh = make_mesh((R,), ("ep",))
    rng = np.random.default_rng(0)
    x, idx, w = _inputs(rng, R, T, H, K, E, dtype=dtype)
    spec = jax.sharding.PartitionSpec("ep")

    def loss(x, fp8):
        cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                              fp8_dispatch=fp8, backend="reference")

        def f(x, i, w):
            d = jax_ep.dispatch(x, i, w, cfg)
            c = jnp.sin(jnp.arange(d.x.size, dtype=jnp.float32)).reshape(d.x.shape)
            if not fp8:
                return jnp.sum(d.x.astype(jnp.float32) * c)[None]
            return (jnp.sum(_dequantized(d.x, d.x_scales) * c) + jnp.sum(d.x_scales))[None]
        return jnp.sum(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(
            x, idx.reshape(R * T, K), w.reshape(R * T, K)))

    xs = jnp.asarray(x.reshape(R * T, H))
    g8 = jax.jit(jax.grad(lambda x: loss(x, True)))(xs)
    g = jax.jit(jax.grad(lambda x: loss(x, False)))(xs)
    assert g8.dtype == xs.dtype and float(jnp.max(jnp.abs(g.astype(jnp.float32)))) > 0
    np.testing.assert_array_equal(np.asarray(g8), np.asarray(g))
    # first order only: a gradient of this gradient would carry a tangent into fp8 rows
    grad_norm = lambda x: jnp.sum(jax.grad(lambda x: loss(x, True))(x).astype(jnp.float32) ** 2)
    with pytest.raises(TypeError, match=r"jax_ep\.dispatch: a second-order derivative"):
        jax.grad(grad_norm)(xs)
