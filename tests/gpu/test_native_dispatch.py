"""Native dispatch / combine against the reference backend, on 2 GPUs.

Each test runs one worker below as a 2-process job (harness.run: one GPU per
process, jax.distributed + jax_ep.initialize); the worker returns its named
checks (gpu_helpers.Checks) and the test asserts that every one passed on every
rank. Output buffers are poisoned (JAX_EP_DEBUG_POISON=1: 0xFF bytes, NaN in
every float type) before the kernels run, and every row is compared, padding
included, so a row the kernel forgets to write fails. Dispatch must be
bit-identical; combine bit-identical to the reference too (the kernel sums
in semantics §7's order) and bitwise stable over 20 runs. With ``EpConfig.zero_tail`` off (the default)
the tail past the last expert group is unspecified: there the rows <
sum(group_sizes) are compared (and the tail must still hold the poison: the
kernel never wrote it); with it on, every row.

Inputs are random but the same on every rank (one seed), since each process
builds the global arrays from the full stacked per-rank inputs.
``$JAX_EP_GPU_TEST_TIMEOUT`` (seconds, default 420) bounds each job.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import harness
from gpu_helpers import Checks, assert_checks, bits, local, per_rank_jit

_REASON = harness.skip_reason() or harness.testing_skip_reason()  # output poisoning
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

_TIMEOUT = float(os.environ.get("JAX_EP_GPU_TEST_TIMEOUT", "420"))
_SEED = 1234
# processes sharing this process's GPU (jax_ep.shared_gpu sets it in the job's ranks)
_PER_GPU = int(os.environ.get("JAX_EP_PROCS_PER_GPU", "1"))


def _run(worker: str, expect: int = 1):
    """``expect``: the worker's case count (each case reports at least one check)."""
    results = harness.run(f"test_native_dispatch:{worker}", timeout=_TIMEOUT,
                          env={"JAX_EP_DEBUG_POISON": "1"})
    assert_checks(results, worker, expect)


def test_native_dispatch_bitexact():
    _run("_dispatch_worker", len(DISPATCH_CASES))


def test_native_dispatch_fp8():
    _run("_fp8_worker", 2 * len(FP8_CASES))


def test_native_combine():
    _run("_combine_worker", len(COMBINE_CASES))


def test_native_grad():
    _run("_grad_worker", len(GRAD_CASES))


def test_native_submesh():
    _run("_submesh_worker")


def test_native_overflow():
    """capacity < rows received: dispatch still bit-identical, the drops counted."""
    _run("_overflow_worker", 2 * len(OVERFLOW_CASES))


def test_native_zero_tail():
    """zero_tail on: every row of the dispatch output is the reference's, tail included."""
    _run("_zero_tail_worker", len(DISPATCH_CASES) + len(OVERFLOW_CASES))


def test_native_combine_backward():
    """Backend.combine_backward, fused in the dispatch kernel: dy bits, dw within f32 order."""
    _run("_combine_backward_worker", len(CBWD_CASES))


def test_native_chunking():
    """Every chunk size (tokens per flag, row slices per warp) gives the same bits."""
    _run("_chunking_worker", 4)


def test_native_ring_wrap_large_t():
    """T 16384 and 65536 per rank: every peer's staging ring wraps many times
    per call on the default buffer; dispatch and fp8 rows bit-identical."""
    _run("_ring_wrap_worker", 2)


# ----------------------------------------------------------------------------
# worker side (run in the job's processes)
# ----------------------------------------------------------------------------
def _start(n):
    """-> (checks, rng seeded alike on every rank, 1-D "ep" mesh with Auto axes)."""
    from ep_testing import make_mesh

    return Checks(), np.random.default_rng(_SEED), make_mesh((n,), ("ep",))


def _finish(checks):
    import jax_ep

    jax_ep.finalize()
    return checks.results


# ---- dispatch: bit-identical, all fields --------------------------------------
# name, T, H, K, E, layout, align, dtype, capacity, skew, minus_one
DISPATCH_CASES = [
    ("dispatch_em_T128_H2048_K8_E64", 128, 2048, 8, 64, "expert_major", 1, "bfloat16", None, False, 0.2),
    ("dispatch_rm_T7_H2880_K2_E8_skew", 7, 2880, 2, 8, "rank_major", 1, "bfloat16", None, True, 0.2),
    ("dispatch_em_a128_T4096_H7168_K8_E256", 4096, 7168, 8, 256, "expert_major", 128, "bfloat16", None, False, 0.0),
    ("dispatch_rm_T4096_H7168_K8_E256", 4096, 7168, 8, 256, "rank_major", 1, "bfloat16", None, False, 0.1),
    ("dispatch_em_T1_H2048_K1_E8_f32", 1, 2048, 1, 8, "expert_major", 1, "float32", None, False, 0.0),
    ("dispatch_em_a128_T128_H2880_K2_E8_skew", 128, 2880, 2, 8, "expert_major", 128, "bfloat16", None, True, 0.3),
]
OVERFLOW_CASES = [
    ("overflow_em_T128_H2048_K8_E64_cap100", 128, 2048, 8, 64, "expert_major", 1, "bfloat16", 100, True, 0.0),
    ("overflow_rm_T128_H2048_K8_E64_cap50", 128, 2048, 8, 64, "rank_major", 1, "bfloat16", 50, False, 0.0),
]


def _dispatch_case(checks, rng, mesh, R, case, variant):
    """One routing through ``variant`` ("native": zero_tail off, or
    "native_zero_tail") and the reference; every field compared bit for bit.
    Without zero_tail, x / x_scales rows past the groups (rank_major: past the
    valid rows) are left out and must still hold the poison. -> native output."""
    import jax
    import jax.numpy as jnp

    import jax_ep
    from ep_testing import random_routing
    from jax_ep.config import EpConfig

    name, T, H, K, E, layout, align, dt, cap, skew, m1 = case
    idx = random_routing(rng, R, T, K, E, minus_one=m1, skew=skew)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    x = x.astype(jnp.bfloat16) if dt == "bfloat16" else x
    w = rng.random((R, T, K)).astype(np.float32)
    outs = {}
    for var in (variant, "reference"):
        cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                       layout=layout, expert_alignment=align, capacity=cap,
                       backend=var.split("_")[0],
                       **({"zero_tail": True} if var == "native_zero_tail" else {}))
        f, ins = per_rank_jit(lambda a, b, c, cfg=cfg: jax_ep.dispatch(a, b, c, cfg),
                              mesh, ("ep",), x, idx, w)
        outs[var] = jax.tree_util.tree_map(local, f(*ins))
    a, b = outs[variant], outs["reference"]
    used = int(b.group_sizes.sum()) if layout == "expert_major" else int(b.num_valid.sum())
    cut = lambda p, u: (u[:used] if variant == "native" and
                        jax.tree_util.keystr(p) in (".x", ".x_scales") else u)
    fa = jax.tree_util.tree_leaves_with_path(a)
    fb = jax.tree_util.tree_leaves_with_path(b)
    bad = [jax.tree_util.keystr(p) for (p, u), (_, v) in zip(fa, fb)
           if u.shape != v.shape or not np.array_equal(bits(cut(p, u)), bits(cut(p, v)))]
    untouched = variant != "native" or bool((bits(a.x[used:]).view(np.uint8) == 0xFF).all())
    tag = name if variant == "native" else "zerotail_" + name.removeprefix("dispatch_")
    checks.report(tag, not bad and untouched, f"mismatch in {bad}" if bad else
                  f"rows={a.x.shape[0]} used={used} valid={int(a.num_valid.sum())} "
                  f"dropped={int(a.num_dropped.sum())} tail_untouched={untouched}")
    if T <= _MODEL_MAX_T:
        _check_against_model(checks, tag, mesh, a, x, idx, w, E, layout, align, cap)
    return a


# The NumPy model (tests/numpy_model.py, loop by loop) runs for small T only.
_MODEL_MAX_T = 128


def _check_against_model(checks, tag, mesh, a, x, idx, w, E, layout, align, cap):
    """This rank's routing metadata, weights and exact drop counts against the
    NumPy model of semantics §2-5, which shares no code with either backend
    (native == reference alone is circular there: one router serves both)."""
    import jax

    import numpy_model

    rank = list(mesh.devices.flat).index(jax.local_devices()[0])   # this shard's EP rank
    m = numpy_model.dispatch(np.asarray(x, np.float32), idx, w, E, layout, align, cap)
    fields = (["group_sizes", "weights"] if layout == "expert_major"
              else ["topk_idx", "topk_weights"]) + ["num_valid", "num_dropped"]
    bad = []
    for f in fields:
        got, want = np.asarray(getattr(a, f)), np.asarray(m[f][rank])
        if f in ("weights", "topk_weights"):
            same = got.shape == want.shape and np.array_equal(bits(got.astype(np.float32)),
                                                            bits(want.astype(np.float32)))
        else:
            same = np.array_equal(got.reshape(-1).astype(np.int64), want.reshape(-1).astype(np.int64))
        if not same:
            bad.append(f)
    checks.report(tag + "_model", not bad, f"differs from the NumPy model in {bad}" if bad else
                  f"dropped={int(np.asarray(m['num_dropped'][rank]))}")


def _dispatch_worker(rank, n):
    checks, rng, mesh = _start(n)
    for case in DISPATCH_CASES:
        with checks.guard(case[0]):
            _dispatch_case(checks, rng, mesh, n, case, "native")
    return _finish(checks)


def _overflow_worker(rank, n):
    checks, rng, mesh = _start(n)
    for case in OVERFLOW_CASES:
        with checks.guard(case[0]):
            a = _dispatch_case(checks, rng, mesh, n, case, "native")
            checks.report(case[0] + "_counted", int(a.num_dropped.sum()) > 0,
                          f"num_dropped={int(a.num_dropped.sum())}")
    return _finish(checks)


def _zero_tail_worker(rank, n):
    checks, rng, mesh = _start(n)
    for case in DISPATCH_CASES + OVERFLOW_CASES:
        with checks.guard("zerotail_" + case[0].removeprefix("dispatch_")):
            _dispatch_case(checks, rng, mesh, n, case, "native_zero_tail")
    return _finish(checks)


# ---- fp8: given fp8 + scales, and cast inside dispatch -------------------------
FP8_CASES = [  # name, T, H, K, E, layout, x dtype (None: fp8 + scales given)
    ("fp8_given_em_T128_H7168_K8_E256", 128, 7168, 8, 256, "expert_major", None),
    ("fp8_cast_bf16_rm_T4096_H7168_K8_E256", 4096, 7168, 8, 256, "rank_major", "bfloat16"),
    ("fp8_cast_bf16_em_T128_H2048_K8_E64", 128, 2048, 8, 64, "expert_major", "bfloat16"),
    ("fp8_cast_f32_em_T7_H256_K2_E8", 7, 256, 2, 8, "expert_major", "float32"),
]


def _fp8_case(checks, rng, mesh, R, case, fmt):
    """``fmt``: EpConfig.fp8_scale_format, "f32" or "ue8m0" (power-of-two scales)."""
    import jax.numpy as jnp

    from ep_testing import random_routing
    from jax_ep.intranode import native, reference
    from jax_ep.config import EpConfig

    name, T, H, K, E, layout, xdt = case
    idx = random_routing(rng, R, T, K, E, minus_one=0.1)
    xf = (rng.standard_normal((R, T, H)) * rng.exponential(2.0, (R, T, 1))).astype(np.float32)
    xf[0, 0, :128] = 0.0  # an all-zero group: amax clamps to 1e-4
    x = xf.astype(jnp.bfloat16) if xdt != "float32" else xf
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                   fp8_dispatch=True, fp8_scale_format=fmt, backend="native")
    res = {}
    for be_name in ("native", "reference"):
        def fn(a, b, be_name=be_name):
            h, gs = reference.BACKEND.router.route(b, cfg, R)[:2]
            # rows < used are compared: the tail is unspecified without zero_tail
            used = jnp.sum(gs) if gs is not None else jnp.sum(h.row_src >= 0)
            if be_name == "reference":
                q, s = reference.fp8_cast(a, scale_format=fmt)
                return reference.BACKEND.dispatch_rows(q, s, h, cfg) + (used,)
            if xdt is None:  # fp8 + scales given
                q, s = reference.fp8_cast(a, scale_format=fmt)
                return native.BACKEND.dispatch_rows(q, s, h, cfg) + (used,)
            return native.BACKEND.dispatch_rows_fp8(a, h, cfg) + (used,)

        f, ins = per_rank_jit(fn, mesh, ("ep",), x, idx)
        q, s, u = [local(o) for o in f(*ins)]
        res[be_name] = [q[:int(u.sum())], s[:int(u.sum())]]
    ok = all(np.array_equal(bits(u), bits(v)) for u, v in zip(res["native"], res["reference"]))
    detail = ""
    if not ok:
        q1, q2 = bits(res["native"][0]), bits(res["reference"][0])
        s1, s2 = res["native"][1], res["reference"][1]
        detail = (f"q mismatches {(q1 != q2).sum()} / {q1.size}, "
                  f"scale mismatches {(bits(s1) != bits(s2)).sum()} / {s1.size}")
    checks.report(f"{name}_{fmt}", ok, detail)


def _fp8_worker(rank, n):
    checks, rng, mesh = _start(n)
    for case in FP8_CASES:
        for fmt in ("f32", "ue8m0"):
            with checks.guard(f"{case[0]}_{fmt}"):
                _fp8_case(checks, rng, mesh, n, case, fmt)
    return _finish(checks)


# ---- combine: the reference's bits, bitwise stable over 20 runs -----------------
COMBINE_CASES = [  # name, T, H, K, E, layout, dtype, skew (repeated ids too)
    ("combine_em_T128_H2048_K8_E64_bf16_skew", 128, 2048, 8, 64, "expert_major", "bfloat16", True),
    ("combine_rm_T128_H2880_K2_E8_bf16", 128, 2880, 2, 8, "rank_major", "bfloat16", False),
    # V3-train rows; T 1024 with more than 4 processes on a GPU (the reference's
    # f32 buffers of 8 x 4096 x 8 rows do not fit a share of one GPU)
    ("combine_em_T4096_H7168_K8_E256_bf16", 4096 if _PER_GPU <= 4 else 1024, 7168, 8, 256,
     "expert_major", "bfloat16", False),
    ("combine_em_T7_H2048_K1_E8_f32", 7, 2048, 1, 8, "expert_major", "float32", False),
    ("combine_em_T96_H1024_K4_E16_f32_skew", 96, 1024, 4, 16, "expert_major", "float32", True),
]


def _combine_case(checks, rng, mesh, R, case):
    import jax.numpy as jnp

    import jax_ep
    from ep_testing import random_routing
    from jax_ep.config import EpConfig

    name, T, H, K, E, layout, dt, skew = case
    idx = random_routing(rng, R, T, K, E, minus_one=0.2, skew=skew, repeat=0.1 if skew else 0.0)
    w = rng.random((R, T, K)).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(getattr(jnp, dt))
    res = {}
    for be in ("native", "reference"):
        cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                       layout=layout, backend=be)

        def fn(a, b, c, cfg=cfg):
            d = jax_ep.dispatch(a, b, c, cfg)
            y = (d.x.astype(jnp.float32) * 1.5 + 0.25).astype(d.x.dtype)
            return jax_ep.combine(y, d, cfg)
        f, ins = per_rank_jit(fn, mesh, ("ep",), x, idx, w)
        res[be] = local(f(*ins))
        if be == "native":
            reps = [bits(local(f(*ins))) for _ in range(20)]
            stable = all(np.array_equal(reps[0], r) for r in reps)
    a = res["native"].astype(np.float32)
    b = res["reference"].astype(np.float32)
    same = bool(np.array_equal(bits(res["native"]), bits(res["reference"])))
    finite = bool(np.isfinite(a).all())
    checks.report(name, finite and same and stable,
                  f"bitwise_eq_ref={same} stable20={stable} finite={finite} "
                  f"max_abs_diff={float(np.max(np.abs(a - b))):.2e}")


def _combine_worker(rank, n):
    checks, rng, mesh = _start(n)
    for case in COMBINE_CASES:
        with checks.guard(case[0]):
            _combine_case(checks, rng, mesh, n, case)
    return _finish(checks)


# ---- gradients through dispatch + combine --------------------------------------
GRAD_CASES = [  # name, T, H, K, E, layout
    ("grad_em_T128_H2048_K8_E64", 128, 2048, 8, 64, "expert_major"),
    ("grad_rm_T64_H2048_K2_E8", 64, 2048, 2, 8, "rank_major"),
]


def _grad_case(checks, rng, mesh, R, case):
    import jax
    import jax.numpy as jnp

    import jax_ep
    from ep_testing import random_routing
    from jax_ep.config import EpConfig

    name, T, H, K, E, layout = case
    idx = random_routing(rng, R, T, K, E, minus_one=0.1)
    w = rng.random((R, T, K)).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(jnp.bfloat16)
    res = {}
    for be in ("native", "reference"):
        cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                       layout=layout, backend=be)

        def loss(a, c, b, cfg=cfg):
            d = jax_ep.dispatch(a, b, c, cfg)
            y = (d.x.astype(jnp.float32) * 0.5).astype(d.x.dtype)
            if layout == "rank_major":
                y = (y.astype(jnp.float32) * jnp.sum(d.topk_weights, 1, keepdims=True)).astype(y.dtype)
            o = jax_ep.combine(y, d, cfg)
            return jnp.sum(o.astype(jnp.float32) ** 2)

        def fn(a, b, c, loss=loss):
            gx, gw = jax.grad(loss, argnums=(0, 1))(a, c, b)
            return gx, gw
        f, ins = per_rank_jit(fn, mesh, ("ep",), x, idx, w)
        res[be] = [local(o).astype(np.float32) for o in f(*ins)]
    errs = [float(np.linalg.norm(u - v) / max(np.linalg.norm(v), 1e-30))
            for u, v in zip(res["native"], res["reference"])]
    checks.report(name, all(e < 2e-2 for e in errs) and all(np.isfinite(u).all() for u in res["native"]),
                  f"rel_err gx={errs[0]:.2e} gw={errs[1]:.2e}")


def _grad_worker(rank, n):
    checks, rng, mesh = _start(n)
    for case in GRAD_CASES:
        with checks.guard(case[0]):
            _grad_case(checks, rng, mesh, n, case)
    return _finish(checks)


# ---- combine backward (Backend.combine_backward; native: fused into the dispatch
# kernel): dy = cast(w * g) bit-identical (rows < used; all with zero_tail, and
# the tail left as poison without), dw = <g, y> within f32 reduction order
# (|err| <= 1e-4 * sum_h |g*y|), 0 on every row without a source, bitwise stable
# over 5 runs; rank_major: a dispatch of g, bit-identical ------------------------
CBWD_CASES = [  # name, T, H, K, E, layout, align, dtype, zero_tail
    ("cbwd_em_T1024_H7168_K8_E256_bf16", 1024 if _PER_GPU <= 4 else 512, 7168, 8, 256,
     "expert_major", 1, "bfloat16", False),
    ("cbwd_em_a128_T512_H7168_K8_E256_bf16_zt", 512, 7168, 8, 256, "expert_major", 128,
     "bfloat16", True),
    ("cbwd_em_a16_T128_H2880_K2_E8_bf16", 128, 2880, 2, 8, "expert_major", 16, "bfloat16", False),
    ("cbwd_em_T7_H2048_K1_E8_f32", 7, 2048, 1, 8, "expert_major", 1, "float32", False),
    ("cbwd_rm_T128_H2048_K8_E64_bf16", 128, 2048, 8, 64, "rank_major", 1, "bfloat16", False),
]


def _combine_backward_case(checks, rng, mesh, R, case):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from ep_testing import random_routing
    from gpu_helpers import from_process_local
    from jax_ep.intranode import native, reference
    from jax_ep.config import EpConfig

    name, T, H, K, E, layout, align, dt, zt = case
    idx = random_routing(rng, R, T, K, E, minus_one=0.2, skew=True)
    xdt = getattr(jnp, dt)
    g = rng.standard_normal((R, T, H)).astype(np.float32).astype(xdt)
    cfgs = {be: EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                         expert_alignment=align, backend=be, zero_tail=zt)
            for be in ("native", "reference")}
    C = cfgs["native"].capacity_for(R, T)
    # this rank's y [C, H] drawn here alone: stacked for every rank on every
    # process it is O(R^2) host memory (30 GB per process at R 8, T 1024)
    y_rng = np.random.default_rng((_SEED, R, T, jax.process_index()))
    y = from_process_local(mesh, P("ep"), y_rng.standard_normal((C, H), dtype=np.float32).astype(xdt))
    wr = rng.random((R, C)).astype(np.float32)
    res = {}
    for be, bk in (("native", native.BACKEND), ("reference", reference.BACKEND)):
        def fn(gg, b, yy, ww, cfg=cfgs[be], bk=bk):
            h, gs = reference.BACKEND.router.route(b, cfg, R)[:2]
            used = jnp.sum(gs) if gs is not None else jnp.sum(h.row_src >= 0)
            dy, dw = bk.combine_backward(gg, yy, ww if layout == "expert_major" else None, h, cfg)
            g_rows = reference.BACKEND.dispatch_rows(gg, None, h, cfg)[0].astype(jnp.float32)
            mag = jnp.sum(jnp.abs(g_rows * yy.astype(jnp.float32)), axis=1)
            dw = jnp.zeros((C,), jnp.float32) if dw is None else dw
            return dy, dw, mag, h.row_src, used
        f, ins = per_rank_jit(fn, mesh, ("ep",), g, idx, y, wr)
        res[be] = [local(o) for o in f(*ins)]
        if be == "native":
            reps = [[bits(local(o)) for o in f(*ins)[:2]] for _ in range(5)]
            stable = all(np.array_equal(u, v) for r in reps for u, v in zip(r, reps[0]))
    (dy, dw, _, row_src, used), (e_dy, e_dw, mag, _, _) = res["native"], res["reference"]
    u = dy.shape[0] if zt else int(used.sum())
    dy_same = bool(np.array_equal(bits(dy[:u]), bits(e_dy[:u])))
    untouched = zt or bool((bits(dy[u:]).view(np.uint8) == 0xFF).all())
    v = row_src >= 0
    dw_ok = bool(np.all(np.abs(dw[v] - e_dw[v]) <= 1e-4 * mag[v] + 1e-30))
    dw_zero = bool(np.all(bits(dw[~v]) == 0))
    err = float(np.max(np.abs(dw[v] - e_dw[v]) / np.maximum(mag[v], 1e-30), initial=0.0))
    checks.report(name, dy_same and untouched and dw_ok and dw_zero and stable,
                  f"dy_bitexact={dy_same} tail_untouched={untouched} dw_ok={dw_ok} "
                  f"dw_zero_unsourced={dw_zero} dw_max_err/sum|g*y|={err:.1e} stable5={stable} "
                  f"dw_bitwise_eq_ref={np.array_equal(bits(dw), bits(e_dw))} used={u}")


def _combine_backward_worker(rank, n):
    checks, rng, mesh = _start(n)
    for case in CBWD_CASES:
        with checks.guard(case[0]):
            _combine_backward_case(checks, rng, mesh, n, case)
    return _finish(checks)


# ---- chunking (EpConfig.tuning): 1, 3 (uneven slices), 8 tokens per flag --------
# The default picks 2 at T=4096; every chunking must give the same bits.
def _chunk_outputs(mesh, be, chunk, E, x, idx, w):
    """dispatch x, combine, fp8 rows and scales (rank_major, zero_tail: all rows), as bits."""
    import jax.numpy as jnp

    import jax_ep
    from jax_ep.intranode import native, reference
    from jax_ep.config import EpConfig, KernelTuning

    T, H, K = x.shape[1], x.shape[2], idx.shape[2]
    ck = 0 if chunk == "default" else int(chunk)
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                   layout="rank_major", backend=be, zero_tail=True,  # all rows compared
                   tuning=KernelTuning(dispatch_chunk=ck, combine_chunk=ck))

    def fn(a, b, c):
        d = jax_ep.dispatch(a, b, c, cfg)
        y = (d.x.astype(jnp.float32) * 1.5 + 0.25).astype(d.x.dtype)
        h = d.handle
        bk = native.BACKEND if be == "native" else reference.BACKEND
        q = (bk.dispatch_rows_fp8(a, h, cfg) if be == "native"
             else bk.dispatch_rows(*reference.fp8_cast(a), h, cfg))
        return d.x, jax_ep.combine(y, d, cfg), q[0], q[1]
    f, ins = per_rank_jit(fn, mesh, ("ep",), x, idx, w)
    return [bits(local(o)) for o in f(*ins)]


def _chunking_worker(rank, n):
    import jax.numpy as jnp

    from ep_testing import random_routing

    checks, rng, mesh = _start(n)
    name = "chunk_rm_T4096_H7168"
    with checks.guard(name):
        R, T, H, K, E = n, 4096, 7168, 8, 256
        idx = random_routing(rng, R, T, K, E, minus_one=0.1, skew=True)
        w = rng.random((R, T, K)).astype(np.float32)
        x = rng.standard_normal((R, T, H)).astype(np.float32).astype(jnp.bfloat16)
        runs = [("reference", "default"), ("native", "default"), ("native", "1"), ("native", "3"),
                ("native", "8")]
        outs = {(be, chunk): _chunk_outputs(mesh, be, chunk, E, x, idx, w) for be, chunk in runs}
        ref = outs[("reference", "default")]
        for chunk in ("default", "1", "3", "8"):
            got = outs[("native", chunk)]
            same = [bool(np.array_equal(u, v)) for u, v in zip(got, ref)]
            same_default = [bool(np.array_equal(u, v)) for u, v in zip(got, outs[("native", "default")])]
            checks.report(f"chunk_{chunk}_rm_T4096_H7168",
                          all(same) and all(same_default),
                          f"dispatch/combine/fp8q/fp8s == reference: {same}; "
                          f"== native default: {same_default}")
    return _finish(checks)


# ---- large T: the rings of the default 1 GiB buffer wrap ----------------------
def _ring_wrap_worker(rank, n):
    import jax.numpy as jnp

    from ep_testing import random_routing

    checks, rng, mesh = _start(n)
    for T in (16384, 65536):
        name = f"ring_wrap_rm_T{T}_H1024_K4_E32_skew"
        with checks.guard(name):
            R, H, K, E = n, 1024, 4, 32
            idx = random_routing(rng, R, T, K, E, minus_one=0.1, skew=True)
            w = rng.random((R, T, K)).astype(np.float32)
            x = rng.standard_normal((R, T, H), dtype=np.float32).astype(jnp.bfloat16)
            got = _chunk_outputs(mesh, "native", "default", E, x, idx, w)
            ref = _chunk_outputs(mesh, "reference", "default", E, x, idx, w)
            same = [bool(np.array_equal(u, v)) for u, v in zip(got, ref)]
            finite = bool(np.isfinite(got[1].view(jnp.bfloat16).astype(np.float32)).all())
            checks.report(name, all(same) and finite,
                          f"dispatch/combine/fp8q/fp8s == reference: {same}")
    return _finish(checks)


# ---- sub-axis mesh ('data', 'ep') with data = 1 ----------------------------------
def _submesh_worker(rank, n):
    import jax.numpy as jnp

    import jax_ep
    from ep_testing import make_mesh, random_routing
    from jax_ep.config import EpConfig

    checks, rng, _ = _start(n)
    with checks.guard("submesh_data1_ep2"):
        R = n
        mesh2 = make_mesh((1, R), ("data", "ep"))
        T, H, K, E = 128, 2048, 8, 64
        idx = random_routing(rng, R, T, K, E, minus_one=0.2)
        w = rng.random((R, T, K)).astype(np.float32)
        x = rng.standard_normal((R, T, H)).astype(np.float32).astype(jnp.bfloat16)
        res = {}
        for be in ("native", "reference"):
            cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                           axis_name="ep", backend=be, zero_tail=True)  # all rows compared

            def fn(a, b, c, cfg=cfg):
                d = jax_ep.dispatch(a, b, c, cfg)
                return d.x, jax_ep.combine(d.x, d, cfg)
            f, ins = per_rank_jit(fn, mesh2, ("data", "ep"), x, idx, w)
            res[be] = [local(o) for o in f(*ins)]
        ok_d = np.array_equal(bits(res["native"][0]), bits(res["reference"][0]))
        ok_c = np.array_equal(bits(res["native"][1]), bits(res["reference"][1]))
        checks.report("submesh_data1_ep2", ok_d and ok_c,
                      f"dispatch_bitexact={ok_d} combine_bitexact={ok_c}")
    return _finish(checks)
