"""Native runtime on real GPUs: layout kernel vs the reference, NVSHMEM peer
exchange, initialize/finalize cycles and the not-initialised error."""
from __future__ import annotations

import numpy as np
import pytest

import harness
from gpu_helpers import ep_mesh, from_process_local, gather

_REASON = harness.skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]
# jax_ep_ping (the runtime self-test) is built with the CMake option JAX_EP_TESTING.
_NO_PING = harness.testing_skip_reason() if _REASON is None else None
needs_ping = pytest.mark.skipif(_NO_PING is not None, reason=_NO_PING or "")

# (T, K, E): V3-like, tiny, K == E, T = 1.
LAYOUT_CASES = [(4096, 8, 256), (128, 4, 16), (64, 8, 8), (1, 2, 8), (333, 6, 64)]


def _routing(rng, T, K, E, skew):
    """Distinct experts per token (Zipf-skewed or uniform), ~20% -1 slots and a
    few ids outside [-1, E) (which must count nowhere)."""
    p = 1.0 / np.arange(1, E + 1) ** 1.2 if skew else np.ones(E)
    p = p / p.sum()
    idx = np.stack([rng.choice(E, size=K, replace=False, p=p) for _ in range(T)]).astype(np.int32)
    idx[rng.random((T, K)) < 0.2] = -1
    bad = rng.random((T, K)) < 0.01
    idx[bad] = rng.choice(np.array([E, E + 7, -2, -100], np.int32), size=int(bad.sum()))
    return idx


def _numpy_layout(idx, E, R):
    L = E // R
    T = idx.shape[0]
    per_expert = np.zeros(E, np.int32)
    in_rank = np.zeros((T, R), bool)
    for t in range(T):
        ids = {int(e) for e in idx[t] if 0 <= e < E}
        for e in ids:
            per_expert[e] += 1
            in_rank[t, e // L] = True
    return in_rank.sum(0).astype(np.int32), per_expert, in_rank


def _ping(mesh, x):
    """Per rank: y = x of the previous rank (jax_ep_ping, through NVSHMEM)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jax_ep import _ffi

    def body(v):
        return _ffi.call("jax_ep_ping", [(v.shape, v.dtype)], v, ep_axis="ep",
                         has_side_effect=True)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    return f(x)


def _ping_ok(rank, n, mesh, size=1 << 14):
    from jax.sharding import PartitionSpec as P

    local = (np.arange(size, dtype=np.int32) * 7 + rank * 1000003)
    y = gather(_ping(mesh, from_process_local(mesh, P("ep"), local)))
    want = np.concatenate([np.arange(size, dtype=np.int32) * 7 + ((r - 1) % n) * 1000003
                           for r in range(n)])
    return bool(np.array_equal(y, want))


# ----------------------------------------------------------------- workers

def _layout_worker(rank, n):
    import jax
    from jax.sharding import PartitionSpec as P

    from jax_ep.intranode import layout as native_layout
    from jax_ep.config import EpConfig

    from jax_ep.intranode import reference

    ref = reference.BACKEND.layout
    mesh = ep_mesh(n)
    report = []
    for case, (T, K, E) in enumerate(LAYOUT_CASES):
        for skew in (False, True):
            if E % n:
                continue
            rng = np.random.default_rng(1000 * case + 10 * skew + rank)
            local = _routing(rng, T, K, E, skew)
            cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=128)

            def run(fn):
                def body(t):
                    a, b, c = fn(t, cfg, n)
                    return a[None], b[None], c
                f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"),
                                          out_specs=(P("ep"), P("ep"), P("ep")), check_vma=True))
                return [gather(o) for o in f(from_process_local(mesh, P("ep"), local))]

            got = run(native_layout.layout)
            want = run(ref)
            allidx = gather(from_process_local(mesh, P("ep"), local))
            model = [np.stack([_numpy_layout(allidx[r * T:(r + 1) * T], E, n)[i] for r in range(n)])
                     for i in range(3)]
            model[2] = model[2].reshape(n * T, n)
            ok_model = all(np.array_equal(g, m) for g, m in zip(got, model))
            ok_ref = all(np.array_equal(g, w) for g, w in zip(got, want))
            report.append(dict(T=T, K=K, E=E, skew=skew, ok_model=ok_model, ok_ref=ok_ref))
    return report


def _ping_worker(rank, n):
    return _ping_ok(rank, n, ep_mesh(n))


def _reinit_worker(rank, n, cycles=2):
    import jax_ep
    from jax_ep import runtime

    out = []
    mesh = ep_mesh(n)
    for _ in range(cycles):
        if not jax_ep.initialize(buffer_bytes=64 << 20):
            raise RuntimeError(runtime.unavailable_reason())
        info = runtime.info()
        out.append(dict(ok=_ping_ok(rank, n, mesh), pe=info["my_pe"], n_pes=info["n_pes"]))
        jax_ep.finalize()
        out.append(dict(after_finalize=runtime.is_initialized()))
    return out


def _not_initialized_worker(rank, n):
    """No runtime yet: a native FFI call must raise, not crash. Then start it
    (single process: 1 PE) and check it works."""
    import jax_ep
    from jax_ep import runtime

    mesh = ep_mesh(n)
    res = {}
    try:
        from jax.sharding import PartitionSpec as P
        x = from_process_local(mesh, P("ep"), np.zeros((16,), np.int32))
        _ping(mesh, x).block_until_ready()
        res["ffi_error"] = None
    except Exception as e:  # XlaRuntimeError
        res["ffi_error"] = f"{type(e).__name__}: {e}"
    try:
        from jax_ep import backend
        backend.select(backend.INTRANODE, jax_ep.EpConfig(num_experts=8, topk=2,
                                                          max_tokens_per_rank=4, hidden=128,
                                                          backend="native"))
        res["backend_error"] = None
    except RuntimeError as e:
        res["backend_error"] = str(e)
    try:  # far more than an H200 has: must fail cleanly, naming the JAX knob
        jax_ep.initialize(buffer_bytes=400 << 30)
        res["oom_error"] = None
    except RuntimeError as e:
        res["oom_error"] = str(e)
    res["initialized"] = jax_ep.initialize(buffer_bytes=32 << 20)
    res["info"] = runtime.info()
    res["ping_ok"] = _ping_ok(rank, n, mesh, size=1024)
    jax_ep.finalize()
    return res


# ----------------------------------------------------------------- tests

def test_layout_matches_reference():
    n = harness.nprocs()
    for rank, report in enumerate(harness.run("test_runtime:_layout_worker", n)):
        bad = [c for c in report if not (c["ok_model"] and c["ok_ref"])]
        assert report and not bad, f"rank {rank}: layout mismatches {bad}"


@needs_ping
def test_peer_exchange():
    assert all(harness.run("test_runtime:_ping_worker", harness.nprocs()))


@pytest.mark.parametrize("keep_nvshmem", ["0", "1"])
@needs_ping
def test_initialize_finalize_initialize(keep_nvshmem):
    n = harness.nprocs()
    results = harness.run("test_runtime:_reinit_worker", n, init_native=False, fresh=True,
                          env={"JAX_EP_KEEP_NVSHMEM": keep_nvshmem})
    for rank, out in enumerate(results):
        assert out == [dict(ok=True, pe=rank, n_pes=n), dict(after_finalize=False)] * 2, out


@needs_ping
def test_not_initialized_error_then_single_process():
    (res,) = harness.run("test_runtime:_not_initialized_worker", 1, init_native=False,
                         distributed=False, fresh=True, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert res["ffi_error"] and "not initialised" in res["ffi_error"], res
    assert res["backend_error"] and "jax_ep.initialize()" in res["backend_error"], res
    assert res["oom_error"] and "XLA_PYTHON_CLIENT_MEM_FRACTION" in res["oom_error"], res
    assert res["initialized"] and res["info"]["n_pes"] == 1, res
    assert res["ping_ok"], res
