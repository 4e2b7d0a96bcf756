"""Native jax_ep.ragged_all_to_all against the reference, the NumPy model and lax.

Multi-process jobs (harness.run: $JAX_EP_TEST_NPROCS processes, sharing the
GPU when there are fewer GPUs): every case's result is bit-identical to the
reference backend and to the NumPy model of lax's semantics
(tests/ragged_model.py) on every rank, gradients too; repeated calls (both
call parities, many epochs), axis_index_groups, both transports, a bad slice
(a device-side error naming it, the runtime still usable after) and an absent
peer (a device-side timeout). XLA's own ragged_all_to_all refuses (or hangs)
across processes, so lax is compared in the one-process job: one GPU, an axis
of 1, where lax runs.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import harness
from gpu_helpers import Checks, assert_checks, bits, local, per_rank_jit

_REASON = harness.skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

_TIMEOUT = float(os.environ.get("JAX_EP_GPU_TEST_TIMEOUT", "420"))
_SEED = 4321
_REGION = 80 << 20     # ragged_bytes of the jobs' runtime (the largest case's output fits)
_BUFFER = 256 << 20    # a small normal buffer: these jobs run no dispatch
# processes sharing this process's GPU (jax_ep.shared_gpu sets it in the job's ranks)
_PER_GPU = int(os.environ.get("JAX_EP_PROCS_PER_GPU", "1"))


def _run(worker: str, expect: int, n=None, **kw):
    results = harness.run(f"test_ragged_native:{worker}", n=n, timeout=_TIMEOUT,
                          init_native=False, **kw)
    assert_checks(results, worker, expect)
    return results


def test_ragged_native_cases():
    _run("_cases_worker", len(CASES))


def test_ragged_native_groups_and_transports():
    _run("_groups_worker", 3)


def test_ragged_native_grad():
    _run("_grad_worker", 2)


def test_ragged_native_repeated_calls():
    _run("_repeat_worker", 2)


def test_ragged_native_bad_slice_raises_and_recovers():
    _run("_bad_slice_worker", 2)


def test_ragged_native_one_process_equals_lax():
    """One process, one GPU (axis of 1): native == lax.ragged_all_to_all == reference."""
    _run("_lax_worker", len(LAX_CASES), n=1, distributed=False)


def test_ragged_native_absent_peer_times_out():
    res = harness.run("test_ragged_native:_absent_peer_worker", timeout=120, fresh=True,
                      init_native=False)
    r0 = res[0]
    assert r0["error"] is not None, r0
    assert "ragged_all_to_all kernel timed out waiting for a peer" in r0["error"], r0
    assert 5 < r0["first_s"] < 25, r0


# ----------------------------------------------------------------------------
# worker side (run in the job's processes)
# ----------------------------------------------------------------------------
def _runtime():
    """The native runtime with a ragged region of _REGION bytes (restarted if
    an earlier request left one without it)."""
    import jax_ep
    from jax_ep import runtime

    live = runtime.region("ragged")
    if live is not None and live.nbytes:
        return
    if jax_ep.is_initialized():
        jax_ep.finalize()
    if not jax_ep.initialize(buffer_bytes=_BUFFER, ragged_bytes=_REGION):
        raise SystemExit(f"jax_ep.initialize failed: {runtime.unavailable_reason()}")


def _start(n):
    from ep_testing import make_mesh

    _runtime()
    return Checks(), np.random.default_rng(_SEED), make_mesh((n,), ("ep",))


def _rank(mesh):
    import jax

    return list(mesh.devices.flat).index(jax.local_devices()[0])


def _op(groups=None, backend="native", transport="auto", a2a=None):
    """The per-rank op of one backend (or ``a2a``, e.g. lax's)."""
    import jax_ep

    cfg = jax_ep.RaggedConfig(backend=backend, transport=transport)
    if a2a is not None:
        return lambda *a: a2a(*a, axis_name="ep", axis_index_groups=groups)
    return lambda *a: jax_ep.ragged_all_to_all(*a, axis_name="ep", axis_index_groups=groups,
                                               config=cfg)


def _compare(checks, name, mesh, case, groups=None, transport="auto"):
    """Native, reference and the NumPy model on this rank: every row, every bit."""
    import ragged_model

    outs = {}
    for be in ("native", "reference"):
        f, ins = per_rank_jit(_op(groups, be, transport), mesh, ("ep",), *case)
        outs[be] = local(f(*ins))
    want = ragged_model.ragged_all_to_all(*case, groups=groups)[_rank(mesh)]
    same_ref = np.array_equal(bits(outs["native"]), bits(outs["reference"]))
    same_model = np.array_equal(bits(outs["native"]), bits(want))
    checks.report(name, same_ref and same_model,
                  f"bitwise_eq_reference={same_ref} bitwise_eq_model={same_model} "
                  f"shape={outs['native'].shape}")


# name, N, M, S, row shape, dtype, how the slices are made
CASES = [
    ("f32_vec", 40, 64, 1, (), "float32", "random"),
    ("bf16_rows_S2", 96, 160, 2, (96,), "bfloat16", "random"),
    ("int8_3d_S3", 30, 50, 3, (4, 6), "int8", "random"),
    ("int32_odd_row", 33, 41, 1, (5,), "int32", "random"),
    ("f16_S4_sparse", 64, 90, 4, (64,), "float16", "sparse"),
    ("empty_sends", 16, 16, 1, (8,), "float32", "empty"),
    ("self_sends", 12, 20, 1, (8,), "bfloat16", "self"),
    ("all_to_rank_0", 10, 80, 1, (16,), "float32", "one_rank"),
    ("zero_row_operand", 0, 24, 1, (8,), "float32", "random"),
    ("zero_row_output", 12, 0, 1, (8,), "float32", "random"),
    # V3 rows; fewer with more than 4 processes on a GPU (each builds every rank's rows on the host)
    ("v3_rows_bf16", 4096 if _PER_GPU <= 4 else 1024, 4608 if _PER_GPU <= 4 else 1152, 1,
     (7168,), "bfloat16", "random"),
]


def _case_inputs(rng, R, case, groups=None):
    import jax.numpy as jnp

    import ragged_model

    name, N, M, S, feat, dt, how = case
    dtype = jnp.bfloat16 if dt == "bfloat16" else np.dtype(dt)
    c = list(ragged_model.random_case(rng, R, N, M, S, feature=feat, dtype=dtype, groups=groups,
                                      empty=0.2 if how != "sparse" else 0.7))
    op, out, io, ss, oo, rs = c
    if how in ("empty", "self", "one_rank"):
        io[:], ss[:], oo[:], rs[:] = 0, 0, 0, 0
    if how == "self":
        for r in range(R):
            io[r, r], ss[r, r], oo[r, r], rs[r, r] = 2, N - 4, 3, N - 4
    if how == "one_rank":   # every rank's whole operand to rank 0, one block each
        for s in range(R):
            ss[s, 0], oo[s, 0], rs[0, s] = N, s * N, N
    return op, out, io, ss, oo, rs


def _cases_worker(rank, n):
    checks, rng, mesh = _start(n)
    for case in CASES:
        with checks.guard(case[0]):
            _compare(checks, case[0], mesh, _case_inputs(rng, n, case))
    return checks.results


def _groups_worker(rank, n):
    """axis_index_groups (pairs, or singletons at n = 2; a reversed order), and
    both transports (P2P stores, NVSHMEM puts)."""
    checks, rng, mesh = _start(n)
    pairs = tuple((i, i + 1) for i in range(0, n, 2)) if n > 2 else ((0,), (1,))
    rev = (tuple(range(n))[::-1],)
    case = ("g", 24, 40, 2, (32,), "bfloat16", "random")
    for name, groups, transport in (("groups_pairs", pairs, "auto"),
                                    ("groups_reversed_put", rev, "put"),
                                    ("axis_put", None, "put")):
        with checks.guard(name):
            _compare(checks, name, mesh, _case_inputs(rng, n, case, groups), groups, transport)
    return checks.results


def _grad_worker(rank, n):
    """vjp of native == vjp of reference == the model's transpose (f32, exact)."""
    import jax

    import ragged_model

    checks, rng, mesh = _start(n)
    for name, S in (("grad_S1", 1), ("grad_S2", 2)):
        with checks.guard(name):
            case = ragged_model.random_case(rng, n, 20, 36, S, feature=(48,))
            ct = rng.standard_normal(case[1].shape).astype(np.float32)
            res = {}
            for be in ("native", "reference"):
                def fn(op, out, io, ss, oo, rs, g, be=be):
                    f = lambda a, b: _op(None, be)(a, b, io, ss, oo, rs)
                    return jax.vjp(f, op, out)[1](g)
                f, ins = per_rank_jit(fn, mesh, ("ep",), *case, ct)
                res[be] = [local(o) for o in f(*ins)]
            w_op, w_out = ragged_model.transpose(ct, *case)
            want = [w_op[_rank(mesh)].astype(np.float32), w_out[_rank(mesh)].astype(np.float32)]
            ok = all(np.array_equal(bits(a), bits(b)) and np.array_equal(bits(a), bits(c))
                     for a, b, c in zip(res["native"], res["reference"], want))
            checks.report(name, ok)
    return checks.results


def _repeat_worker(rank, n):
    """Two calls in one jit (both parities, the second fed by the first) and 7
    jitted calls in a row (epochs advance): the reference's bits every time."""
    import jax

    checks, rng, mesh = _start(n)
    case = _case_inputs(rng, n, ("r", 32, 48, 1, (64,), "float32", "random"))

    def twice(be):
        def fn(op, out, io, ss, oo, rs):
            y = _op(None, be)(op, out, io, ss, oo, rs)
            return _op(None, be)(y[:op.shape[0]] * 2.0, out, io, ss, oo, rs)
        return fn

    with checks.guard("two_calls_one_jit"):
        got = {}
        for be in ("native", "reference"):
            f, ins = per_rank_jit(twice(be), mesh, ("ep",), *case)
            got[be] = bits(local(f(*ins)))
        checks.report("two_calls_one_jit", np.array_equal(got["native"], got["reference"]))
    with checks.guard("seven_calls"):
        f, ins = per_rank_jit(_op(), mesh, ("ep",), *case)
        ref_f, ref_ins = per_rank_jit(_op(backend="reference"), mesh, ("ep",), *case)
        want = bits(local(ref_f(*ref_ins)))
        outs = [bits(local(jax.block_until_ready(f(*ins)))) for _ in range(7)]
        checks.report("seven_calls", all(np.array_equal(o, want) for o in outs))
    return checks.results


def _bad_slice_worker(rank, n):
    """Rank 0's slice to rank 1 (n > 1) runs past rank 0's operand: rank 0
    raises the bounds error, rank 1 the sizes error; every other rank's output
    is the reference's (on the two that raise it is unspecified: their waits
    stop at the error); a later good call runs normally."""
    import jax

    import jax_ep

    checks, rng, mesh = _start(n)
    op, out, io, ss, oo, rs = _case_inputs(rng, n, ("b", 16, 40, 1, (8,), "float32", "random"))
    dst = 1 % n
    io[0, dst], ss[0, dst], rs[dst, 0] = 12, 8, 8     # rows 12..19 of 16
    bad = (op, out, io, ss, oo, rs)
    with checks.guard("bad_slice"):
        f, ins = per_rank_jit(_op(), mesh, ("ep",), *bad)
        got = local(jax.block_until_ready(f(*ins)))
        ref_f, ref_ins = per_rank_jit(_op(backend="reference"), mesh, ("ep",), *bad)
        same = np.array_equal(bits(got), bits(local(ref_f(*ref_ins))))
        err = ""
        try:
            jax_ep.check_device_error()
        except ValueError as e:
            err = str(e)
        want_err = rank in (0, dst)
        named = ("ran past" in err) if rank == 0 else ("recv_sizes" in err)
        checks.report("bad_slice", (same or want_err) and (bool(err) == want_err)
                      and (named or not want_err),
                      f"same_as_reference={same} error={err[:200]!r}")
    with checks.guard("after_bad_slice"):
        _compare(checks, "after_bad_slice", mesh,
                 _case_inputs(rng, n, ("a", 16, 40, 1, (8,), "float32", "random")))
    return checks.results


# name, N, M, S, row shape, dtype
LAX_CASES = [
    ("lax_f32", 37, 50, 1, (24,), "float32", "self"),
    ("lax_bf16_S3", 64, 80, 3, (128,), "bfloat16", "random"),
    ("lax_int32_3d", 20, 20, 2, (3, 5), "int32", "random"),
]


def _lax_worker(rank, n):
    """One process, an axis of 1: the slices all go to this rank itself."""
    import jax

    checks, rng, mesh = _start(1)
    for case in LAX_CASES:
        with checks.guard(case[0]):
            c = _case_inputs(rng, 1, case)
            outs = {}
            for be, a2a in (("native", None), ("reference", None),
                            ("lax", jax.lax.ragged_all_to_all)):
                f, ins = per_rank_jit(_op(None, be if a2a is None else "auto", a2a=a2a), mesh,
                                      ("ep",), *c)
                outs[be] = bits(local(f(*ins)))
            ok = (np.array_equal(outs["native"], outs["lax"]) and
                  np.array_equal(outs["native"], outs["reference"]))
            checks.report(case[0], ok)
    return checks.results


def _absent_peer_worker(rank, n):
    """Only rank 0 calls: its kernel waits for the others' flags, gives up after
    the device-side timeout, and its next call raises."""
    import jax

    _runtime()
    from ep_testing import make_mesh

    mesh = make_mesh((n,), ("ep",))
    case = _case_inputs(np.random.default_rng(1), n, ("t", 8, 16, 1, (4,), "float32", "random"))
    f, ins = per_rank_jit(_op(), mesh, ("ep",), *case)
    if rank != 0:
        time.sleep(25)
        return {"rank": rank}
    exe = f.lower(*ins).compile()
    t0 = time.monotonic()
    jax.block_until_ready(exe(*ins))
    first_s = time.monotonic() - t0
    err = None
    try:
        jax.block_until_ready(exe(*ins))
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        err = str(e)
    return {"rank": rank, "first_s": first_s, "error": err}
