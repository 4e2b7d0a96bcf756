"""CPU checks of the internode (hierarchical) plan, docs/internode.md: the
NumPy model (tests/internode_model.py) of what each leg moves and of the
combine's node-grouped sum, on handles from the reference router. The GPU
loopback tests hold the kernels to the same model."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import internode_model as im
from ep_testing import make_mesh, random_routing, run_per_rank
from jax_ep.intranode import reference
from jax_ep.config import EpConfig

R = 8


def _handles(idx, E, layout="expert_major"):
    T, K = idx.shape[1], idx.shape[2]
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=128, layout=layout,
                   backend="reference")

    def fn(i):
        h = reference.BACKEND.router.route(i, cfg, R)[0]
        return h.send_mask, h.recv_local_idx, h.slot_row
    return run_per_rank(fn, make_mesh((R,), ("ep",)), "ep", idx)


def _reference_combine(y, w, send_mask, li, sr, layout, E, K):
    """jax_ep.intranode.reference's combine on the same handle (the model's flat sum is
    that formula; XLA:CPU may contract to FMA, so compared within rounding)."""
    from jax_ep.types import Handle

    T = sr.shape[2]
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=y.shape[2], layout=layout,
                   backend="reference")
    rs = np.zeros((R, y.shape[1]), np.int32)

    def fn(sm, l, s, r, yy, *ww):
        h = Handle(send_mask=sm, recv_local_idx=l, slot_row=s, row_src=r, native=None,
                   num_ranks=R, num_tokens=T, capacity=y.shape[1], layout=layout)
        return reference.BACKEND.combine_rows(yy, ww[0] if ww else None, h, cfg)
    args = [send_mask, li, sr, rs, y] + ([w] if w is not None else [])
    return run_per_rank(fn, make_mesh((R,), ("ep",)), "ep", *args)


@pytest.mark.parametrize("N", [1, 2, 4, 8])
def test_dispatch_plan_delivers_once_per_node(N):
    rng = np.random.default_rng(0)
    idx = random_routing(rng, R, 64, 8, 64, minus_one=0.2, skew=True)
    send_mask, _, _ = _handles(idx, 64)
    G = R // N
    plan = im.dispatch_plan(send_mask, N)
    for r in range(R):  # every (s, t) reaches exactly the ranks of send_mask
        want = {(s, t) for s in range(R) for t in range(64) if send_mask[s, t, r]}
        assert plan["delivered"][r] == want
    for (s, f), toks in plan["net"].items():
        assert f % G == s % G  # the network leg lands on the same local index
        assert len(set(toks)) == len(toks)  # once per (token, node)
        m = f // G
        assert set(toks) == {t for t in range(64) if send_mask[s, t, m * G:(m + 1) * G].any()}
    for (f, r), rows in plan["nvl"].items():
        assert f // G == r // G  # forwarding stays inside the node
    net = sum(len(v) for v in plan["net"].values())
    intranode = int(send_mask.sum())
    assert net <= intranode and (N < R or net == intranode)


def test_group_limited_routing_node_count():
    rng = np.random.default_rng(1)
    for N, M in ((2, 1), (4, 2), (4, 1)):
        idx = im.group_limited_routing(rng, R, 50, 8, 64, N, M, minus_one=0.1)
        node = np.where(idx >= 0, idx // (64 // N), -1)
        for r in range(R):
            for t in range(50):
                assert len(set(node[r, t][node[r, t] >= 0])) <= M
            assert all(len(set(row[row >= 0])) == (row >= 0).sum() for row in idx[r])


@pytest.mark.parametrize("layout,dt", [("expert_major", jnp.bfloat16), ("rank_major", jnp.bfloat16),
                                       ("expert_major", np.float32)])
def test_hierarchical_combine_formula(layout, dt):
    """The model's flat formula is the reference's bits (power-of-two weights:
    exact products, so no FMA changes them); N = 1 and N = R: the intranode
    bits (cast is idempotent); otherwise within the node partial's one extra
    rounding; the same bits every run."""
    rng = np.random.default_rng(2)
    T, K, E, H = 24, 8, 64, 64
    idx = random_routing(rng, R, T, K, E, minus_one=0.2, skew=True)
    send_mask, li, sr = _handles(idx, E, layout)
    C = int(sr.max()) + 1
    y = rng.standard_normal((R, C, H)).astype(np.float32).astype(dt)
    w = None if layout == "rank_major" else (2.0 ** rng.integers(-3, 2, (R, C))).astype(np.float32)
    flat = im.combine_flat(y, w, send_mask, li, sr, layout == "rank_major")
    ref = _reference_combine(y, w, send_mask, li, sr, layout, E, K)
    assert np.array_equal(flat.view(np.uint8), np.asarray(ref).view(np.uint8))
    for N in (1, 2, 4, 8):
        hier = im.combine_hier(y, w, send_mask, li, sr, N, layout == "rank_major")
        again = im.combine_hier(y, w, send_mask, li, sr, N, layout == "rank_major")
        assert np.array_equal(hier.view(np.uint8), again.view(np.uint8))
        a, b = hier.astype(np.float32), flat.astype(np.float32)
        if N in (1, R):
            assert np.array_equal(hier.view(np.uint8), flat.view(np.uint8)), N
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < (1e-2 if dt == jnp.bfloat16 else 1e-6), (N, rel)
