"""The internode (hierarchical) kernels through jax_ep, on N processes as 2
emulated nodes x N/2 ranks (EpConfig.num_nodes=2; N = $JAX_EP_TEST_NPROCS: 2x1,
2x2, 2x4): the "network" leg between the nodes goes through the same P2P
stores behind the transport seam (cc/internode/legs.cuh); at 2x1 the
forwarding inside a node is trivial (G = 1). The processes may share one GPU
(harness.py).

The dispatch, fp8 and combine tests run twice, over EpConfig.net_transport:
"auto" (both GPUs are mapped: the P2P kernels, no NVSHMEM call) and "put"
(the whole network leg by NVSHMEM puts and fence + signal, this rank
included: the put kernels, docs/internode.md "Network leg transports"); both
must give the same bits as the reference.

Each test is an N-process job (harness.run) whose worker
starts the native runtime itself with ``jax_ep.initialize(config=...)`` of a
num_nodes=2 config (T 1024, H 7168: the internode region is laid out for that
T, so every case with a smaller T also checks the fixed-T layout). Output
buffers are poisoned (JAX_EP_DEBUG_POISON=1) before the kernels run.

- dispatch (bf16 / f32 copy, both layouts, alignment, capacity drops, an SM
  budget): bit-identical to the reference (rows < used: the tail is
  unspecified without zero_tail, and must still hold the poison);
- fp8 dispatch (cast in the kernel from bf16 / f32, and fp8 + scales given):
  bit-identical to the reference's ``fp8_cast`` + dispatch;
- combine: within the documented tolerance of the reference (rel. Frobenius
  < 1e-2 bf16, 1e-6 f32: docs/internode.md), bitwise stable over 10 runs, and
  at G = 1 (no node partial is re-rounded) bit-identical to the intranode
  native combine;
- gradients of a dispatch + combine layer, both layouts: within 2e-2 of the
  reference (the expert_major backward is the internode dispatch of w * g
  plus dw in XLA: jax_ep/internode/native.py).

``$JAX_EP_GPU_TEST_TIMEOUT`` (seconds, default 420) bounds each job.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import harness
from gpu_helpers import Checks, assert_checks, bits, local, per_rank_jit

_N = harness.nprocs()  # processes: 2 emulated nodes of _N / 2 ranks
_REASON = (harness.skip_reason() or harness.testing_skip_reason()  # output poisoning
           or (None if _N % 2 == 0 else f"needs an even number of processes (2 nodes), "
               f"JAX_EP_TEST_NPROCS={_N}"))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

_TIMEOUT = float(os.environ.get("JAX_EP_GPU_TEST_TIMEOUT", "420"))
_SEED = 4321
T_MAX, H_MAX = 1024, 7168  # the internode region's shape


NETS = ["auto", "put"]  # EpConfig.net_transport of the native configs
# EpConfig.num_nodes of the native configs: 2, or 1 in the multi-host rehearsal
# (tests/gpu/rehearsal.py: two launchers as two hosts), where jax_ep splits the
# EP group one node per host by itself.
_NODES = int(os.environ.get("JAX_EP_TEST_NUM_NODES", "2"))


def _run(worker: str, net: str = "auto"):
    results = harness.run(f"test_native_internode:{worker}", n=_N, timeout=_TIMEOUT,
                          kwargs={"net": net}, env={"JAX_EP_DEBUG_POISON": "1"},
                          init_native=False)
    assert_checks(results, f"{worker}[{net}]")


@pytest.mark.parametrize("net", NETS)
def test_internode_dispatch_bitexact(net):
    _run("_dispatch_worker", net)


@pytest.mark.parametrize("net", NETS)
def test_internode_dispatch_fp8(net):
    _run("_fp8_worker", net)


@pytest.mark.parametrize("net", NETS)
def test_internode_combine(net):
    _run("_combine_worker", net)


def test_internode_grad():
    _run("_grad_worker")


# ----------------------------------------------------------------------------
# worker side (run in the job's processes)
# ----------------------------------------------------------------------------
def _cfg(**kw):
    from jax_ep.config import EpConfig

    base = dict(num_experts=8, topk=2, max_tokens_per_rank=T_MAX, hidden=H_MAX,
                num_nodes=_NODES, backend="native")
    base.update(kw)
    return EpConfig(**base)


def _start(n):
    """-> (checks, rng seeded alike on every rank, 1-D "ep" mesh); the runtime
    is started here with the internode region (num_nodes=2, T_MAX, H_MAX)."""
    import jax_ep
    from ep_testing import make_mesh
    from jax_ep import runtime

    if not jax_ep.initialize(config=_cfg()):
        raise SystemExit(f"jax_ep.initialize() failed: {runtime.unavailable_reason()}")
    info = runtime.info()
    nodes, ranks, window, hidden = (int(v) for v in info["inter_shape"])
    # the window is T_MAX where the region fits EpConfig.internode_bytes, else fewer tokens
    assert info["inter_bytes"] > 0 and (nodes, ranks, hidden) == (2, n, H_MAX), info
    assert 0 < window <= T_MAX, info
    return Checks(), np.random.default_rng(_SEED), make_mesh((n,), ("ep",))


def _finish(checks):
    import jax_ep

    jax_ep.finalize()
    return checks.results


# name, T, H, K, E, layout, align, dtype, capacity, num_sms
DISPATCH_CASES = [
    ("idispatch_em_T128_H2048_K8_E64", 128, 2048, 8, 64, "expert_major", 1, "bfloat16", None, None),
    ("idispatch_rm_T7_H2880_K2_E8", 7, 2880, 2, 8, "rank_major", 1, "bfloat16", None, None),
    ("idispatch_em_a128_T1024_H7168_K8_E256", 1024, 7168, 8, 256, "expert_major", 128, "bfloat16",
     None, None),
    ("idispatch_rm_T1024_H7168_K8_E256_sms8", 1024, 7168, 8, 256, "rank_major", 1, "bfloat16",
     None, 8),
    ("idispatch_em_T1_H2048_K1_E8_f32", 1, 2048, 1, 8, "expert_major", 1, "float32", None, None),
    ("idispatch_em_T128_H2048_K8_E64_cap100", 128, 2048, 8, 64, "expert_major", 1, "bfloat16",
     100, None),
]


def _dispatch_case(checks, rng, mesh, R, case, net):
    import jax
    import jax.numpy as jnp

    import jax_ep
    from ep_testing import random_routing

    name, T, H, K, E, layout, align, dt, cap, sms = case
    idx = random_routing(rng, R, T, K, E, minus_one=0.2)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    x = x.astype(jnp.bfloat16) if dt == "bfloat16" else x
    w = rng.random((R, T, K)).astype(np.float32)
    outs = {}
    for be in ("native", "reference"):
        cfg = _cfg(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                   expert_alignment=align, capacity=cap, backend=be, num_sms=sms,
                   net_transport=net)
        f, ins = per_rank_jit(lambda a, b, c, cfg=cfg: jax_ep.dispatch(a, b, c, cfg),
                              mesh, ("ep",), x, idx, w)
        outs[be] = jax.tree_util.tree_map(local, f(*ins))
    a, b = outs["native"], outs["reference"]
    used = int(b.group_sizes.sum()) if layout == "expert_major" else int(b.num_valid.sum())
    cut = lambda p, u: u[:used] if jax.tree_util.keystr(p) in (".x", ".x_scales") else u
    fa = jax.tree_util.tree_leaves_with_path(a)
    fb = jax.tree_util.tree_leaves_with_path(b)
    bad = [jax.tree_util.keystr(p) for (p, u), (_, v) in zip(fa, fb)
           if u.shape != v.shape or not np.array_equal(bits(cut(p, u)), bits(cut(p, v)))]
    untouched = bool((bits(a.x[used:]).view(np.uint8) == 0xFF).all())
    checks.report(name, not bad and untouched, f"mismatch in {bad}" if bad else
                  f"rows={a.x.shape[0]} used={used} dropped={int(a.num_dropped.sum())} "
                  f"tail_untouched={untouched}")


def _dispatch_worker(rank, n, net="auto"):
    checks, rng, mesh = _start(n)
    for case in DISPATCH_CASES:
        with checks.guard(case[0]):
            _dispatch_case(checks, rng, mesh, n, case, net)
    return _finish(checks)


FP8_CASES = [  # name, T, H, K, E, layout, x dtype (None: fp8 + scales given)
    ("ifp8_cast_bf16_em_T128_H7168_K8_E256", 128, 7168, 8, 256, "expert_major", "bfloat16"),
    ("ifp8_cast_bf16_rm_T1024_H7168_K8_E256", 1024, 7168, 8, 256, "rank_major", "bfloat16"),
    ("ifp8_cast_f32_em_T7_H256_K2_E8", 7, 256, 2, 8, "expert_major", "float32"),
    ("ifp8_given_em_T128_H7168_K8_E256", 128, 7168, 8, 256, "expert_major", None),
    ("ifp8_given_rm_T64_H2048_K4_E16", 64, 2048, 4, 16, "rank_major", None),
]


def _fp8_case(checks, rng, mesh, R, case, net):
    import jax.numpy as jnp

    from ep_testing import random_routing
    from jax_ep.internode import native
    from jax_ep.intranode import reference

    name, T, H, K, E, layout, xdt = case
    idx = random_routing(rng, R, T, K, E, minus_one=0.1)
    xf = (rng.standard_normal((R, T, H)) * rng.exponential(2.0, (R, T, 1))).astype(np.float32)
    xf[0, 0, :128] = 0.0  # an all-zero group: amax clamps
    x = xf.astype(jnp.bfloat16) if xdt != "float32" else xf
    cfg = _cfg(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
               fp8_dispatch=True, net_transport=net)
    res = {}
    for be_name in ("native", "reference"):
        def fn(a, b, be_name=be_name):
            h, gs = reference.BACKEND.router.route(b, cfg, R)[:2]
            used = jnp.sum(gs) if gs is not None else jnp.sum(h.row_src >= 0)
            q, s = reference.fp8_cast(a)
            if be_name == "reference":
                return reference.BACKEND.dispatch_rows(q, s, h, cfg) + (used,)
            if xdt is None:
                return native.BACKEND.dispatch_rows(q, s, h, cfg) + (used,)
            return native.BACKEND.dispatch_rows_fp8(a, h, cfg) + (used,)

        f, ins = per_rank_jit(fn, mesh, ("ep",), x, idx)
        q, s, u = [local(o) for o in f(*ins)]
        res[be_name] = [q[:int(u.sum())], s[:int(u.sum())]]
    ok = all(np.array_equal(bits(u), bits(v)) for u, v in zip(res["native"], res["reference"]))
    q1, q2 = bits(res["native"][0]), bits(res["reference"][0])
    s1, s2 = bits(res["native"][1]), bits(res["reference"][1])
    checks.report(name, ok, f"q mismatches {(q1 != q2).sum()} / {q1.size}, scale mismatches "
                            f"{(s1 != s2).sum()} / {s1.size}")


def _fp8_worker(rank, n, net="auto"):
    checks, rng, mesh = _start(n)
    for case in FP8_CASES:
        with checks.guard(case[0]):
            _fp8_case(checks, rng, mesh, n, case, net)
    return _finish(checks)


COMBINE_CASES = [  # name, T, H, K, E, layout, dtype
    ("icombine_em_T128_H2048_K8_E64_bf16", 128, 2048, 8, 64, "expert_major", "bfloat16"),
    ("icombine_rm_T128_H2880_K2_E8_bf16", 128, 2880, 2, 8, "rank_major", "bfloat16"),
    ("icombine_em_T1024_H7168_K8_E256_bf16", 1024, 7168, 8, 256, "expert_major", "bfloat16"),
    ("icombine_em_T7_H2048_K1_E8_f32", 7, 2048, 1, 8, "expert_major", "float32"),
    ("icombine_rm_T64_H1024_K4_E16_f32", 64, 1024, 4, 16, "rank_major", "float32"),
]


def _combine_case(checks, rng, mesh, R, case, net):
    import jax.numpy as jnp

    import jax_ep
    from ep_testing import random_routing

    name, T, H, K, E, layout, dt = case
    idx = random_routing(rng, R, T, K, E, minus_one=0.2)
    w = rng.random((R, T, K)).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(getattr(jnp, dt))
    res = {}
    # "intranode": the same native backend with num_nodes=1 (flat kernels)
    for var, be, nodes in (("internode", "native", _NODES), ("intranode", "native", 1),
                           ("reference", "reference", _NODES)):
        cfg = _cfg(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                   backend=be, num_nodes=nodes, net_transport=net)

        def fn(a, b, c, cfg=cfg):
            d = jax_ep.dispatch(a, b, c, cfg)
            y = (d.x.astype(jnp.float32) * 1.5 + 0.25).astype(d.x.dtype)
            if layout == "rank_major":  # the user weights on the expert side
                y = (y.astype(jnp.float32) * jnp.sum(d.topk_weights, 1, keepdims=True)).astype(
                    y.dtype)
            return jax_ep.combine(y, d, cfg)
        f, ins = per_rank_jit(fn, mesh, ("ep",), x, idx, w)
        res[var] = local(f(*ins))
        if var == "internode":
            reps = [bits(local(f(*ins))) for _ in range(10)]
            stable = all(np.array_equal(reps[0], r) for r in reps)
    a = res["internode"].astype(np.float32)
    b = res["reference"].astype(np.float32)
    err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    tol = 1e-2 if dt == "bfloat16" else 1e-6
    finite = bool(np.isfinite(a).all())
    checks.report(name, finite and err < tol and stable,
                  f"rel_err={err:.2e} stable10={stable} finite={finite}")
    if R != 2:   # G > 1: node partials are summed, then rounded: another order
        return
    # G = 1: each node partial is one rank's partial, already in y's dtype
    same = np.array_equal(bits(res["internode"]), bits(res["intranode"]))
    checks.report(name + "_eq_intranode", same,
                  f"mismatching elements {(bits(res['internode']) != bits(res['intranode'])).sum()}")


def _combine_worker(rank, n, net="auto"):
    checks, rng, mesh = _start(n)
    for case in COMBINE_CASES:
        with checks.guard(case[0]):
            _combine_case(checks, rng, mesh, n, case, net)
    return _finish(checks)


GRAD_CASES = [  # name, T, H, K, E, layout, dtype
    ("igrad_em_T128_H2048_K8_E64", 128, 2048, 8, 64, "expert_major", "bfloat16"),
    ("igrad_rm_T64_H2048_K2_E8", 64, 2048, 2, 8, "rank_major", "bfloat16"),
    ("igrad_em_T16_H256_K2_E8_f32", 16, 256, 2, 8, "expert_major", "float32"),
]


def _grad_case(checks, rng, mesh, R, case, net="auto"):
    import jax
    import jax.numpy as jnp

    import jax_ep
    from ep_testing import random_routing

    name, T, H, K, E, layout, dt = case
    idx = random_routing(rng, R, T, K, E, minus_one=0.1)
    w = rng.random((R, T, K)).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(getattr(jnp, dt))
    res = {}
    for be in ("native", "reference"):
        cfg = _cfg(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                   backend=be, net_transport=net)

        def loss(a, c, b, cfg=cfg):
            d = jax_ep.dispatch(a, b, c, cfg)
            y = (d.x.astype(jnp.float32) * 0.5).astype(d.x.dtype)
            if layout == "rank_major":
                y = (y.astype(jnp.float32) * jnp.sum(d.topk_weights, 1, keepdims=True)).astype(
                    y.dtype)
            o = jax_ep.combine(y, d, cfg)
            return jnp.sum(o.astype(jnp.float32) ** 2)

        def fn(a, b, c, loss=loss):
            return jax.grad(loss, argnums=(0, 1))(a, c, b)
        f, ins = per_rank_jit(fn, mesh, ("ep",), x, idx, w)
        res[be] = [local(o).astype(np.float32) for o in f(*ins)]
    errs = [float(np.linalg.norm(u - v) / max(np.linalg.norm(v), 1e-30))
            for u, v in zip(res["native"], res["reference"])]
    tol = 2e-2 if dt == "bfloat16" else 1e-5
    checks.report(name, all(e < tol for e in errs) and all(np.isfinite(u).all()
                                                           for u in res["native"]),
                  f"rel_err gx={errs[0]:.2e} gw={errs[1]:.2e}")


def _grad_worker(rank, n, net="auto"):
    checks, rng, mesh = _start(n)
    for case in GRAD_CASES:
        with checks.guard(case[0]):
            _grad_case(checks, rng, mesh, n, case, net)
    return _finish(checks)
