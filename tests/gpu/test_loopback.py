"""The dispatch / combine kernels on ONE GPU: every rank's kernel in one process.

``jax_ep._C.loopback_dispatch`` / ``loopback_combine`` (cc/testing/loopback.cu) run R
ranks' kernels concurrently on one device, each on its own stream and SM share,
with plain zeroed device buffers in place of the NVSHMEM symmetric buffer: the
real protocol (staging rings, chunk flags and credits, epochs across calls,
row slices) with HBM
standing in for NVLink. Handles and expected rows come from the reference
backend on CPU (R fake devices). Outputs are poisoned with 0xFF first.

This covers the kernels wherever a single GPU is all there is (and R = 4
without four GPUs); the multi-process tests (test_native_dispatch.py) cover the
NVSHMEM transport, FFI and JAX integration. fp8 casts use IEEE division here
(fp8_scale_mode "ieee"), the CPU reference's rounding; UE8M0 cases use power-of-two scales.

Each test runs one worker below in its own process (harness.run, n = 1, no
jax.distributed, JAX on 8 fake CPU devices); the worker returns its named checks
(gpu_helpers.Checks) and the test asserts that every one passed.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import harness
from gpu_helpers import Checks, assert_checks, bits

_HERE = os.path.dirname(os.path.abspath(__file__))
# One process (no jax.distributed, no NVSHMEM): JAX on R fake CPU devices for the
# reference, the kernels on GPU 0 through torch buffers.
# CUDA_DEVICE_MAX_CONNECTIONS: one hardware queue per rank's stream (the default,
# 8, is shared with the allocator's streams at R = 8, and two ranks' kernels
# queued behind each other wait on each other forever).
_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "CUDA_DEVICE_MAX_CONNECTIONS": "32"}


def _skip_reason():
    reason = harness.skip_reason(1)  # one GPU and the extension
    if reason:
        return reason
    try:
        import torch  # noqa: F401  (device buffers for the raw kernel launches)
    except ImportError:
        return "needs torch for device buffers"
    return harness.testing_skip_reason()


def run_worker(module, worker, env=_ENV, gpu=True):
    """Runs ``module:worker`` in its own process (one GPU, no jax.distributed)
    and asserts that every check it reports passed; skips without a GPU
    (``gpu=False``: a CPU-only worker, never skipped)."""
    reason = _skip_reason() if gpu else None
    if reason:
        pytest.skip(reason)
    results = harness.run(f"{module}:{worker}", 1, timeout=900, env=env,
                          init_native=False, distributed=False)
    assert_checks(results, worker)


def _run(worker):
    run_worker("test_loopback", worker)


@pytest.mark.gpu
def test_loopback_dispatch_bitexact():
    _run("_dispatch_worker")


@pytest.mark.gpu
def test_loopback_fp8():
    _run("_fp8_worker")


@pytest.mark.gpu
def test_loopback_combine():
    _run("_combine_worker")


@pytest.mark.gpu
def test_loopback_zero_tail():
    """zero_tail off (the default): rows inside groups bit-identical, tail rows untouched."""
    _run("_zero_tail_worker")


@pytest.mark.gpu
def test_loopback_combine_bwd():
    """The fused combine backward: dy bit-identical, dw within f32 reduction order."""
    _run("_combine_backward_worker")


@pytest.mark.gpu
def test_loopback_tiny_ring_r2():
    """R = 2 with a deliberately tiny symmetric buffer: every ring slot reused
    many times per call (and a 1-token ring), skewed routing where one rank
    receives almost everything; dispatch (copy, fp8), combine and the combine
    backward against the reference, and the same bits as a buffer whose rings
    never wrap."""
    _run("_ring_worker_r2")


@pytest.mark.gpu
def test_loopback_tiny_ring_r8():
    """As test_loopback_tiny_ring_r2 at R = 8 (every peer's ring wraps); its
    pass (1x H200) is what lets plan_launch wrap rings at every R."""
    _run("_ring_worker_r8")


# ---------------------------------------------------------------------------- worker
# Put mode's NVSHMEM heap: the largest case holds 8 x 0.66 GiB of stand-in buffers.
PUT_HEAP_BYTES = 16 << 30


def init_put_mode(C):
    """This process as the only NVSHMEM PE, so the loopback harnesses' put mode
    (cc/testing/loopback_put.h) can take stand-in buffers from its heap."""
    if C.nvshmem_status() >= 2:
        return
    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(PUT_HEAP_BYTES))
    C.nvshmem_init(C.nvshmem_unique_id(), 0, 1, 0)


class HeapBuf:
    """A zeroed stand-in symmetric buffer from the NVSHMEM heap (put mode), with
    the two things the harness reads of a torch buffer."""

    def __init__(self, C, nbytes):
        self._C, self._n = C, nbytes
        self._p = C.loopback_sym_alloc(nbytes)

    def data_ptr(self):
        return self._p

    def numel(self):
        return self._n

    def __del__(self):
        try:
            self._C.loopback_sym_free(self._p)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class Loopback:
    """Device buffers, reference handles and raw launches for the worker / bench.

    put=True: the kernels' NVSHMEM put path (every network leg / low-latency
    send by puts to this process's one PE), the stand-in buffers from its heap."""

    def __init__(self, put=False):
        import numpy as np
        import torch

        sys.path[:0] = [os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))]
        from jax_ep import extension, runtime

        self.np, self.torch = np, torch
        self.C = extension.load()  # the jax_ep._C module
        assert self.C is not None, runtime.unavailable_reason()
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self._sym = {}
        self.put = bool(put)
        if self.put:
            torch.zeros(1, device="cuda")  # the CUDA context before NVSHMEM's
            init_put_mode(self.C)

    def zeros_sym(self, nbytes):
        """One zeroed stand-in symmetric buffer (the NVSHMEM heap in put mode)."""
        if self.put:
            return HeapBuf(self.C, nbytes)
        return self.torch.zeros(nbytes, dtype=self.torch.uint8, device="cuda")

    def sym_buffers(self, R, nbytes):
        """One zeroed stand-in symmetric buffer per rank, reused across calls of
        the same size (epochs). A new size gets new zeroed buffers: the control
        words sit at the end of the buffer, so a reused larger one would put
        them on stale staging rows (garbage epochs on some ranks)."""
        if R not in self._sym or self._sym[R][0].numel() != nbytes:
            self._sym.pop(R, None)
            self.torch.cuda.empty_cache()
            self._sym[R] = [self.zeros_sym(nbytes) for _ in range(R)]
        return self._sym[R]

    def dev(self, a):
        a = self.np.ascontiguousarray(a)
        return self.torch.from_numpy(a.view(self.np.uint8).reshape(-1).copy()).cuda()

    def poisoned(self, nbytes):
        return self.torch.full((max(nbytes, 16),), 0xFF, dtype=self.torch.uint8, device="cuda")

    @staticmethod
    def host(t, like):
        return t.cpu().numpy()[: like.nbytes].view(like.dtype).reshape(like.shape)

    def handles_and_ref(self, R, cfg, x, idx, mode):
        """Per-rank handle fields and the reference's dispatch rows (numpy, [R, ...])."""
        from ep_testing import make_mesh, run_per_rank
        from jax_ep.intranode import reference

        ref = reference.BACKEND
        mesh = make_mesh((R,), ("ep",))

        def fn(x, i):
            h = ref.router.route(i, cfg, R)[0]
            if mode in ("cast", "given"):
                out, out_s = ref.dispatch_rows(*reference.fp8_cast(x, cfg.fp8_scale_format),
                                               h, cfg)
            else:
                out, out_s = ref.dispatch_rows(x, None, h, cfg)
            outs = (h.send_mask, h.recv_local_idx, h.slot_row, h.row_src, out)
            return outs + ((out_s,) if out_s is not None else ())
        return run_per_rank(fn, mesh, "ep", x, idx)

    def dispatch(self, R, x, scales, hd, mode, rank_major, H, chunk=0, iters=1,
                 num_blocks=None, zero_tail=True, align=1, yw=None, sym_bytes=None,
                 scale_mode="ieee"):
        """-> (error, per-rank rows, per-rank scales or None, seconds per call).

        zero_tail / align: DispatchArgs' (True: every row without a source is
        zeroed, as the reference does). sym_bytes: the stand-in symmetric
        buffer (default: rings that never wrap, up to 1 GiB). mode "bwd": the fused combine backward,
        x = d_out, yw = (y [R, C, H], w [R, C]); returns dy as the rows and dw
        [C] f32 in place of the scales."""
        import jax.numpy as jnp
        from jax_ep import abi
        np = self.np

        send_mask, recv_li, slot_row, row_src, out_ref = hd[:5]
        T, K, C = x.shape[1], slot_row.shape[-1], out_ref.shape[1]
        row_bytes = out_ref.shape[2] * out_ref.dtype.itemsize
        x_row_bytes = x.shape[2] * x.dtype.itemsize
        s_row_bytes = (H // 128) * 4 if mode in ("cast", "given") else 0
        kmode = abi.dispatch_mode({"copy": "copy", "given": "copy", "bwd": "combine_bwd"}.get(
            mode, "cast_bf16" if x.dtype == jnp.bfloat16 else "cast_f32"))
        dt = abi.ROW_DTYPES.get(np.dtype(x.dtype).name, abi.ROW_DTYPES["bfloat16"])[1]
        syms = self.sym_buffers(R, sym_bytes or self.C.symmetric_buffer_bytes(R, T, row_bytes,
                                                                              s_row_bytes))
        keep, ptrs, outs, out_ss, dws = [], [], [], [], []
        for r in range(R):
            named = dict(
                x=self.dev(x[r]),
                scales=self.dev(scales[r]) if scales is not None else self.poisoned(16),
                out=self.poisoned(C * row_bytes), out_scales=self.poisoned(C * s_row_bytes),
                row_src=self.dev(row_src[r]), slot_row=self.dev(slot_row[r]),
                send_mask=self.dev(send_mask[r]), sym=syms[r])
            if mode == "bwd":
                named.update(y=self.dev(yw[0][r]), row_w=self.dev(yw[1][r].astype(np.float32)),
                             dw=self.poisoned(C * 4))
            else:
                named.update(y=self.poisoned(16), row_w=self.poisoned(16), dw=self.poisoned(16))
            keep.append(named)
            outs.append(named["out"])
            out_ss.append(named["out_scales"])
            dws.append(named["dw"])
            ptrs += [named[k].data_ptr() for k in self.C.LOOPBACK_DISPATCH_PTRS]
        vals = dict(T=T, K=K, C=C, hidden=H, x_row_bytes=x_row_bytes, row_bytes=row_bytes,
                    s_row_bytes=s_row_bytes, mode=kmode, rank_major=int(rank_major),
                    num_blocks=num_blocks or self.sms // R, chunk=chunk,
                    fp8_scale_mode=abi.fp8_scale_mode(scale_mode),
                    zero_tail=int(zero_tail), align=align, dtype=dt)
        ints = [vals[k] for k in self.C.LOOPBACK_DISPATCH_INTS]
        err, sec = self.C.loopback_dispatch(ptrs, ints, sym_bytes or syms[0].numel(), R, iters)
        got = [self.host(outs[r], out_ref[r]) for r in range(R)]
        got_s = [self.host(out_ss[r], hd[5][r]) for r in range(R)] if s_row_bytes else None
        if mode == "bwd":
            got_s = [self.host(dws[r], np.zeros((C,), np.float32)) for r in range(R)]
        return err, got, got_s, sec

    def used_rows(self, R, cfg, idx):
        """Per rank: rows of the dispatch output inside groups (expert_major:
        sum of group_sizes; rank_major: the valid rows), from the reference."""
        import jax.numpy as jnp
        from ep_testing import make_mesh, run_per_rank
        from jax_ep.intranode import reference

        def fn(i):
            h, gs, _, _ = reference.BACKEND.router.route(i, cfg, R)
            return jnp.sum(gs) if gs is not None else jnp.sum(h.row_src >= 0)
        return [int(u) for u in run_per_rank(fn, make_mesh((R,), ("ep",)), "ep", idx).reshape(-1)]

    def combine(self, R, y, w, hd, layout, H, chunk=0, iters=1, num_blocks=None, sym_bytes=None):
        """y [R, C, H] (w [R, C] or None) -> (error, per-rank out [T, H], seconds per call)."""
        from jax_ep import abi
        np = self.np
        send_mask, recv_li, slot_row = hd[0], hd[1], hd[2]
        T, K, Cn = send_mask.shape[1], slot_row.shape[-1], y.shape[1]
        row_bytes = H * y.dtype.itemsize
        syms = self.sym_buffers(R, sym_bytes or self.C.symmetric_buffer_bytes(R, T, row_bytes, 0))
        keep, ptrs, outs = [], [], []
        for r in range(R):
            named = dict(y=self.dev(y[r]), row_weights=self.dev(w[r]) if w is not None else None,
                         slot_row=self.dev(slot_row[r]), recv_local_idx=self.dev(recv_li[r]),
                         send_mask=self.dev(send_mask[r]), out=self.poisoned(T * row_bytes),
                         sym=syms[r])
            keep.append(named)
            outs.append(named["out"])
            ptrs += [0 if named[k] is None else named[k].data_ptr()
                     for k in self.C.LOOPBACK_COMBINE_PTRS]
        vals = dict(T=T, K=K, C=Cn, W=H, dtype=abi.row_dtype(np.dtype(y.dtype).name),
                    row_bytes=row_bytes, rank_major=int(layout == "rank_major"),
                    num_blocks=num_blocks or self.sms // R, chunk=chunk)
        ints = [vals[k] for k in self.C.LOOPBACK_COMBINE_INTS]
        err, sec = self.C.loopback_combine(ptrs, ints, sym_bytes or syms[0].numel(), R, iters)
        like = np.zeros((T, H), y.dtype)
        return err, [self.host(o, like) for o in outs], sec


# ---------------------------------------------------------------------------- workers
# One per test, each in its own process (harness.run, n = 1, JAX on CPU). Same
# seed in every worker; each case is a Checks entry per chunking.
_SEED = 7


def _start():
    return Loopback(), Checks(), np.random.default_rng(_SEED)


# ---- dispatch: bit-identical to the reference ---------------------------------
DISPATCH_CASES = [
    # name, R, T, H, K, E, layout, align, dtype, capacity, skew, minus_one, chunks
    ("dispatch_rm_R2_T4096_H7168_K8_E256", 2, 4096, 7168, 8, 256, "rank_major", 1, "bfloat16",
     None, False, 0.1, (0, 1, 3, 8)),
    ("dispatch_em_a128_R2_T128_H2880_K2_E8_skew", 2, 128, 2880, 2, 8, "expert_major", 128,
     "bfloat16", None, True, 0.3, (0, 3)),
    ("dispatch_em_R4_T7_H2048_K1_E8_f32", 4, 7, 2048, 1, 8, "expert_major", 1, "float32",
     None, False, 0.0, (0,)),
    ("dispatch_em_R4_T1024_H7168_K8_E256", 4, 1024, 7168, 8, 256, "expert_major", 1,
     "bfloat16", None, True, 0.1, (0, 2)),
    ("dispatch_overflow_em_R2_T128_H2048_K8_E64_cap100", 2, 128, 2048, 8, 64, "expert_major",
     1, "bfloat16", 100, True, 0.0, (0,)),
    # EP = 1: everything is local work, shared by sender and receiver warps
    ("dispatch_em_a128_R1_T512_H7168_K8_E64_local", 1, 512, 7168, 8, 64, "expert_major", 128,
     "bfloat16", None, True, 0.1, (0, 2)),
    ("dispatch_rm_R1_T300_H2880_K2_E8_local", 1, 300, 2880, 2, 8, "rank_major", 1,
     "bfloat16", None, False, 0.4, (0,)),
]


def _dispatch_case(lb, checks, rng, case):
    import jax.numpy as jnp

    from ep_testing import random_routing
    from jax_ep.config import EpConfig

    name, R, T, H, K, E, layout, align, dt, cap, skew, m1, chunks = case
    idx = random_routing(rng, R, T, K, E, minus_one=m1, skew=skew)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    x = x.astype(jnp.bfloat16) if dt == "bfloat16" else x
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                   expert_alignment=align, capacity=cap, backend="reference")
    hd = lb.handles_and_ref(R, cfg, x, idx, "copy")
    for chunk in chunks:
        err, got, _, _ = lb.dispatch(R, x, None, hd, "copy", layout == "rank_major", H, chunk)
        same = [bool(np.array_equal(bits(g), bits(e))) for g, e in zip(got, hd[4])]
        checks.report(f"{name}_chunk{chunk}", not err and all(same), err=err, same=same)


def _allgather_case(lb, checks, rng, R, T, W, name):
    """The static all-gather handle of the native metadata path (the all-gather
    form of the dispatch kernel): every token to every rank, row s*T + t."""
    rows = rng.integers(-2**31, 2**31 - 1, (R, T, W), dtype=np.int64).astype(np.int32)
    flat = np.arange(R * T, dtype=np.int32)
    hd = (np.ones((R, T, R), np.bool_), np.zeros((R, R, T, 1), np.int32),
          np.broadcast_to(flat.reshape(1, R, T, 1), (R, R, T, 1)),
          np.broadcast_to(flat, (R, R * T)),
          np.broadcast_to(rows.reshape(1, R * T, W), (R, R * T, W)))
    err, got, _, _ = lb.dispatch(R, rows, None, hd, "copy", True, W)
    same = [bool(np.array_equal(g, e)) for g, e in zip(got, hd[4])]
    checks.report(name, not err and all(same), err=err, same=same)


def _dispatch_worker(rank, n):
    lb, checks, rng = _start()
    for case in DISPATCH_CASES:
        with checks.guard(case[0]):
            _dispatch_case(lb, checks, rng, case)
    for R, T, W in ((2, 4096, 16), (4, 7, 3)):
        name = f"dispatch_allgather_R{R}_T{T}_int32x{W}"
        with checks.guard(name):
            _allgather_case(lb, checks, rng, R, T, W, name)
    return checks.results


# ---- zero_tail off: rows < sum(group_sizes) (group padding included) are the
# reference's bits; the tail past the last group is never written (still the
# 0xFF poison), in both row streams -------------------------------------------
ZERO_TAIL_CASES = [  # name, R, T, H, K, E, layout, align, mode, capacity, chunks
    ("zerotail_em_a128_R2_T128_H2880_K2_E8", 2, 128, 2880, 2, 8, "expert_major", 128, "copy",
     None, (0, 3)),
    ("zerotail_em_R4_T1024_H7168_K8_E256", 4, 1024, 7168, 8, 256, "expert_major", 1, "copy",
     None, (0,)),
    ("zerotail_em_a64_R2_T2048_H7168_K8_E256", 2, 2048, 7168, 8, 256, "expert_major", 64,
     "copy", None, (0,)),
    ("zerotail_em_a16_R2_T128_H2048_K8_E64_cap700", 2, 128, 2048, 8, 64, "expert_major", 16,
     "copy", 700, (0,)),
    ("zerotail_rm_R2_T512_H2048_K8_E64", 2, 512, 2048, 8, 64, "rank_major", 1, "copy", None,
     (0,)),
    ("zerotail_fp8_em_a32_R2_T256_H2048_K8_E64", 2, 256, 2048, 8, 64, "expert_major", 32,
     "cast", None, (0,)),
    ("zerotail_em_a128_R1_T512_H7168_K8_E64_local", 1, 512, 7168, 8, 64, "expert_major", 128,
     "copy", None, (0,)),
]


def _zero_tail_case(lb, checks, rng, case):
    import jax.numpy as jnp

    from ep_testing import random_routing
    from jax_ep.config import EpConfig

    name, R, T, H, K, E, layout, align, mode, cap, chunks = case
    idx = random_routing(rng, R, T, K, E, minus_one=0.2, skew=True)
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(jnp.bfloat16)
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                   expert_alignment=align, capacity=cap, backend="reference")
    hd = lb.handles_and_ref(R, cfg, x, idx, mode)
    used = lb.used_rows(R, cfg, idx)
    for chunk in chunks:
        err, got, got_s, _ = lb.dispatch(R, x, None, hd, mode, layout == "rank_major", H,
                                         chunk, zero_tail=False, align=align)
        streams = [(got, hd[4])] + ([(got_s, hd[5])] if got_s is not None else [])
        same = [bool(np.array_equal(bits(g[:u]), bits(e[:u])))
                for gs, es in streams for g, e, u in zip(gs, es, used)]
        untouched = [bool((g[u:].view(np.uint8) == 0xFF).all())
                     for gs, _ in streams for g, u in zip(gs, used)]
        checks.report(f"{name}_chunk{chunk}", not err and all(same) and all(untouched), err=err,
                      same=same, tail_untouched=untouched, used=used, C=int(hd[4].shape[1]))


def _zero_tail_worker(rank, n):
    lb, checks, rng = _start()
    for case in ZERO_TAIL_CASES:
        with checks.guard(case[0]):
            _zero_tail_case(lb, checks, rng, case)
    return checks.results


# ---- fp8: cast in the kernel (both cast widths), and fp8 + scales given ----------
FP8_CASES = [  # name, R, T, H, K, E, layout, mode, x dtype, chunks[, scale format]
    ("fp8_cast_bf16_rm_R2_T4096_H7168", 2, 4096, 7168, 8, 256, "rank_major", "cast",
     "bfloat16", (0, 3, 8)),
    ("fp8_cast_f32_em_R2_T7_H256", 2, 7, 256, 2, 8, "expert_major", "cast", "float32", (0,)),
    ("fp8_cast_bf16_em_R4_T128_H2048", 4, 128, 2048, 8, 64, "expert_major", "cast",
     "bfloat16", (0, 1)),
    ("fp8_given_em_R4_T128_H7168", 4, 128, 7168, 8, 256, "expert_major", "given", None, (0,)),
    ("fp8_cast_bf16_em_R1_T64_H2048_local", 1, 64, 2048, 4, 16, "expert_major", "cast",
     "bfloat16", (0,)),
    # UE8M0 (power-of-two) scales: the cast is exact, the same bits as the reference
    ("fp8_ue8m0_bf16_rm_R2_T1024_H7168", 2, 1024, 7168, 8, 256, "rank_major", "cast",
     "bfloat16", (0, 3), "ue8m0"),
    ("fp8_ue8m0_f32_em_R4_T64_H2048", 4, 64, 2048, 4, 16, "expert_major", "cast", "float32",
     (0,), "ue8m0"),
]


def _fp8_case(lb, checks, rng, case):
    import jax
    import jax.numpy as jnp

    from ep_testing import random_routing
    from jax_ep.intranode import reference
    from jax_ep.config import EpConfig

    name, R, T, H, K, E, layout, mode, xdt, chunks = case[:10]
    fmt = case[10] if len(case) > 10 else "f32"   # scale format: "ue8m0" = power-of-two
    idx = random_routing(rng, R, T, K, E, minus_one=0.1)
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
    for chunk in chunks:
        err, got, got_s, _ = lb.dispatch(R, xin, sin, hd, mode, layout == "rank_major", H, chunk,
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


# ---- combine: the reference's bits (semantics §7's order) for every chunking -------
COMBINE_CASES = [  # name, R, T, H, K, E, layout, dtype, weighted, chunks
    ("combine_rm_R2_T4096_H7168_K8_E256_bf16", 2, 4096, 7168, 8, 256, "rank_major",
     "bfloat16", False, (0, 1, 3, 8)),
    ("combine_em_R4_T128_H2048_K8_E64_bf16_w", 4, 128, 2048, 8, 64, "expert_major",
     "bfloat16", True, (0, 1)),
    ("combine_em_R2_T1024_H7168_K8_E256_bf16_w", 2, 1024, 7168, 8, 256, "expert_major",
     "bfloat16", True, (0, 2, 3)),
    ("combine_em_R2_T7_H2048_K1_E8_f32", 2, 7, 2048, 1, 8, "expert_major", "float32", False,
     (0,)),
    ("combine_rm_R2_T128_H2880_K2_E8_bf16", 2, 128, 2880, 2, 8, "rank_major", "bfloat16",
     False, (0, 3)),
    ("combine_em_R1_T512_H7168_K8_E64_bf16_w_local", 1, 512, 7168, 8, 64, "expert_major",
     "bfloat16", True, (0, 2)),
    ("combine_rm_R1_T300_H2048_K2_E8_f32_local", 1, 300, 2048, 2, 8, "rank_major", "float32",
     False, (0,)),
]


def _reference_combine(R, T, cfg, hd, y, w):
    """The reference combine of y [R, C, H] (weights w [R, C] or None) through
    the handles of ``lb.handles_and_ref``: per rank [T, H]."""
    from ep_testing import make_mesh, run_per_rank
    from jax_ep.intranode import reference
    from jax_ep.types import Handle

    send_mask, recv_li, slot_row, row_src = hd[:4]
    Cn = y.shape[1]

    def fn(sm, li, sr, rs, yy, ww=None):
        h = Handle(send_mask=sm, recv_local_idx=li, slot_row=sr, row_src=rs, native=None,
                   num_ranks=R, num_tokens=T, capacity=Cn, layout=cfg.layout)
        return reference.BACKEND.combine_rows(yy, ww, h, cfg)
    args = [send_mask, recv_li, slot_row, row_src, y] + ([w] if w is not None else [])
    return run_per_rank(fn, make_mesh((R,), ("ep",)), "ep", *args)


def _combine_case(lb, checks, rng, case):
    import jax.numpy as jnp

    from ep_testing import random_routing
    from jax_ep.config import EpConfig

    name, R, T, H, K, E, layout, dt, weighted, chunks = case
    idx = random_routing(rng, R, T, K, E, minus_one=0.2, skew=True)
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                   backend="reference")
    xdt = jnp.bfloat16 if dt == "bfloat16" else np.float32
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(xdt)
    hd = lb.handles_and_ref(R, cfg, x, idx, "copy")
    y = (hd[4].astype(np.float32) * 1.5 + 0.25).astype(xdt)  # [R, C, H]
    w = rng.random((R, y.shape[1])).astype(np.float32) if weighted else None
    expect = _reference_combine(R, T, cfg, hd, y, w)
    results = {}
    for chunk in chunks:
        err, got, _ = lb.combine(R, y, w, hd, layout, H, chunk)
        results[chunk] = got
        a = np.stack(got).astype(np.float32)
        b = np.asarray(expect).astype(np.float32)
        rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        same0 = all(np.array_equal(bits(u), bits(v)) for u, v in zip(got, results[chunks[0]]))
        exact = all(np.array_equal(bits(u), bits(v)) for u, v in zip(got, expect))
        checks.report(f"{name}_chunk{chunk}",
                      not err and np.isfinite(a).all() and exact and same0,
                      err=err, rel_err=rel, same_bits_as_first_chunking=same0,
                      bitwise_equal_reference=exact)


def _combine_worker(rank, n):
    lb, checks, rng = _start()
    for case in COMBINE_CASES:
        with checks.guard(case[0]):
            _combine_case(lb, checks, rng, case)
    return checks.results


# ---- combine backward, fused into the dispatch kernel: dy = cast(w * g) has the
# reference's bits (rows inside groups; tail untouched unless zero_tail), dw =
# <g, y> within f32 reduction order of the reference (|err| <= 1e-4 * sum|g*y|;
# the kernel's order: per lane ascending, then a lane butterfly), dw = 0 on every
# row without a source, and the same bits for every chunking ------------------------
CBWD_CASES = [  # name, R, T, H, K, E, align, dtype, zero_tail, chunks
    ("cbwd_em_R2_T1024_H7168_K8_E256_bf16", 2, 1024, 7168, 8, 256, 1, "bfloat16", False,
     (0, 3)),
    ("cbwd_em_a128_R2_T128_H2880_K2_E8_bf16", 2, 128, 2880, 2, 8, 128, "bfloat16", False,
     (0, 1)),
    ("cbwd_em_a8_R4_T128_H2048_K8_E64_f32_zt", 4, 128, 2048, 8, 64, 8, "float32", True, (0,)),
    ("cbwd_em_R2_T64_H2050_K4_E16_f32", 2, 64, 2050, 4, 16, 1, "float32", False, (0,)),
    ("cbwd_em_R2_T64_H1024_K4_E16_f16_zt", 2, 64, 1024, 4, 16, 1, "float16", True, (0,)),
    ("cbwd_em_a128_R1_T512_H7168_K8_E64_bf16_local", 1, 512, 7168, 8, 64, 128, "bfloat16",
     False, (0, 2)),
]


def _cbwd_expected(R, T, cfg, hd, g, y, w):
    """The reference's dy, dw and sum_h |g_rows * y| per row (the dw tolerance)."""
    import jax.numpy as jnp

    from ep_testing import make_mesh, run_per_rank
    from jax_ep.intranode import reference
    from jax_ep.types import Handle

    ref = reference.BACKEND
    Cn = hd[4].shape[1]

    def fn(sm, li, sr, rs, gg, yy, ww):
        h = Handle(send_mask=sm, recv_local_idx=li, slot_row=sr, row_src=rs, native=None,
                   num_ranks=R, num_tokens=T, capacity=Cn, layout="expert_major")
        dy, dw = ref.combine_backward(gg, yy, ww, h, cfg)
        g_rows = ref.dispatch_rows(gg, None, h, cfg)[0].astype(np.float32)
        return dy, dw, jnp.sum(jnp.abs(g_rows * yy.astype(np.float32)), axis=1)
    return run_per_rank(fn, make_mesh((R,), ("ep",)), "ep", *hd[:4], g, y, w)


def _combine_backward_case(lb, checks, rng, case):
    import jax.numpy as jnp

    from ep_testing import random_routing
    from jax_ep.config import EpConfig

    name, R, T, H, K, E, align, dt, zt, chunks = case
    idx = random_routing(rng, R, T, K, E, minus_one=0.2, skew=True)
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                   expert_alignment=align, backend="reference")
    xdt = {"bfloat16": jnp.bfloat16, "float16": np.float16}.get(dt, np.float32)
    g = rng.standard_normal((R, T, H)).astype(np.float32).astype(xdt)
    hd = lb.handles_and_ref(R, cfg, g, idx, "copy")
    row_src, Cn = hd[3], hd[4].shape[1]
    y = rng.standard_normal((R, Cn, H)).astype(np.float32).astype(xdt)
    w = rng.random((R, Cn)).astype(np.float32)
    used = lb.used_rows(R, cfg, idx)
    e_dy, e_dw, e_mag = _cbwd_expected(R, T, cfg, hd, g, y, w)
    first = None
    for chunk in chunks:
        err, dy, dw, _ = lb.dispatch(R, g, None, hd, "bwd", False, H, chunk, zero_tail=zt,
                                     align=align, yw=(y, w))
        lim = [Cn if zt else u for u in used]
        dy_same = [bool(np.array_equal(bits(a[:u]), bits(b[:u]))) for a, b, u in zip(dy, e_dy, lim)]
        untouched = [zt or bool((a[u:].view(np.uint8) == 0xFF).all()) for a, u in zip(dy, used)]
        valid = [rs >= 0 for rs in row_src]
        dw_ok = [bool(np.all(np.abs(a[v] - b[v]) <= 1e-4 * m[v] + 1e-30))
                 for a, b, m, v in zip(dw, e_dw, e_mag, valid)]
        dw_zero = [bool(np.all(bits(a[~v]) == 0)) for a, v in zip(dw, valid)]
        dw_err = max(float(np.max(np.abs(a[v] - b[v]) / np.maximum(m[v], 1e-30), initial=0.0))
                     for a, b, m, v in zip(dw, e_dw, e_mag, valid))
        cur = [bits(a) for a in dy] + [bits(a) for a in dw]
        first = cur if first is None else first
        same0 = all(np.array_equal(u, v) for u, v in zip(cur, first))
        checks.report(f"{name}_chunk{chunk}", not err and all(dy_same) and all(untouched)
                      and all(dw_ok) and all(dw_zero) and same0, err=err, dy_same=dy_same,
                      tail_untouched=untouched, dw_ok=dw_ok, dw_zero_unsourced=dw_zero,
                      dw_max_err_rel_to_sum_abs=dw_err, same_bits_as_first_chunking=same0,
                      dw_bitwise_equal_reference=all(np.array_equal(bits(a), bits(b))
                                                     for a, b in zip(dw, e_dw)))


def _combine_backward_worker(rank, n):
    lb, checks, rng = _start()
    for case in CBWD_CASES:
        with checks.guard(case[0]):
            _combine_backward_case(lb, checks, rng, case)
    return checks.results


# ---- bounded rings on a tiny buffer. ring_sym(slots) sizes a buffer whose
# staging half holds `slots` ring rows per (peer, block) of the widest row, so the
# kernels pick depth x chunk <= slots (fit_ring): 16 rows -> e.g. 2 slots of 8
# tokens, reused T / (8 * 16 blocks * 2) times per call; 1 row -> 1 slot of 1
# token, a credit round trip per token (R = 2: 16 blocks, 1024 / (8 * 16 * 2)
# = 4 uses of each slot). Skewed routing: ~90% of every rank's tokens go to
# experts of rank 0. Dispatch and combine are checked against the reference's
# bits and against the same op on a buffer that never wraps; the combine
# backward against the same op unwrapped (its dw sums over H in the kernel's
# order, which the reference does not promise).
def _ring_sym(lb, R, nb, row_bytes, slots):
    return 4 * (R - 1) * nb * slots * row_bytes + lb.C.CTRL_BYTES + 4096   # + control region


def _ring_routing(rng, R, T, K, E):
    idx = np.stack([np.argsort(rng.random((T, E)), axis=1)[:, :K] for _ in range(R)])
    hot = rng.random((R, T)) < 0.9
    own = np.stack([np.argsort(rng.random((T, E // R)), axis=1)[:, :K] for _ in range(R)])
    idx = np.where(hot[..., None] & (K <= E // R), own, idx).astype(np.int32)
    idx[:, ::7, -1] = -1
    return idx


def _ring_worker_r2(rank, n):
    return _ring_worker(2, ((1024, 2048, 8, 64, 16), (300, 1024, 4, 32, 1)))


def _ring_worker_r8(rank, n):
    # smaller than R = 2's: expert_major capacity is R*T*min(K, L) rows per rank,
    # and the CPU reference builds all of them (T 1024 / H 2048 was 2 GB per op)
    return _ring_worker(8, ((256, 1024, 8, 64, 8), (96, 1024, 4, 32, 1)))


def _ring_worker(R, cases):
    import jax.numpy as jnp

    from jax_ep.config import EpConfig

    lb, checks, rng = _start()
    nb = max(1, min(16, lb.sms // R))
    for T, H, K, E, slots in cases:
        name = f"ring_R{R}_T{T}_H{H}_K{K}_E{E}_slots{slots}"
        with checks.guard(name):
            idx = _ring_routing(rng, R, T, K, E)
            x = rng.standard_normal((R, T, H)).astype(np.float32).astype(jnp.bfloat16)
            for layout in ("expert_major", "rank_major"):
                cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                               layout=layout, backend="reference")
                hd = lb.handles_and_ref(R, cfg, x, idx, "copy")
                rm = layout == "rank_major"
                tiny = _ring_sym(lb, R, nb, H * 2, slots)
                err, got, _, _ = lb.dispatch(R, x, None, hd, "copy", rm, H, num_blocks=nb,
                                             sym_bytes=tiny, iters=2)
                same = [bool(np.array_equal(bits(g), bits(e))) for g, e in zip(got, hd[4])]
                checks.report(f"{name}_{layout}_dispatch", not err and all(same), err=err,
                              same=same)
                y = (hd[4].astype(np.float32) * 1.5 + 0.25).astype(jnp.bfloat16)
                w = None if rm else rng.random((R, y.shape[1])).astype(np.float32)
                err, got, _ = lb.combine(R, y, w, hd, layout, H, num_blocks=nb, sym_bytes=tiny,
                                         iters=2)
                err2, wide, _ = lb.combine(R, y, w, hd, layout, H, num_blocks=nb)
                same = [bool(np.array_equal(bits(g), bits(e))) for g, e in zip(got, wide)]
                ref = _reference_combine(R, T, cfg, hd, y, w)
                as_ref = [bool(np.array_equal(bits(g), bits(e))) for g, e in zip(got, ref)]
                checks.report(f"{name}_{layout}_combine_reference_bits",
                              not err and not err2 and all(same) and all(as_ref), err=err,
                              err2=err2, same_as_unwrapped=same, same_as_reference=as_ref)
            cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                           layout="rank_major", backend="reference")
            hd8 = lb.handles_and_ref(R, cfg, x, idx, "cast")
            tiny = _ring_sym(lb, R, nb, H + (H // 128) * 4, slots)
            err, got, got_s, _ = lb.dispatch(R, x, None, hd8, "cast", True, H, num_blocks=nb,
                                             sym_bytes=tiny)
            sq = [bool(np.array_equal(bits(g), bits(e))) for g, e in zip(got, hd8[4])]
            ss = [bool(np.array_equal(bits(g), bits(e))) for g, e in zip(got_s, hd8[5])]
            checks.report(f"{name}_fp8_dispatch", not err and all(sq) and all(ss), err=err,
                          q_same=sq, scales_same=ss)
            cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                           backend="reference")
            hd = lb.handles_and_ref(R, cfg, x, idx, "copy")
            yb = rng.standard_normal(hd[4].shape).astype(np.float32).astype(jnp.bfloat16)
            wb = rng.random(hd[4].shape[:2]).astype(np.float32)
            tiny = _ring_sym(lb, R, nb, H * 2, slots)
            err, dy, dw, _ = lb.dispatch(R, x, None, hd, "bwd", False, H, num_blocks=nb,
                                         yw=(yb, wb), sym_bytes=tiny)
            err2, dy2, dw2, _ = lb.dispatch(R, x, None, hd, "bwd", False, H, num_blocks=nb,
                                            yw=(yb, wb))
            same = [bool(np.array_equal(bits(a), bits(b))) for a, b in zip(dy + dw, dy2 + dw2)]
            checks.report(f"{name}_combine_bwd_same_bits_as_unwrapped",
                          not err and not err2 and all(same), err=err, err2=err2, same=same)
    return checks.results


def _bench(ep1_only=False):
    """Relative kernel timings on ONE GPU (both ranks share its HBM and SMs, and
    HBM stands in for NVLink: compare variants with it, never report it as link
    performance). V3-train shapes, R = 2, per-call wall time over 20 queued calls.

        JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \
            python tests/gpu/test_loopback.py --bench
    """
    import jax.numpy as jnp
    import numpy as np

    lb = Loopback()
    from jax_ep.config import EpConfig

    R, T, H, K, E = 2, 4096, 7168, 8, 256
    rng = np.random.default_rng(3)
    idx = np.stack([np.argsort(rng.random((T, E)), axis=1)[:, :K] for _ in range(R)]).astype(np.int32)
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(jnp.bfloat16)
    print(f"loopback on 1 GPU ({lb.sms} SMs, {lb.sms // R} per rank), R={R} T={T} H={H} K={K} E={E}")
    print("| op | layout | chunk | us per call |\n|---|---|---|---|")
    for layout in () if ep1_only else ("rank_major", "expert_major"):
        cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                       backend="reference")
        hd = lb.handles_and_ref(R, cfg, x, idx, "copy")
        hd8 = lb.handles_and_ref(R, cfg, x, idx, "cast") if layout == "rank_major" else None
        y = hd[4]
        w = (rng.random((R, y.shape[1])).astype(np.float32) if layout == "expert_major" else None)
        for chunk in (0, 1, 2, 4, 8, 16) if layout == "rank_major" else (0,):
            ops = [("dispatch", lambda it: lb.dispatch(R, x, None, hd, "copy", layout == "rank_major",
                                                      H, chunk, iters=it, zero_tail=False)[0::3]),
                   ("combine", lambda it: lb.combine(R, y, w, hd, layout, H, chunk, iters=it)[0::2])]
            if hd8 is not None:
                ops.append(("dispatch_fp8", lambda it: lb.dispatch(R, x, None, hd8, "cast", True, H,
                                                                  chunk, iters=it)[0::3]))
            if layout == "expert_major":  # the tail zeroed as before; the fused combine backward
                ops += [("dispatch [zero_tail]",
                         lambda it: lb.dispatch(R, x, None, hd, "copy", False, H, chunk, iters=it,
                                                zero_tail=True)[0::3]),
                        ("combine_bwd (fused)",
                         lambda it: lb.dispatch(R, x, None, hd, "bwd", False, H, chunk, iters=it,
                                                zero_tail=False, yw=(y, w))[0::3])]
            for name, f in ops:
                f(3)
                times = []
                for _ in range(5):
                    err, sec = f(20)
                    times.append(sec)
                print(f"| {name} | {layout} | {chunk or 'default'} | "
                      f"{'ERR ' + err if err else f'{np.median(times) * 1e6:.1f}'} |", flush=True)

    if not ep1_only:
        _bench_rings(lb, rng)
    _bench_ep1(lb, rng, x[:1], idx[:1], E)
    return 0


def _bench_rings(lb, rng):
    """Bounded rings: rank_major dispatch / combine at T 4096, 16384, 65536 in
    the default 1 GiB buffer (the rings wrap from T 16384 at R = 2), beside T
    4096 in a buffer sized never to wrap; time per call and per 1k tokens."""
    import jax.numpy as jnp
    import numpy as np

    from jax_ep.config import EpConfig

    R, H, K, E = 2, 7168, 8, 256
    print(f"\nbounded rings, rank_major, R={R} H={H} K={K} E={E} (1 GPU)")
    print("| op | T | buffer | us per call | us per 1k tokens |\n|---|---|---|---|---|")
    for T, sym in ((4096, None), (4096, lb.C.DEFAULT_BUFFER_BYTES),
                   (16384, lb.C.DEFAULT_BUFFER_BYTES), (65536, lb.C.DEFAULT_BUFFER_BYTES)):
        idx = np.stack([np.argsort(rng.random((T, E)), axis=1)[:, :K] for _ in range(R)])
        x = rng.standard_normal((R, T, H)).astype(np.float32).astype(jnp.bfloat16)
        cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                       layout="rank_major", backend="reference")
        hd = lb.handles_and_ref(R, cfg, x, idx.astype(np.int32), "copy")
        y = hd[4]
        label = "no wrap" if sym is None else f"{sym >> 20} MiB"
        ops = [("dispatch", lambda it: lb.dispatch(R, x, None, hd, "copy", True, H, 0, iters=it,
                                                  zero_tail=False, sym_bytes=sym)[0::3]),
               ("combine", lambda it: lb.combine(R, y, None, hd, "rank_major", H, 0, iters=it,
                                                 sym_bytes=sym)[0::2])]
        for name, f in ops:
            f(2)
            times = [f(10)[1] for _ in range(3)]
            err = f(1)[0]
            us = np.median(times) * 1e6
            print(f"| {name} | {T} | {label} | {'ERR ' + err if err else f'{us:.1f}'} | "
                  f"{'' if err else f'{us / T * 1000:.2f}'} |", flush=True)


def _bench_ep1(lb, rng, x1, idx1, E):
    """EP = 1 (no peer: only the local paths, all SMs): the cost of the work the
    kernels do besides the transfer (own tokens, zero rows, K-row reductions)."""
    import numpy as np

    from jax_ep.config import EpConfig

    R1, T, H, K = 1, x1.shape[1], x1.shape[2], idx1.shape[2]
    print(f"\nEP = 1 on 1 GPU ({lb.sms} SMs): local paths only, T={T} H={H} K={K} E={E}")
    print("| op | layout | us per call |\n|---|---|---|")
    for layout in ("rank_major", "expert_major"):
        cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                       backend="reference")
        hd = lb.handles_and_ref(R1, cfg, x1, idx1, "copy")
        y = hd[4]
        w = (rng.random((R1, y.shape[1])).astype(np.float32) if layout == "expert_major" else None)
        ops = [("dispatch", lambda it: lb.dispatch(R1, x1, None, hd, "copy", layout == "rank_major",
                                                   H, 0, iters=it, zero_tail=False)[0::3]),
               ("combine", lambda it: lb.combine(R1, y, w, hd, layout, H, 0, iters=it)[0::2])]
        if layout == "expert_major":
            ops += [("dispatch [zero_tail]",
                     lambda it: lb.dispatch(R1, x1, None, hd, "copy", False, H, 0, iters=it,
                                            zero_tail=True)[0::3]),
                    ("combine_bwd (fused)",
                     lambda it: lb.dispatch(R1, x1, None, hd, "bwd", False, H, 0, iters=it,
                                            zero_tail=False, yw=(y, w))[0::3])]
        for name, f in ops:
            f(3)
            times = [f(20)[1] for _ in range(5)]
            err = f(1)[0]
            print(f"| {name} | {layout} | "
                  f"{'ERR ' + err if err else f'{np.median(times) * 1e6:.1f}'} |", flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--bench"]:
    if sys.argv[2:3] == ["--rings"]:  # the bounded-ring T sweep only
        sys.exit(_bench_rings(Loopback(), np.random.default_rng(3)))
    sys.exit(_bench(ep1_only=sys.argv[2:3] == ["--ep1"]))  # --ep1: the EP = 1 table only
