"""Bad input fails at trace time with a message naming the argument."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from ep_testing import make_mesh

R, T, H, K, E = 8, 4, 256, 2, 16


def _cfg(**kw):
    base = dict(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, backend="reference")
    base.update(kw)
    return jax_ep.EpConfig(**base)


def _trace(fn, *args, mesh=None, axis="ep"):
    mesh = mesh or make_mesh((R,), (axis,))
    spec = P(tuple(mesh.axis_names))
    f = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec)
    return jax.eval_shape(f, *[jax.ShapeDtypeStruct((R * a.shape[0],) + a.shape[1:], a.dtype) for a in args])


def _args(x_dtype=jnp.bfloat16, T_=T, H_=H, K_=K, idx_dtype=jnp.int32, w_dtype=jnp.float32):
    return (jax.ShapeDtypeStruct((T_, H_), x_dtype), jax.ShapeDtypeStruct((T_, K_), idx_dtype),
            jax.ShapeDtypeStruct((T_, K_), w_dtype))


def _dispatch(cfg, **kw):
    return _trace(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg).x, *_args(**kw))


def test_ok_traces():
    out = _dispatch(_cfg())
    assert out.shape[1] == H


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(idx_dtype=jnp.float32), TypeError, "topk_idx must be an integer array"),
    (dict(idx_dtype=jnp.bool_), TypeError, "topk_idx must be an integer array"),
    (dict(w_dtype=jnp.int32), TypeError, "topk_weights must be a floating-point array"),
    (dict(x_dtype=jnp.int32), TypeError, "x dtype"),
    (dict(H_=128), ValueError, "hidden"),
    (dict(K_=3), ValueError, "topk"),
    (dict(T_=T + 1), ValueError, "x has 5 tokens per rank, more than "
                                 "EpConfig.max_tokens_per_rank=4"),
    (dict(x_dtype=jnp.float8_e4m3fn), ValueError, "x_scales"),
])
def test_bad_dispatch_args(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        _dispatch(_cfg(), **kw)


def test_experts_not_divisible_by_axis():
    with pytest.raises(ValueError, match="divisible"):
        _dispatch(_cfg(num_experts=12))


def test_unknown_axis_name():
    with pytest.raises(ValueError, match="axis_name 'experts'"):
        _dispatch(_cfg(axis_name="experts"))


def test_topk_exceeds_experts():
    with pytest.raises(ValueError, match="topk"):
        _cfg(topk=E + 1)


def test_fp8_needs_multiple_of_128():
    with pytest.raises(ValueError, match="hidden % 128"):
        _cfg(hidden=200, fp8_dispatch=True)
    cfg = _cfg(hidden=200)
    with pytest.raises(ValueError, match="hidden % 128"):
        _trace(lambda x, i, w, s: jax_ep.dispatch(x, i, w, cfg, x_scales=s).x,
               *_args(x_dtype=jnp.float8_e4m3fn, H_=200), jax.ShapeDtypeStruct((T, 1), jnp.float32))


def test_rank_mismatch_messages():
    cfg = _cfg()
    with pytest.raises(ValueError, match="x must be a rank-2"):
        _trace(lambda x, i, w: jax_ep.dispatch(x.reshape(-1), i, w, cfg).x, *_args())
    with pytest.raises(ValueError, match="topk_weights shape"):
        _trace(lambda x, i, w: jax_ep.dispatch(x, i, w[:, :1], cfg).x, *_args())


def test_bad_config_values():
    for kw in (dict(layout="tokens"), dict(backend="cuda"), dict(expert_alignment=0),
               dict(capacity=0), dict(num_sms=-1)):
        with pytest.raises(ValueError):
            _cfg(**kw)


def test_combine_shape_checked():
    cfg = _cfg()

    def fn(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        return jax_ep.combine(d.x[:, :64], d, cfg)
    with pytest.raises(ValueError, match="y must be"):
        _trace(fn, *_args())


def test_config_is_hashable_and_static():
    a, b = _cfg(), _cfg()
    assert a == b and hash(a) == hash(b)
    assert _cfg(capacity=None).capacity_for(8, 4) >= 8 * 4 * min(K, E // 8)


def test_fp8_dispatch_needs_bf16_or_f32():
    with pytest.raises(TypeError, match="fp8_dispatch casts"):
        _dispatch(_cfg(fp8_dispatch=True), x_dtype=jnp.float16)


def test_numpy_ints_in_config():
    cfg = _cfg(num_experts=np.int64(E), capacity=np.int32(64))
    assert cfg == _cfg(capacity=64) and type(cfg.num_experts) is int


@pytest.mark.parametrize("field,value", [("num_experts", 16), ("topk", 1),
                                         ("max_tokens_per_rank", 8), ("capacity", 64),
                                         ("expert_alignment", 4), ("fp8_dispatch", True)])
def test_combine_names_the_config_field_that_differs_from_dispatch(field, value):
    import dataclasses

    mesh = make_mesh((4,), ("ep",))
    cfg = jax_ep.EpConfig(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=128)
    other = dataclasses.replace(cfg, **{field: value})

    def f(x, i, w):
        d = jax_ep.dispatch(x, i, w, cfg)
        return jax_ep.combine(d.x, d, other)

    g = jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    x = np.ones((16, 128), np.float32)
    with pytest.raises(ValueError, match=rf"EpConfig\.{field} is .* here but the dispatch ran "
                                         rf"with .*; pass combine the config dispatch was given"):
        jax.jit(g).lower(x, np.zeros((16, 2), np.int32), np.ones((16, 2), np.float32))


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), 1e12, True, "10", None],
                         ids=["zero", "negative", "nan", "inf", "too_large", "bool", "str",
                              "none"])
@pytest.mark.parametrize("cls", ["KernelTuning", "RaggedConfig"])
def test_bad_peer_timeout_raises_naming_the_field(cls, value):
    """peer_timeout_s (seconds a kernel waits for a peer) must be a finite
    number > 0; anything else is refused when the config is built, so before
    any call is traced."""
    with pytest.raises(ValueError, match=rf"{cls}\.peer_timeout_s must be a finite number of "
                                         r"seconds > 0"):
        getattr(jax_ep, cls)(peer_timeout_s=value)


def test_bad_peer_timeout_raises_inside_a_traced_function():
    """A config built inside the traced function fails while tracing, with the
    same message (no call is lowered)."""
    def fn(x, i, w):
        cfg = _cfg(tuning=jax_ep.KernelTuning(peer_timeout_s=-2))
        return jax_ep.dispatch(x, i, w, cfg).x
    with pytest.raises(ValueError, match=r"KernelTuning\.peer_timeout_s must be a finite"):
        _trace(fn, *_args())


def test_peer_timeout_numbers_are_plain_floats():
    """Ints and NumPy numbers are taken as plain floats (the config stays
    hashable and equal to its float spelling); the default is 10 s."""
    assert jax_ep.KernelTuning().peer_timeout_s == 10.0
    assert jax_ep.RaggedConfig().peer_timeout_s == 10.0
    for v in (100, np.int64(100), np.float32(100.0)):
        t = jax_ep.KernelTuning(peer_timeout_s=v)
        assert type(t.peer_timeout_s) is float and t == jax_ep.KernelTuning(peer_timeout_s=100.0)
        assert hash(_cfg(tuning=t)) == hash(_cfg(tuning=jax_ep.KernelTuning(peer_timeout_s=100.0)))
    assert jax_ep.RaggedConfig(peer_timeout_s=np.float64(0.5)).peer_timeout_s == 0.5
