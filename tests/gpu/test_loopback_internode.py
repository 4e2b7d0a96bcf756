"""The internode (hierarchical) kernels on ONE GPU, on emulated nodes.

``jax_ep._C.loopback_internode_dispatch`` / ``_combine`` (cc/testing/
loopback_internode.cu) run R = 8 ranks' kernels concurrently on one device,
grouped into N emulated nodes of G = R / N consecutive ranks (2 x 4 and 4 x 2;
1 x 8 and 8 x 1 as edge cases): the network leg and the NVLink leg are both P2P
stores into the other ranks' stand-in buffers (docs/internode.md). Handles and
expected rows come from the reference backend on CPU, as in test_loopback.py,
whose ``Loopback`` helper this reuses (same pointer / int layouts, plus
``nodes``). Outputs are poisoned with 0xFF first; every call runs twice (both
call parities, epochs carried over), and a case's calls share one buffer.

- dispatch (copy, fp8 cast with IEEE / UE8M0 scales, fp8 given): bit-identical
  to the reference, both layouts, skewed and group-limited routing, -1 slots,
  a capacity that drops pairs, chunk sizes 1..4;
- combine: the reference within f32 / bf16 rounding (rel. Frobenius error <
  1e-2 bf16, 1e-6 f32: the node-grouped sum, docs/internode.md), bit-identical
  to tests/internode_model.py's ``combine_hier`` (the kernels' exact formula),
  the same bits for every chunking; at 1 x 8 and 8 x 1 also the reference's
  flat formula bit for bit.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python tests/gpu/test_loopback_internode.py --bench
prints intranode loopback vs internode (2 x 4, 4 x 2) at V3 shapes.
"""
from __future__ import annotations

import copy
import sys

import numpy as np
import pytest

import test_loopback as tl
from gpu_helpers import Checks, bits

R = 8


def _run(worker):
    tl.run_worker("test_loopback_internode", worker)


@pytest.mark.gpu
def test_internode_dispatch_bitexact():
    _run("_dispatch_worker")


@pytest.mark.gpu
def test_internode_fp8():
    _run("_fp8_worker")


@pytest.mark.gpu
def test_internode_combine():
    _run("_combine_worker")


@pytest.mark.gpu
def test_internode_fixed_t():
    """The runtime's fixed-T region (layout_T, as the JAX path lays it out):
    calls of different T, dtypes and layouts on one buffer, epochs carried."""
    _run("_fixed_t_worker")


@pytest.mark.gpu
def test_internode_windows():
    """Calls of more tokens than the region's layout T run as windows of it
    (one kernel each, its own epoch and parity): T 300 on a region laid out for
    96 (windows 96, 96, 96, 12), group padding rows zeroed once, dispatch (copy,
    fp8 cast and given scales) bit-identical, combine as its model; then calls
    inside one window on the same buffer."""
    _run("_window_worker")


@pytest.mark.gpu
def test_internode_put():
    """The network leg by NVSHMEM puts (net_transport "put": staged rows and
    scales, the chunk's mask words, fence + signal_op, the receive-side test,
    the quiet at the end): this process the only PE, every rank's buffer in its
    heap (cc/testing/loopback_put.h). Dispatch, fp8 and combine cases at
    2 x 4, 4 x 2 and 8 x 1, checked as the P2P ones; then three of
    test_internode_windows' calls."""
    _run("_put_worker")


# ---------------------------------------------------------------------------- harness
class _InterC:
    """jax_ep._C with loopback_dispatch / loopback_combine bound to the
    internode entry points for N nodes (ints gain `nodes`)."""

    def __init__(self, C, nodes, put, layout_T):
        self._C, self.tail = C, [nodes, int(put), layout_T]

    def __getattr__(self, name):
        return getattr(self._C, name)

    def loopback_dispatch(self, ptrs, ints, sym_bytes, num_ranks, iters):
        return self._C.loopback_internode_dispatch(ptrs, list(ints) + self.tail, sym_bytes,
                                                   num_ranks, iters)

    def loopback_combine(self, ptrs, ints, sym_bytes, num_ranks, iters):
        return self._C.loopback_internode_combine(ptrs, list(ints) + self.tail, sym_bytes,
                                                  num_ranks, iters)


def inter(lb, N, layout_T=0):
    """A view of Loopback ``lb`` whose dispatch / combine run the internode
    kernels (the network leg by NVSHMEM puts when ``lb.put``; layout_T > 0:
    the runtime's fixed-T region layout)."""
    c = copy.copy(lb)
    c.C = _InterC(lb.C, N, lb.put, layout_T)
    return c


def inter_sym(lb, N, T, H):
    """A buffer for every op of a case (rows up to f32, fp8 scales); fresh
    (zeroed) buffers: the region's flags are laid out for one T."""
    lb._sym.pop(R, None)
    return lb.C.internode_buffer_bytes(N, R // N, T, 4 * H, (H // 128) * 4, 4 * H)


def _routing(rng, kind, T, K, E, N):
    import internode_model as im
    from ep_testing import random_routing

    if kind == "skew":
        return random_routing(rng, R, T, K, E, minus_one=0.2, skew=True)
    if kind == "uniform":
        return random_routing(rng, R, T, K, E, minus_one=0.1)
    assert kind.startswith("group")  # group<M>: experts on at most M nodes per token
    return im.group_limited_routing(rng, R, T, K, E, N, int(kind[5:]), minus_one=0.1)


def _start():
    return tl.Loopback(), Checks(), np.random.default_rng(11)


# ---- dispatch: bit-identical to the reference ---------------------------------
DISPATCH_CASES = [
    # name, N, T, H, K, E, layout, align, dtype, capacity, routing, chunks
    ("em_2x4_skew", 2, 256, 2048, 8, 64, "expert_major", 1, "bfloat16", None, "skew", (0, 1, 3)),
    ("em_a32_4x2_skew", 4, 256, 2048, 8, 64, "expert_major", 32, "bfloat16", None, "skew", (0,)),
    ("rm_2x4_H7168_uniform", 2, 512, 7168, 8, 256, "rank_major", 1, "bfloat16", None,
     "uniform", (0, 2)),
    ("rm_4x2_group2", 4, 256, 2048, 8, 64, "rank_major", 1, "bfloat16", None, "group2", (0,)),
    ("em_2x4_group1_f32", 2, 128, 1024, 4, 32, "expert_major", 1, "float32", None, "group1",
     (0,)),
    ("em_4x2_group1_cap300", 4, 128, 2048, 8, 64, "expert_major", 1, "bfloat16", 300, "group1",
     (0, 4)),
    ("em_1x8_skew", 1, 128, 2048, 8, 64, "expert_major", 1, "bfloat16", None, "skew", (0,)),
    ("rm_8x1_skew", 8, 128, 2048, 8, 64, "rank_major", 1, "bfloat16", None, "skew", (0,)),
]


def _dispatch_case(lb, checks, rng, case, region=None):
    import jax.numpy as jnp

    from jax_ep.config import EpConfig

    name, N, T, H, K, E, layout, align, dt, cap, kind, chunks = case
    idx = _routing(rng, kind, T, K, E, N)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    x = x.astype(jnp.bfloat16) if dt == "bfloat16" else x
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                   expert_alignment=align, capacity=cap, backend="reference")
    hd = lb.handles_and_ref(R, cfg, x, idx, "copy")
    il, sym = region(N) if region else (inter(lb, N), inter_sym(lb, N, T, H))
    for chunk in chunks:
        err, got, _, _ = il.dispatch(R, x, None, hd, "copy", layout == "rank_major", H, chunk,
                                     iters=2, align=align, sym_bytes=sym)
        same = [bool(np.array_equal(bits(g), bits(e))) for g, e in zip(got, hd[4])]
        checks.report(f"dispatch_{name}_chunk{chunk}", not err and all(same), err=err, same=same)


def _dispatch_worker(rank, n):
    lb, checks, rng = _start()
    for case in DISPATCH_CASES:
        with checks.guard(case[0]):
            _dispatch_case(lb, checks, rng, case)
    return checks.results


# ---- fp8: cast once at the source (the intranode cast's bits), or given ------
FP8_CASES = [  # name, N, T, H, K, E, layout, mode, x dtype, scale format, routing, chunks
    ("fp8_cast_bf16_rm_2x4", 2, 256, 2048, 8, 64, "rank_major", "cast", "bfloat16", "f32",
     "skew", (0, 1)),
    ("fp8_cast_bf16_em_4x2_group2", 4, 256, 7168, 8, 256, "expert_major", "cast", "bfloat16",
     "f32", "group2", (0,)),
    ("fp8_ue8m0_f32_em_2x4", 2, 64, 2048, 4, 16, "expert_major", "cast", "float32", "ue8m0",
     "skew", (0,)),
    ("fp8_given_rm_4x2", 4, 128, 2048, 8, 64, "rank_major", "given", None, "f32", "uniform",
     (0,)),
]


def _fp8_case(lb, checks, rng, case, region=None):
    import jax
    import jax.numpy as jnp

    from jax_ep.intranode import reference
    from jax_ep.config import EpConfig

    name, N, T, H, K, E, layout, mode, xdt, fmt, kind, chunks = case
    idx = _routing(rng, kind, T, K, E, N)
    xf = (rng.standard_normal((R, T, H)) * rng.exponential(2.0, (R, T, 1))).astype(np.float32)
    xf[0, 0, :128] = 0.0  # an all-zero group: amax clamps to 1e-4
    x = xf if xdt == "float32" else xf.astype(jnp.bfloat16)
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                   backend="reference", fp8_scale_format=fmt)
    hd = lb.handles_and_ref(R, cfg, x, idx, mode)
    if mode == "given":
        q, s = jax.jit(jax.vmap(reference.fp8_cast))(x)
        xin, sin = np.asarray(q), np.asarray(s)
    else:
        xin, sin = x, None
    il, sym = region(N) if region else (inter(lb, N), inter_sym(lb, N, T, H))
    for chunk in chunks:
        err, got, got_s, _ = il.dispatch(R, xin, sin, hd, mode, layout == "rank_major", H, chunk,
                                         iters=2, sym_bytes=sym,
                                         scale_mode="ue8m0" if fmt == "ue8m0" else "ieee")
        sq = [bool(np.array_equal(bits(g), bits(e))) for g, e in zip(got, hd[4])]
        ss = [bool(np.array_equal(bits(g), bits(e))) for g, e in zip(got_s, hd[5])]
        checks.report(f"{name}_chunk{chunk}", not err and all(sq) and all(ss), err=err,
                      q_same=sq, scales_same=ss,
                      q_mismatch=[int((bits(g) != bits(e)).sum()) for g, e in zip(got, hd[4])])


def _fp8_worker(rank, n):
    lb, checks, rng = _start()
    for case in FP8_CASES:
        with checks.guard(case[0]):
            _fp8_case(lb, checks, rng, case)
    return checks.results


# ---- combine -------------------------------------------------------------------
COMBINE_CASES = [  # name, N, T, H, K, E, layout, dtype, weighted, routing, chunks
    ("em_2x4_bf16_w_skew", 2, 256, 2048, 8, 64, "expert_major", "bfloat16", True, "skew",
     (0, 1, 3)),
    ("em_4x2_bf16_w_group2", 4, 256, 2048, 8, 64, "expert_major", "bfloat16", True, "group2",
     (0, 2)),
    ("rm_2x4_bf16_skew", 2, 256, 7168, 8, 256, "rank_major", "bfloat16", False, "skew", (0, 2)),
    ("rm_4x2_f32_group1", 4, 128, 1024, 4, 32, "rank_major", "float32", False, "group1", (0,)),
    ("em_2x4_f32_group1", 2, 64, 2050, 4, 16, "expert_major", "float32", True, "group1", (0,)),
    ("em_1x8_bf16_w_skew", 1, 128, 2048, 8, 64, "expert_major", "bfloat16", True, "skew", (0,)),
    ("em_8x1_bf16_w_skew", 8, 128, 2048, 8, 64, "expert_major", "bfloat16", True, "skew", (0,)),
]


def _ref_combine(cfg, hd, y, w, layout, T):
    from ep_testing import make_mesh, run_per_rank
    from jax_ep.intranode import reference
    from jax_ep.types import Handle

    Cn = y.shape[1]

    def fn(sm, li, sr, rs, yy, *ww):
        h = Handle(send_mask=sm, recv_local_idx=li, slot_row=sr, row_src=rs, native=None,
                   num_ranks=R, num_tokens=T, capacity=Cn, layout=layout)
        return reference.BACKEND.combine_rows(yy, ww[0] if ww else None, h, cfg)
    args = list(hd[:4]) + [y] + ([w] if w is not None else [])
    return np.asarray(run_per_rank(fn, make_mesh((R,), ("ep",)), "ep", *args))


def _combine_case(lb, checks, rng, case, region=None):
    import jax.numpy as jnp

    import internode_model as im
    from jax_ep.config import EpConfig

    name, N, T, H, K, E, layout, dt, weighted, kind, chunks = case
    idx = _routing(rng, kind, T, K, E, N)
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                   backend="reference")
    xdt = jnp.bfloat16 if dt == "bfloat16" else np.float32
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(xdt)
    hd = lb.handles_and_ref(R, cfg, x, idx, "copy")
    y = (hd[4].astype(np.float32) * 1.5 + 0.25).astype(xdt)  # [R, C, H]
    w = rng.random((R, y.shape[1])).astype(np.float32) if weighted else None
    expect = _ref_combine(cfg, hd, y, w, layout, T)
    model = im.combine_hier(y, w, hd[0], hd[1], hd[2], N, layout == "rank_major")
    il, sym = region(N) if region else (inter(lb, N), inter_sym(lb, N, T, H))
    first = None
    for chunk in chunks:
        err, got, _ = il.combine(R, y, w, hd, layout, H, chunk, iters=2, sym_bytes=sym)
        a = np.stack(got).astype(np.float32)
        b = expect.astype(np.float32)
        rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        tol = 1e-2 if dt == "bfloat16" else 1e-6
        first = got if first is None else first
        same0 = all(np.array_equal(bits(u), bits(v)) for u, v in zip(got, first))
        as_model = all(np.array_equal(bits(u), bits(v)) for u, v in zip(got, model))
        as_ref = all(np.array_equal(bits(u), bits(v)) for u, v in zip(got, expect))
        flat_case = N in (1, R)  # the node grouping is then the flat sum's
        checks.report(f"combine_{name}_chunk{chunk}",
                      not err and np.isfinite(a).all() and rel < tol and same0 and as_model,
                      err=err, rel_err=rel, same_bits_as_first_chunking=same0,
                      bitwise_equal_model=as_model, bitwise_equal_reference=as_ref,
                      flat_case=flat_case)
        if flat_case:
            flat = im.combine_flat(y, w, hd[0], hd[1], hd[2], layout == "rank_major")
            checks.report(f"combine_{name}_chunk{chunk}_flat_bits",
                          not err and all(np.array_equal(bits(u), bits(v))
                                          for u, v in zip(got, flat)), err=err)


def _combine_worker(rank, n):
    lb, checks, rng = _start()
    for case in COMBINE_CASES:
        with checks.guard(case[0]):
            _combine_case(lb, checks, rng, case)
    return checks.results


# ---- put mode: a case of each kind at every node split ------------------------
def _put_worker(rank, n):
    lb, checks, rng = tl.Loopback(put=True), Checks(), np.random.default_rng(17)
    runs = ([(_dispatch_case, DISPATCH_CASES[i]) for i in (0, 2, 3, 5, 7)]
            + [(_fp8_case, c) for c in FP8_CASES]
            + [(_combine_case, COMBINE_CASES[i]) for i in (0, 1, 2, 3, 6)])
    for fn, case in runs:
        case = ("put_" + case[0],) + tuple(case[1:])
        with checks.guard(case[0]):
            fn(lb, checks, rng, case)
    # windows (staged rows and mask words indexed by the window): on one region
    _window_calls(lb, checks, rng, [WINDOW_CALLS[i] for i in (0, 1, 3)], "put_")
    return checks.results


# ---- the runtime's fixed-T layout: calls of every T on one buffer ---------------
# name, N, T, H, K, E, layout, align, dtype, capacity, routing, chunks (dispatch)
# and name, N, T, H, K, E, layout, dtype, weighted, routing, chunks (combine),
# in this order on one region laid out for (N, R, FIXED_T, FIXED_H)
FIXED_T, FIXED_H = 256, 2048
FIXED_T_CALLS = [
    ("d", ("fixed_em_T256", 2, 256, 2048, 8, 64, "expert_major", 1, "bfloat16", None, "skew",
           (0,))),
    ("c", ("fixed_em_T256_w", 2, 256, 2048, 8, 64, "expert_major", "bfloat16", True, "skew",
           (0,))),
    ("d", ("fixed_rm_T7", 2, 7, 2048, 2, 16, "rank_major", 1, "bfloat16", None, "uniform", (0,))),
    ("c", ("fixed_rm_T7_f32", 2, 7, 1024, 2, 16, "rank_major", "float32", False, "uniform", (0,))),
    ("d", ("fixed_em_T128_H1024_f32", 2, 128, 1024, 4, 32, "expert_major", 1, "float32", None,
           "group1", (0, 2))),
    ("d", ("fixed_rm_T1", 2, 1, 2048, 8, 64, "rank_major", 1, "bfloat16", None, "uniform", (0,))),
    ("c", ("fixed_em_T200_w", 2, 200, 2048, 8, 64, "expert_major", "bfloat16", True, "group2",
           (0,))),
]


def _fixed_t_worker(rank, n):
    """As the JAX path runs them (cc/internode/ffi_handlers.cc: layout_T = the region's
    T, one region for every call, epochs carried over): dispatch and combine
    calls of T 256, 7, 128, 1, 200 and three row widths on one buffer per rank."""
    lb, checks, rng = _start()
    nbytes = lb.C.internode_region_bytes(2, R, FIXED_T, FIXED_H)

    def region(N):
        lb.sym_buffers(R, nbytes)      # the same buffers for every call (same size)
        return inter(lb, N, FIXED_T), nbytes
    lb._sym.pop(R, None)
    for kind, case in FIXED_T_CALLS:
        with checks.guard(case[0]):
            (_dispatch_case if kind == "d" else _combine_case)(lb, checks, rng, case, region)
    return checks.results


# ---- windows: calls of T above the region's layout T ----------------------------
WINDOW_T, WINDOW_H = 96, 2048
WINDOW_CALLS = [  # (kind, case): d / c as FIXED_T_CALLS, f: FP8_CASES' fields
    ("d", ("window_em_T300_align64", 2, 300, 2048, 8, 64, "expert_major", 64, "bfloat16", None,
           "skew", (0, 1))),
    ("c", ("window_em_T300_w", 2, 300, 2048, 8, 64, "expert_major", "bfloat16", True, "skew",
           (0, 3))),
    ("f", ("window_fp8_cast_rm_T200", 2, 200, 2048, 8, 64, "rank_major", "cast", "bfloat16",
           "f32", "group2", (0,))),
    ("f", ("window_fp8_given_em_T193", 2, 193, 2048, 4, 32, "expert_major", "given", None, "f32",
           "uniform", (0,))),
    ("d", ("window_rm_T97_f32", 2, 97, 1024, 4, 32, "rank_major", 1, "float32", None, "group1",
           (0,))),
    ("c", ("window_rm_T250_f32", 2, 250, 1024, 4, 32, "rank_major", "float32", False, "uniform",
           (0,))),
    ("d", ("window_em_T50", 2, 50, 2048, 8, 64, "expert_major", 1, "bfloat16", None, "skew",
           (0,))),
]


def _window_calls(lb, checks, rng, calls, prefix=""):
    """``calls`` (WINDOW_CALLS entries) in order on one region laid out for
    WINDOW_T tokens (fresh, zeroed buffers, then kept: epochs carried)."""
    nbytes = lb.C.internode_region_bytes(2, R, WINDOW_T, WINDOW_H)

    def region(N):
        lb.sym_buffers(R, nbytes)
        return inter(lb, N, WINDOW_T), nbytes
    lb._sym.pop(R, None)
    fns = {"d": _dispatch_case, "c": _combine_case, "f": _fp8_case}
    for kind, case in calls:
        case = (prefix + case[0],) + tuple(case[1:])
        with checks.guard(case[0]):
            fns[kind](lb, checks, rng, case, region)


def _window_worker(rank, n):
    lb, checks, rng = _start()
    _window_calls(lb, checks, rng, WINDOW_CALLS)
    return checks.results


# ---------------------------------------------------------------------------- bench
def _bench(put=False):
    """Intranode loopback (R = 8) vs emulated internode (2 x 4, 4 x 2), V3
    shapes, T 4096 per rank, uniform routing; per-call wall time over 20
    queued calls (median of 3). One GPU: HBM stands in for both links and all
    8 ranks share it, so this compares the kernels' work, not link speed.
    put: the internode network leg by NVSHMEM puts (loopback put mode).
    "2x4 W" runs 2 x 4 on the runtime's region of the default 1 GiB bound
    (windows of W tokens, one kernel each: docs/internode.md, "Windows")."""
    import jax.numpy as jnp

    from jax_ep.config import EpConfig

    lb = tl.Loopback(put=put)
    print(f"network leg: {'NVSHMEM puts' if put else 'P2P stores'}")
    T, H, K, E = 4096, 7168, 8, 256
    rng = np.random.default_rng(3)
    idx = np.stack([np.argsort(rng.random((T, E)), axis=1)[:, :K]
                    for _ in range(R)]).astype(np.int32)
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(jnp.bfloat16)
    print(f"loopback on 1 GPU ({lb.sms} SMs, {lb.sms // R} per rank), R={R} T={T} H={H} K={K} "
          f"E={E}")
    from jax_ep.internode.region import window_for as internode_window

    W = internode_window(lb.C.internode_region_bytes, 2, R, T, H)
    print(f"| op | layout | intranode us | 2x4 us | 2x4 W{W} us | 4x2 us | 2x4 / intra | "
          f"2x4 W{W} / intra |\n|---|---|---|---|---|---|---|---|")

    def med(f):
        f(2)
        times = []
        for _ in range(3):
            err, sec = f(20)
            if err:
                return "ERR " + err
            times.append(sec)
        return float(np.median(times) * 1e6)

    for layout, cap in (("rank_major", None), ("expert_major", int(1.25 * T * K))):
        cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                       capacity=cap, backend="reference")
        hd = _bench_handles(lb, cfg, x, idx, False)
        hd8 = _bench_handles(lb, cfg, x, idx, True) if layout == "rank_major" else None
        y = np.broadcast_to(np.zeros((), jnp.bfloat16), (R, hd[4].shape[1], H))
        w = rng.random((R, y.shape[1])).astype(np.float32) if layout == "expert_major" else None
        rm = layout == "rank_major"
        ops = [("dispatch", lambda l, s: lambda it: l.dispatch(
                    R, x, None, hd, "copy", rm, H, 0, iters=it, zero_tail=False,
                    sym_bytes=s)[0::3]),
               ("combine", lambda l, s: lambda it: l.combine(
                    R, y, w, hd, layout, H, 0, iters=it, sym_bytes=s)[0::2])]
        if hd8 is not None:
            ops.append(("dispatch_fp8", lambda l, s: lambda it: l.dispatch(
                R, x, None, hd8, "cast", True, H, 0, iters=it, sym_bytes=s)[0::3]))
        for name, mk in ops:
            row = [med(mk(lb, None))]
            row.append(med(mk(inter(lb, 2), inter_sym(lb, 2, T, H))))
            lb._sym.pop(R, None)
            wbytes = lb.C.internode_region_bytes(2, R, W, H)
            lb.sym_buffers(R, wbytes)
            row.append(med(mk(inter(lb, 2, W), wbytes)))
            row.append(med(mk(inter(lb, 4), inter_sym(lb, 4, T, H))))
            ratio = [f"{row[i] / row[0]:.2f}" if isinstance(row[i], float) and
                     isinstance(row[0], float) else "" for i in (1, 2)]
            cells = [f"{v:.1f}" if isinstance(v, float) else v for v in row]
            print(f"| {name} | {layout} | {' | '.join(cells)} | {' | '.join(ratio)} |", flush=True)
            lb._sym.pop(R, None)
    return 0


def _bench_handles(lb, cfg, x, idx, fp8):
    """The handle only (no reference rows: at R = 8 they are tens of GB);
    hd[4] / hd[5] are zero-stride stand-ins that give the kernels C and dtypes."""
    import jax.numpy as jnp

    from ep_testing import make_mesh, run_per_rank
    from jax_ep.intranode import reference

    T, H = x.shape[1], x.shape[2]

    def fn(i):
        h = reference.BACKEND.router.route(i, cfg, R)[0]
        return h.send_mask, h.recv_local_idx, h.slot_row, h.row_src
    hd = list(run_per_rank(fn, make_mesh((R,), ("ep",)), "ep", idx))
    C = hd[3].shape[1]
    dt = jnp.float8_e4m3fn if fp8 else x.dtype
    hd.append(np.broadcast_to(np.zeros((), dt), (R, C, H)))
    if fp8:
        hd.append(np.broadcast_to(np.zeros((), np.float32), (R, C, H // 128)))
    del T
    return tuple(hd)


if __name__ == "__main__" and sys.argv[1:2] == ["--bench"]:
    sys.exit(_bench(put="--put" in sys.argv[2:]))
