"""The low-latency (decode) kernels on ONE GPU: every rank's kernels in one process.

``jax_ep._C.loopback_ll_dispatch`` / ``loopback_ll_combine`` /
``loopback_ll_round_trip`` (cc/testing/loopback_ll.cu) run R ranks' send and
receive kernels (cc/low_latency/kernels.cu) on one device, each rank on its
own stream and SM share, with plain zeroed device buffers holding the
low-latency region in place of the symmetric buffer. Expected values come from
the reference (jax_ep/low_latency/reference.py) on R fake CPU devices; the kernel inputs
XLA will compute before the kernels (slot, tokens per expert, merged weights)
come from the same functions. Outputs are poisoned with 0xFF first.

Checked per case: dispatch rows and scales (valid rows only: the rest is
unspecified), ``src_count``, ``count``, each valid row's info word (t*K + k at
its source), and combine bit-identical to the reference; fp8 with f32 scales
(fp8_scale_mode "ieee", the CPU reference's rounding) and UE8M0, bf16 and f32
rows; uniform and skewed routing, -1 / out-of-range slots, repeated ids, T <
Tmax and T = Tmax; several consecutive calls with different data on the same
buffers (epochs, both parities), ``iters`` > 1, and a round trip where
combine reads the dispatch's device outputs. Combine's y is NaN on every row
that holds no pair, so a kernel reading one shows.

Each GPU test runs one worker in its own process (harness.run, n = 1, no
jax.distributed, JAX on 8 fake CPU devices). test_ll_expected_side_cpu runs on
CPU only: the worker's inputs and expected values, and the kernel's combine
operation order replayed in NumPy against the reference's bits.

Bench (V3-decode, one GPU; HBM stands in for NVLink, so compare variants,
never quote it as link performance):

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python tests/gpu/test_loopback_ll.py --bench [--put]
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from gpu_helpers import Checks, bits
from test_loopback import _ENV, Loopback, run_worker

# The CPU reference without FMA instructions: with them LLVM contracts some of
# the combine's `acc + where(ok, w * row, 0)` (after hoisting the per-token
# select out of the row loop; which ones depends on the shape), so its bits
# would depend on the host. Without, XLA computes exactly its HLO's order,
# which the kernel follows (and _np_kernel_combine models). An optimization
# barrier between the products and the sum does not help: XLA's CPU pipeline
# removes it before fusion (seen on jax 0.10.2 and 0.11.2).
_LL_ENV = dict(_ENV, XLA_FLAGS=_ENV["XLA_FLAGS"] + " --xla_cpu_max_isa=AVX")


def _run(worker, gpu=True):
    run_worker("test_loopback_ll", worker, env=_LL_ENV, gpu=gpu)


@pytest.mark.gpu
def test_loopback_ll_fp8():
    """fp8 dispatch (f32 scales, IEEE division; UE8M0), combine, epochs, R = 2 / 4 / 8."""
    _run("_fp8_worker")


@pytest.mark.gpu
def test_loopback_ll_bf16():
    """bf16 (and f32) rows without a cast, combine, epochs, R = 2 / 4 / 8."""
    _run("_bf16_worker")


@pytest.mark.gpu
def test_loopback_ll_round_trip():
    """Dispatch then combine in one call, combine reading the dispatch's device
    outputs; iters > 1 (parities wrap), then a check of the last call."""
    _run("_round_trip_worker")


@pytest.mark.gpu
def test_loopback_ll_grids():
    """Small and odd grids (1 block of 4 warps, 2 x 8, 3 x 16), T = 0, K = 1 and
    K = 32, and a combine whose row slices are not a multiple of 128 vectors
    (H 7168 in 6 slices: the case a lane-dependent shuffle loop got wrong)."""
    _run("_grid_worker")


@pytest.mark.gpu
def test_loopback_ll_put():
    """The NVSHMEM put transport (ll_transport "put": every row, info word and
    signal a put / signal op, staged rows, quiets, the receive-side test) at
    R = 2 / 4 / 8: this process the only PE, every rank's buffer in its heap
    (cc/testing/loopback_put.h). Same checks as the P2P cases."""
    _run("_put_worker")


@pytest.mark.gpu
def test_loopback_ll_mixed():
    """Mixed transports in one kernel (odd ranks by puts, even ones by P2P
    stores, as ll_transport "auto" across nodes): a token's destination list
    holds P2P rows and the one staged row."""
    _run("_mixed_worker")


@pytest.mark.slow
def test_ll_expected_side_cpu():
    """No GPU: the worker's inputs and expected values build on CPU, and the
    kernel's combine order (sel_0 + sel_1 + ..., no FMA) gives the reference's bits."""
    _run("_selfcheck_worker", gpu=False)


# ---------------------------------------------------------------------------- cases
# name, R, E, K, Tmax, H, fmt ("ieee" | "ue8m0": fp8 with those scales, from bf16
# x or with "_f32x" from f32 x; "bf16" / "f32": rows as is), skew, T of each
# consecutive call (same buffers: epochs)
FP8_CASES = [
    ("v3decode_R2_E256_K8_H7168_ieee", 2, 256, 8, 128, 7168, "ieee", False, (128, 77, 128)),
    ("R2_E64_K8_H2560_ue8m0_skew", 2, 64, 8, 96, 2560, "ue8m0", True, (60, 96, 1)),
    ("R4_E32_K6_H7168_ieee_skew", 4, 32, 6, 64, 7168, "ieee", True, (50, 64, 33)),
    ("R4_E64_K8_H2048_ue8m0", 4, 64, 8, 48, 2048, "ue8m0", False, (48, 20)),
    ("R8_E64_K8_H7168_ue8m0", 8, 64, 8, 32, 7168, "ue8m0", False, (32, 17)),
    ("R8_E16_K8_H2560_ieee_skew", 8, 16, 8, 24, 2560, "ieee", True, (24, 9, 24)),
    ("R2_E16_K4_H2048_ieee_f32x", 2, 16, 4, 24, 2048, "ieee_f32x", False, (24, 5)),
]
BF16_CASES = [
    ("R2_E64_K8_H7168_bf16_skew", 2, 64, 8, 64, 7168, "bf16", True, (64, 40, 64)),
    ("R4_E64_K8_H2048_bf16", 4, 64, 8, 40, 2048, "bf16", False, (40, 13)),
    ("R8_E64_K4_H2560_bf16_skew", 8, 64, 4, 32, 2560, "bf16", True, (20, 32, 5)),
    ("R2_E16_K4_H2048_f32", 2, 16, 4, 24, 2048, "f32", False, (24, 7)),
    ("R4_E16_K2_H1000_bf16", 4, 16, 2, 16, 1000, "bf16", False, (16, 3)),   # H % 128 != 0
]
GRID_CASES = [  # + num_blocks, warps per block
    # 3 blocks x 16 warps, T 8: 6 slices of a 896-vector row (149 / 150 each)
    ("grid_R2_E32_K8_H7168_bf16_b3w16", 2, 32, 8, 16, 7168, "bf16", False, (8, 16), 3, 16),
    ("grid_R4_E16_K1_H2048_ieee_b1w4", 4, 16, 1, 32, 2048, "ieee", False, (32, 0, 5), 1, 4),
    ("grid_R8_E64_K32_H1024_bf16_b2w8", 8, 64, 32, 8, 1024, "bf16", True, (8, 3), 2, 8),
    ("grid_R2_E16_K4_H2560_ue8m0_b2w16", 2, 16, 4, 64, 2560, "ue8m0", True, (0, 64), 2, 16),
]
ROUND_TRIP_CASES = [  # + iters
    ("rt_v3decode_R2_E256_K8_H7168_ieee", 2, 256, 8, 128, 7168, "ieee", False, (128, 64), 3),
    ("rt_R4_E64_K8_H2560_bf16_skew", 4, 64, 8, 32, 2560, "bf16", True, (32, 11), 4),
    ("rt_R8_E64_K8_H2048_ue8m0_skew", 8, 64, 8, 32, 2048, "ue8m0", True, (32,), 2),
]


def _routing(rng, R, T, K, E, skew):
    """topk_idx [R, T, K]: distinct random experts with -1 and out-of-range
    slots; skew: 90% of the tokens put their first min(K, L) picks on rank 0's
    experts (one rank gets almost everything); every 5th token repeats its
    first id in slot 1; token 3 picks nothing."""
    from ep_testing import random_routing

    L = E // R
    idx = random_routing(rng, R, T, K, E, minus_one=0.15, invalid=0.05)
    if skew:
        m = min(K, L)
        hot = rng.random((R, T, 1)) < 0.9
        own = np.argsort(rng.random((R, T, L)), axis=2)[..., :m]
        idx[..., :m] = np.where(hot, own, idx[..., :m])
    if K > 1:
        idx[:, ::5, 1] = idx[:, ::5, 0]
    if T > 3:
        idx[:, 3] = -1
    return idx.astype(np.int32)


class Spec:
    """One case's static shapes and byte sizes."""

    def __init__(self, R, E, K, Tmax, H, fmt):
        self.R, self.E, self.K, self.Tmax, self.H, self.fmt = R, E, K, Tmax, H, fmt
        self.L = E // R
        self.fp8 = fmt.split("_")[0] in ("ieee", "ue8m0")
        self.scale_format = "ue8m0" if fmt.startswith("ue8m0") else "f32"   # the reference's name
        self.x_f32 = fmt == "f32" or fmt.endswith("_f32x")
        self.row_bytes = H if self.fp8 else H * (4 if self.x_f32 else 2)
        self.s_row_bytes = H // 128 * 4 if self.fp8 else 0
        self.y_row_bytes = H * 2   # combine in bf16

    def cfg(self):
        from jax_ep.config import EpConfig

        return EpConfig(num_experts=self.E, topk=self.K, max_tokens_per_rank=self.Tmax,
                        hidden=self.H, backend="reference")

    def key(self):
        return (self.R, self.E, self.K, self.Tmax, self.row_bytes, self.s_row_bytes,
                self.y_row_bytes)


def _inputs(rng, spec, T, skew):
    """x [R, T, H], topk_idx [R, T, K], topk_weights [R, T, K]."""
    import jax.numpy as jnp

    s = spec
    idx = _routing(rng, s.R, T, s.K, s.E, skew)
    x = (rng.standard_normal((s.R, T, s.H)) * rng.exponential(3.0, (s.R, T, 1))).astype(np.float32)
    if T:
        x[0, 0, :128] = 0.0   # an all-zero group: amax clamps to 1e-4
    x = x if s.x_f32 else x.astype(jnp.bfloat16)
    w = rng.random((s.R, T, s.K)).astype(np.float32) + np.float32(0.01)
    return x, idx, w


def _expected_dispatch(spec, x, idx, w):
    """The reference dispatch on R fake CPU devices, and the kernel inputs that
    XLA computes before the kernels from the same functions: dict of [R, ...]."""
    import jax.numpy as jnp

    from ep_testing import make_mesh, run_per_rank
    from jax_ep.low_latency import api as ll
    from jax_ep.routing import merge_duplicate_weights

    s = spec
    cfg = s.cfg()

    def fn(x, i, w):
        d = ll.low_latency_dispatch(x, i, cfg, fp8=s.fp8, scale_format=s.scale_format)
        i32 = i.astype(jnp.int32)
        slot, per_expert = ll._slots(i32, s.E)
        wm = merge_duplicate_weights(i32, w.astype(jnp.float32), s.E)
        sc = d.x_scales if s.fp8 else jnp.zeros((1,), jnp.float32)
        return d.x, sc, d.count, d.src_count, d.handle.slot, slot, per_expert, wm
    out = run_per_rank(fn, make_mesh((s.R,), ("ep",)), "ep", x, idx, w)
    names = ("x", "scales", "count", "src_count", "handle_slot", "slot", "expert_count", "wm")
    e = dict(zip(names, out))
    e["valid"] = _valid_rows(spec, e["src_count"])
    e["info"] = _expected_info(spec, idx, e["slot"], e["src_count"])
    return e


def _valid_rows(spec, src_count):
    """[R, L, R*Tmax] bool: expert l's first count[l] = sum_s n[l, s] rows hold pairs (packed)."""
    j = np.arange(spec.R * spec.Tmax)
    return j[None, None, :] < src_count.sum(-1)[..., None]


def _expected_info(spec, idx, slot, src_count):
    """[R, L, R*Tmax] int32: t*K + k of each received pair at its source (-1: no
    pair), at the pair's packed row: the rows of earlier sources, then its slot."""
    s = spec
    info = np.full((s.R, s.L, s.R * s.Tmax), -1, np.int32)
    pre = np.cumsum(src_count, axis=2) - src_count         # [R, L, R(source)]
    src, t, k = np.nonzero(slot >= 0)
    e = idx[src, t, k]
    r, l = e // s.L, e % s.L
    info[r, l, pre[r, l, src] + slot[src, t, k]] = t * s.K + k
    return info


def _make_y(rng, spec, valid):
    """Expert outputs [R, L, R*Tmax, H] bf16, NaN on rows without a pair."""
    import jax.numpy as jnp

    y = rng.standard_normal((spec.R, spec.L, spec.R * spec.Tmax, spec.H)).astype(np.float32)
    y[~valid] = np.nan
    return y.astype(jnp.bfloat16)


def _expected_combine(spec, y, idx, w, slot, src_count):
    from ep_testing import make_mesh, run_per_rank
    from jax_ep import low_latency_combine
    from jax_ep import LowLatencyHandle

    cfg = spec.cfg()

    def comb(y, i, w, sl, sc):
        h = LowLatencyHandle(slot=sl, src_count=sc, num_ranks=spec.R, max_tokens=spec.Tmax)
        return low_latency_combine(y, i, w, h, cfg)
    return run_per_rank(comb, make_mesh((spec.R,), ("ep",)), "ep", y, idx, w, slot, src_count)


def _np_kernel_combine(spec, y, idx, slot, wm, src_count):
    """The combine kernel's arithmetic in NumPy f32: sel_k = w'_k * f32(row) or
    +0, out = cast(((sel_0 + sel_1) + sel_2) + ...), one rounding per op."""
    import jax.numpy as jnp

    s = spec
    T = idx.shape[1]
    pre = np.cumsum(src_count, axis=2) - src_count         # [R, L, R(source)]
    out = np.zeros((s.R, T, s.H), jnp.bfloat16)
    for src in range(s.R):
        acc = None
        for k in range(s.K):
            j = slot[src, :, k]
            ok = j >= 0
            e = np.where(ok, idx[src, :, k], 0)
            r, l = e // s.L, e % s.L
            rows = y[r, l, pre[r, l, src] + np.maximum(j, 0)].astype(np.float32)
            sel = np.where(ok[:, None], wm[src, :, k, None] * rows, np.float32(0))
            acc = sel if k == 0 else (acc + sel).astype(np.float32)
        out[src] = acc.astype(jnp.bfloat16)
    return out


# ---------------------------------------------------------------------------- device side
class LlLoopback(Loopback):
    """Device buffers and raw launches of the low-latency kernels."""

    def __init__(self, put=False, mixed=False):
        super().__init__(put=put or mixed)
        self.mixed = bool(mixed)   # odd ranks by puts, even ones by P2P (loopback_ll.cu)
        self._ll_sym = {}

    def ll_sym(self, spec):
        """One zeroed stand-in buffer per rank, kept for every call of one layout
        (consecutive calls run on it: epochs). A new layout gets new zeroed
        buffers (words of another layout would sit on its rows)."""
        key = spec.key()
        if key not in self._ll_sym:
            self._ll_sym.clear()
            self.torch.cuda.empty_cache()
            n = self.C.ll_region_bytes(spec.R, spec.E, spec.Tmax, spec.K, spec.row_bytes,
                                       spec.s_row_bytes, spec.y_row_bytes, stage=self.put)
            self._ll_sym[key] = [self.zeros_sym(n) for _ in range(spec.R)]
        return self._ll_sym[key]

    def run(self, op, spec, x, idx, slot, expert_count, wm, y=None, cinfo=None, csrc=None,
            iters=1, num_blocks=None, warps=16, scale_mode=None):
        """op: "dispatch", "combine" or "round_trip" (combine reads the dispatch's
        out_info / src_count on the device). -> (error, outputs as numpy [R, ...],
        seconds per call)."""
        from jax_ep import abi
        import jax.numpy as jnp

        s, np_ = spec, self.np
        R, L, T, RT = s.R, s.L, idx.shape[1], s.R * s.Tmax
        syms = self.ll_sym(s)
        mode = abi.dispatch_mode("copy" if not s.fp8 else
                                 "cast_f32" if x.dtype == np_.float32 else "cast_bf16")
        scale_mode = scale_mode or ("ue8m0" if s.scale_format == "ue8m0" else "ieee")
        keep, ptrs, outs = [], [], []
        none = self.poisoned(16)
        for r in range(R):
            d = dict(
                x=self.dev(x[r]), topk_idx=self.dev(idx[r]), slot=self.dev(slot[r]),
                expert_count=self.dev(expert_count[r]),
                out=self.poisoned(L * RT * s.row_bytes),
                out_scales=self.poisoned(L * RT * s.s_row_bytes),
                out_info=self.poisoned(L * RT * 4), src_count=self.poisoned(L * R * 4),
                count=self.poisoned(L * 4),
                y=self.dev(y[r]) if y is not None else none,
                weights=self.dev(wm[r]), combine_out=self.poisoned(T * s.y_row_bytes),
                sym=syms[r])
            if op == "round_trip":
                d.update(combine_info=d["out_info"], combine_src_count=d["src_count"])
            else:
                d.update(combine_info=self.dev(cinfo[r]) if cinfo is not None else none,
                         combine_src_count=self.dev(csrc[r]) if csrc is not None else none)
            keep.append(d)
            ptrs += [d[k].data_ptr() for k in self.C.LOOPBACK_LL_PTRS]
        vals = dict(T=T, K=s.K, num_experts=s.E, max_tokens=s.Tmax, hidden=s.H,
                    x_row_bytes=s.H * x.dtype.itemsize, row_bytes=s.row_bytes,
                    s_row_bytes=s.s_row_bytes, y_row_bytes=s.y_row_bytes, mode=mode,
                    fp8_scale_mode=abi.fp8_scale_mode(scale_mode),
                    y_dtype=abi.row_dtype("bfloat16"),
                    num_blocks=num_blocks or self.sms // R, warps=warps,
                    put=2 if self.mixed else int(self.put))
        ints = [vals[k] for k in self.C.LOOPBACK_LL_INTS]
        fn = getattr(self.C, f"loopback_ll_{op}")
        err, sec = fn(ptrs, ints, syms[0].numel(), R, iters)
        xdt = np_.uint8 if s.fp8 else x.dtype
        like = dict(out=np_.zeros((L, RT, s.row_bytes // np_.dtype(xdt).itemsize), xdt),
                    out_scales=np_.zeros((L, RT, s.s_row_bytes // 4), np_.float32),
                    out_info=np_.zeros((L, RT), np_.int32),
                    src_count=np_.zeros((L, R), np_.int32), count=np_.zeros((L,), np_.int32),
                    combine_out=np_.zeros((T, s.H), jnp.bfloat16))
        got = {k: np_.stack([self.host(keep[r][k], v) for r in range(R)]) for k, v in like.items()}
        return err, got, sec


# ---------------------------------------------------------------------------- checks
def _check_dispatch(checks, name, spec, err, got, e):
    valid = e["valid"]
    xq = bits(e["x"])
    gq = bits(got["out"])
    rows = bool(np.array_equal(gq[valid], xq[valid]))
    sc = (not spec.fp8) or bool(np.array_equal(bits(got["out_scales"])[valid],
                                               bits(e["scales"])[valid]))
    counts = bool(np.array_equal(got["src_count"], e["src_count"])
                  and np.array_equal(got["count"], e["count"]))
    info = bool(np.array_equal(got["out_info"][valid], e["info"][valid]))
    checks.report(f"{name}_dispatch", not err and rows and sc and counts and info, err=err,
                  rows_same=rows, scales_same=sc, counts_same=counts, info_same=info,
                  valid_rows=int(valid.sum()),
                  row_mismatch=int((gq[valid] != xq[valid]).any(axis=-1).sum()))


def _check_combine(checks, name, err, got, expect, model):
    """Bit-identical to the reference and to the NumPy model of the kernel's order."""
    same = [bool(np.array_equal(bits(g), bits(x))) for g, x in zip(got["combine_out"], expect)]
    same_model = bool(np.array_equal(bits(got["combine_out"]), bits(model)))
    a, b = got["combine_out"].astype(np.float32), np.asarray(expect).astype(np.float32)
    checks.report(f"{name}_combine", not err and all(same) and same_model, err=err, same=same,
                  same_as_model=same_model, mismatches=int((bits(a) != bits(b)).sum()),
                  max_abs_diff=float(np.nanmax(np.abs(a - b), initial=0.0)),
                  finite=bool(np.isfinite(a).all()))


def _case(lb, checks, rng, case, grid=None):
    """Consecutive calls on the same buffers, new data each: dispatch, then
    combine of that dispatch's device results (copied back in). grid:
    (num_blocks, warps) or the default (the rank's SMs x 16)."""
    name, R, E, K, Tmax, H, fmt, skew, Ts = case
    kw = dict(num_blocks=grid[0], warps=grid[1]) if grid else {}
    spec = Spec(R, E, K, Tmax, H, fmt)
    for call, T in enumerate(Ts):
        tag = f"{name}_call{call}_T{T}"
        x, idx, w = _inputs(rng, spec, T, skew)
        e = _expected_dispatch(spec, x, idx, w)
        assert np.array_equal(e["slot"], e["handle_slot"])
        err, got, _ = lb.run("dispatch", spec, x, idx, e["slot"], e["expert_count"], e["wm"],
                             **kw)
        _check_dispatch(checks, tag, spec, err, got, e)
        y = _make_y(rng, spec, e["valid"])
        expect = _expected_combine(spec, y, idx, w, e["slot"], e["src_count"])
        model = _np_kernel_combine(spec, np.asarray(y), idx, e["slot"], e["wm"],
                                   e["src_count"])
        err, gotc, _ = lb.run("combine", spec, x, idx, e["slot"], e["expert_count"], e["wm"],
                              y=y, cinfo=got["out_info"], csrc=got["src_count"], **kw)
        _check_combine(checks, tag, err, gotc, expect, model)


def _worker(cases, put=False, mixed=False):
    lb, checks, rng = LlLoopback(put=put, mixed=mixed), Checks(), np.random.default_rng(7)
    for case in cases:
        with checks.guard(("mixed_" if mixed else "put_" if put else "") + case[0]):
            _case(lb, checks, rng, case)
    return checks.results


def _grid_worker(rank, n):
    lb, checks, rng = LlLoopback(), Checks(), np.random.default_rng(13)
    for case in GRID_CASES:
        with checks.guard(case[0]):
            _case(lb, checks, rng, case[:9], grid=case[9:])
    return checks.results


def _fp8_worker(rank, n):
    return _worker(FP8_CASES)


# Put mode: P2P cases of each kind, every R, and round trips (iters > 1)
PUT_CASES = [c for i, c in enumerate(FP8_CASES) if i in (0, 2, 4, 5)] + \
    [c for i, c in enumerate(BF16_CASES) if i in (0, 2, 4)]


def _put_worker(rank, n):
    checks = _worker(PUT_CASES, put=True)
    return checks + _round_trip_worker(rank, n, put=True)


def _mixed_worker(rank, n):
    return _worker([c for c in PUT_CASES if c[1] > 1], mixed=True)


def _bf16_worker(rank, n):
    return _worker(BF16_CASES)


def _round_trip_worker(rank, n, put=False):
    lb, checks, rng = LlLoopback(put=put), Checks(), np.random.default_rng(11)
    for name, R, E, K, Tmax, H, fmt, skew, Ts, iters in ROUND_TRIP_CASES:
        name = ("put_" if put else "") + name
        with checks.guard(name):
            spec = Spec(R, E, K, Tmax, H, fmt)
            for call, T in enumerate(Ts):
                tag = f"{name}_call{call}_T{T}_iters{iters}"
                x, idx, w = _inputs(rng, spec, T, skew)
                e = _expected_dispatch(spec, x, idx, w)
                # y is fixed before the dispatch runs: from the reference's valid rows
                y = _make_y(rng, spec, e["valid"])
                expect = _expected_combine(spec, y, idx, w, e["slot"], e["src_count"])
                model = _np_kernel_combine(spec, np.asarray(y), idx, e["slot"], e["wm"],
                                   e["src_count"])
                err, got, _ = lb.run("round_trip", spec, x, idx, e["slot"], e["expert_count"],
                                     e["wm"], y=y, iters=iters)
                _check_dispatch(checks, tag, spec, err, got, e)
                _check_combine(checks, tag, err, got, expect, model)
    return checks.results


def _selfcheck_worker(rank, n):
    """CPU only: every case's inputs and expected values, and the combine
    kernel's operation order (NumPy) against the reference's bits."""
    checks, rng = Checks(), np.random.default_rng(5)
    small = [  # the shapes of the GPU cases, smaller H / Tmax (CPU time)
        ("R2_E64_K8_ieee", 2, 64, 8, 16, 256, "ieee", False, (16, 9)),
        ("R4_E32_K6_ue8m0_skew", 4, 32, 6, 16, 384, "ue8m0", True, (11,)),
        ("R8_E16_K8_bf16_skew", 8, 16, 8, 8, 128, "bf16", True, (8, 3)),
        ("R2_E16_K4_f32", 2, 16, 4, 8, 1000, "f32", False, (8,)),
        ("R2_E16_K4_ieee_f32x", 2, 16, 4, 8, 256, "ieee_f32x", False, (5,)),
        ("R4_E16_K1_bf16", 4, 16, 1, 8, 256, "bf16", False, (6,)),
        ("R4_E16_K1_ieee_T0", 4, 16, 1, 8, 256, "ieee", False, (0, 5)),
        ("R8_E64_K32_bf16_skew", 8, 64, 32, 8, 128, "bf16", True, (8,)),
    ]
    for name, R, E, K, Tmax, H, fmt, skew, Ts in small:
        with checks.guard(name):
            spec = Spec(R, E, K, Tmax, H, fmt)
            for T in Ts:
                x, idx, w = _inputs(rng, spec, T, skew)
                e = _expected_dispatch(spec, x, idx, w)
                placed = e["info"] >= 0
                y = _make_y(rng, spec, e["valid"])
                ref = _expected_combine(spec, y, idx, w, e["slot"], e["src_count"])
                mine = _np_kernel_combine(spec, np.asarray(y), idx, e["slot"], e["wm"],
                                          e["src_count"])
                # src_count [r, l, s] is source s's tokens for expert r*L + l
                counts = np.array_equal(e["expert_count"].reshape(R, R, -1).transpose(1, 2, 0),
                                        e["src_count"])
                ok = dict(slot_same=bool(np.array_equal(e["slot"], e["handle_slot"])),
                          counts_match=bool(counts),
                          info_marks_valid=bool(np.array_equal(placed, e["valid"])),
                          combine_order_bits=bool(np.array_equal(bits(mine), bits(ref))))
                checks.report(f"{name}_T{T}", all(ok.values()), **ok)
    return checks.results


# ---------------------------------------------------------------------------- bench
def _bench(put=False):
    """V3-decode (R 2, T 128, H 7168, E 256, K 8; fp8 dispatch with XLA:GPU's
    division, bf16 combine) on ONE GPU: us per call of dispatch, combine and
    the round trip, each the median of 5 runs of 50 queued calls. put: every
    send by NVSHMEM puts (loopback put mode), the put path's own cost."""
    import jax.numpy as jnp

    from ep_testing import random_routing

    lb = LlLoopback(put=put)
    rng = np.random.default_rng(3)
    R, E, K, Tmax, H = 2, 256, 8, 128, 7168
    print(f"low-latency loopback on 1 GPU ({lb.sms} SMs, {lb.sms // R} per rank), R={R} "
          f"T={Tmax} H={H} E={E} K={K}; transport {'put' if put else 'P2P'}; "
          f"HBM stands in for NVLink")
    print("| op | routing | rows | us per call |\n|---|---|---|---|")
    for label, skew in (("uniform", False), ("skewed", True)):
        spec = Spec(R, E, K, Tmax, H, "ieee")
        T = Tmax
        idx = (random_routing(rng, R, T, K, E, minus_one=0.0) if not skew
               else _routing(rng, R, T, K, E, True))
        x = rng.standard_normal((R, T, H)).astype(np.float32).astype(jnp.bfloat16)
        w = rng.random((R, T, K)).astype(np.float32)
        e = _expected_dispatch(spec, x, idx, w)
        y = _make_y(rng, spec, e["valid"])
        args = (spec, x, idx, e["slot"], e["expert_count"], e["wm"])
        _, got, _ = lb.run("dispatch", *args, scale_mode="xla_gpu")
        ops = [("dispatch fp8", lambda it: lb.run("dispatch", *args, iters=it,
                                                 scale_mode="xla_gpu")),
               ("combine bf16", lambda it: lb.run("combine", *args, y=y, cinfo=got["out_info"],
                                                  csrc=got["src_count"], iters=it)),
               ("round trip", lambda it: lb.run("round_trip", *args, y=y, iters=it,
                                                scale_mode="xla_gpu"))]
        for name, f in ops:
            f(5)
            times, err = [], ""
            for _ in range(5):
                err, _, sec = f(50)
                times.append(sec)
            print(f"| {name} | {label} | {int(e['valid'].sum())} | "
                  f"{'ERR ' + err if err else f'{np.median(times) * 1e6:.1f}'} |", flush=True)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--bench"]:
    sys.exit(_bench(put="--put" in sys.argv[2:]))
