"""A peer that never arrives: the waiting kernel gives up on a device-side
timeout and the next native call raises a clear error (no hang)."""
from __future__ import annotations

import time

import numpy as np
import pytest

import harness
from gpu_helpers import ep_mesh, from_process_local

_REASON = harness.skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _absent_peer_worker(rank, n):
    import jax
    from jax.sharding import PartitionSpec as P

    from jax_ep.intranode import native, reference
    from jax_ep.config import EpConfig, KernelTuning

    T, H, K, E = 64, 256, 2, 8 * n
    cfg = EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout="rank_major",
                   tuning=KernelTuning(peer_timeout_s=2))
    mesh = ep_mesh(n)
    rng = np.random.default_rng(rank)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    g = lambda a: from_process_local(mesh, P("ep"), a)
    spec = P("ep")

    # Every rank takes part in the routing (XLA collectives) ...
    route = jax.jit(jax.shard_map(lambda i: reference.BACKEND.router.route(i, cfg, n)[0], mesh=mesh,
                                  in_specs=spec, out_specs=spec))
    handle = jax.block_until_ready(route(g(idx)))
    x = g(rng.standard_normal((T, H)).astype(np.float32))
    send = jax.jit(jax.shard_map(lambda a, h: native.dispatch_raw(a, None, h, cfg)[0],
                                 mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    if rank != 0:
        # ... but only rank 0 calls dispatch: its peer never arrives (the sleep
        # outlasts rank 0's compile, its 2 s wait and its second call)
        time.sleep(17)
        return {"rank": rank}
    exe = send.lower(x, handle).compile()   # compiled first: the time below is the wait alone
    t0 = time.monotonic()
    jax.block_until_ready(exe(x, handle))  # gives up after the device-side timeout
    first_s = time.monotonic() - t0
    err = None
    try:
        jax.block_until_ready(exe(x, handle))
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        err = str(e)
    return {"rank": rank, "first_s": first_s, "error": err}


def test_absent_peer_times_out_with_clear_error():
    res = harness.run("test_native_timeout:_absent_peer_worker", timeout=120, fresh=True)
    r0 = res[0]
    assert r0["error"] is not None, r0
    # the error names the op whose kernel waited (one error word per op family)
    assert "a previous dispatch kernel timed out waiting for a peer" in r0["error"], r0["error"]
    # one 2 s device timeout (peer_timeout_s, not the 10 s default), not one per
    # peer (N - 1 of them in turn: 4 s at N = 3)
    assert 1.5 < r0["first_s"] < 3.9, r0
