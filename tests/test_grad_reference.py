"""Gradients through dispatch -> ragged_dot -> combine equal those of a dense MoE."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
from ep_testing import make_mesh, random_routing


def _dense_moe(x, idx, w, W):
    """x [N,H], idx/w [N,K], W [E,H,F]: out[t] = sum_k w * tanh(x W[e_k]) @ ones-proj."""
    valid = (idx >= 0)
    We = W[jnp.maximum(idx, 0)]  # [N,K,H,F]
    h = jnp.tanh(jnp.einsum("nh,nkhf->nkf", x, We))
    out = h[..., : x.shape[1]]
    return jnp.sum(jnp.where(valid[..., None], w[..., None] * out, 0.0), axis=1)


def _ep_and_dense_losses(layout, mesh_shape, ragged_dot=True):
    """(loss_ep, loss_dense, ep_args, dense_args): the same MoE loss of (x, w,
    W) through dispatch -> experts -> combine on the mesh and densely.
    ``ragged_dot=False``: expert_major's experts by a gather of each row's
    weight instead (lax.ragged_dot has no second derivative)."""
    names = ("ep",) if len(mesh_shape) == 1 else ("data", "ep")
    mesh = make_mesh(mesh_shape, names)
    R = mesh_shape[-1]
    n = int(np.prod(mesh_shape))
    T, H, K, E = 7, 16, 2, 16
    L = E // R
    rng = np.random.default_rng(len(mesh_shape) + (layout == "rank_major"))
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    idx = random_routing(rng, n, T, K, E, skew=True).reshape(n * T, K)
    w = rng.random((n * T, K)).astype(np.float32)
    W = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)
    ct = rng.standard_normal((n * T, H)).astype(np.float32)
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                          expert_alignment=4 if layout == "expert_major" else 1, backend="reference")
    tok = P(names)

    def per_rank(x, idx, w, W):
        d = jax_ep.dispatch(x, idx, w, cfg)
        if layout == "expert_major" and ragged_dot:
            h = jnp.tanh(jax.lax.ragged_dot(d.x, W, d.group_sizes))
        elif layout == "expert_major":   # rows past the groups: combine reads none
            row_expert = jnp.searchsorted(jnp.cumsum(d.group_sizes), jnp.arange(d.x.shape[0]),
                                          side="right")
            We = W[jnp.minimum(row_expert, W.shape[0] - 1)]
            h = jnp.tanh(jnp.einsum("ch,chf->cf", d.x, We))
        else:  # weighted sum over this rank's experts, on the expert side
            hk = jnp.tanh(jnp.einsum("ch,lhf->clf", d.x, W))  # [C, L, H]
            sel = jax.nn.one_hot(d.topk_idx, L) * d.topk_weights[..., None]  # [C, K, L]
            h = jnp.einsum("ckl,clf->cf", sel, hk)
        return jax_ep.combine(h, d, cfg)

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=(tok, tok, tok, P("ep")), out_specs=tok)

    def loss_ep(x, w, W):
        return jnp.sum(f(x, idx, w, W) * ct)

    def loss_dense(x, w, W):
        return jnp.sum(_dense_moe(x, idx_clean, w, W) * ct)

    # the dense model sees the same routing within each data replica
    idx_clean = jnp.asarray(idx)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    return loss_ep, loss_dense, (put(x, tok), put(w, tok), put(W, P("ep"))), (x, w, W)


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
def test_grad_matches_dense(layout, mesh_shape):
    loss_ep, loss_dense, args, dense_args = _ep_and_dense_losses(layout, mesh_shape)
    v_ep, g_ep = jax.jit(jax.value_and_grad(loss_ep, argnums=(0, 1, 2)))(*args)
    v_d, g_d = jax.jit(jax.value_and_grad(loss_dense, argnums=(0, 1, 2)))(*dense_args)
    np.testing.assert_allclose(v_ep, v_d, rtol=1e-5)
    for name, a, b in zip(("x", "topk_weights", "W"), g_ep, g_d):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_hessian_vector_products_match_dense(layout):
    """Second order on the reference backend: a Hessian-vector product by
    forward-over-reverse (``jax.jvp`` of the gradient) and by reverse-over-
    reverse, w.r.t. (x, topk_weights, W), equals the dense model's."""
    loss_ep, loss_dense, args, dense_args = _ep_and_dense_losses(layout, (2, 4), ragged_dot=False)
    rng = np.random.default_rng(11)
    v = tuple(jnp.asarray(rng.standard_normal(a.shape), jnp.float32) for a in dense_args)
    grad = lambda loss: jax.grad(loss, argnums=(0, 1, 2))
    fwd_rev = lambda loss, a: jax.jvp(lambda *p: grad(loss)(*p), a, v)[1]
    rev_rev = lambda loss, a: jax.grad(
        lambda *p: sum(jnp.vdot(g, t) for g, t in zip(grad(loss)(*p), v)), argnums=(0, 1, 2))(*a)
    want = jax.jit(lambda *a: fwd_rev(loss_dense, a))(*dense_args)
    for name, hvp in (("forward-over-reverse", fwd_rev), ("reverse-over-reverse", rev_rev)):
        got = jax.jit(lambda *a: hvp(loss_ep, a))(*args)
        for arg, a, b in zip(("x", "topk_weights", "W"), got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4,
                                       err_msg=f"{name}, {arg}")


def test_second_order_on_the_native_backend_raises_clearly(monkeypatch):
    """The native kernels have no derivative rules: a second-order derivative
    through dispatch / combine on the native backend raises one TypeError
    naming the reference backend (the reference backend, renamed, stands in
    for it: the rules key on the backend's name); first order is unchanged."""
    from jax_ep.intranode import reference
    loss_ep, _, args, _ = _ep_and_dense_losses("expert_major", (2, 4), ragged_dot=False)
    want = jax.jit(jax.grad(loss_ep, argnums=(0, 1, 2)))(*args)
    monkeypatch.setattr(reference.ReferenceBackend, "name", "native")
    got = jax.jit(jax.grad(loss_ep, argnums=(0, 1, 2)))(*args)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    grad_norm = lambda *a: sum(jnp.sum(g ** 2) for g in jax.grad(loss_ep, argnums=(0, 1, 2))(*a))
    with pytest.raises(TypeError, match=r"jax_ep\.(dispatch|combine): a second-order .*"
                                        r"backend='reference'"):
        jax.grad(grad_norm)(*args)
