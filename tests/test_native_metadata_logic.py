"""The native backend's metadata exchange (all_to_all emulated by an all-gather
of each token's R slices) gives the reference's handle and weights bit for bit.
On CPU the native all-gather kernel is stood in for by jax.lax.all_gather;
tests/gpu/test_native_metadata.py runs the real kernel."""
import jax
import numpy as np
import pytest

import jax_ep
from jax_ep import native, reference
from ep_testing import make_mesh, random_routing, run_per_rank


class _CpuNative(native.NativeBackend):
    _gather_rows = staticmethod(lambda rows, cfg, R: jax.lax.all_gather(rows, cfg.axis_name))


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_metadata_exchange_matches_reference(layout, monkeypatch):
    monkeypatch.setenv("JAX_EP_NATIVE_METADATA", "1")
    R, T, K, E = 8, 7, 2, 16
    rng = np.random.default_rng(1)
    mesh = make_mesh((R,), ("ep",))
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=8, layout=layout,
                          expert_alignment=4 if layout == "expert_major" else 1, capacity=40)
    idx = random_routing(rng, R, T, K, E, skew=True, invalid=0.05)
    w = rng.random((R, T, K)).astype(np.float32)

    def run(be):
        def fn(i, w):
            h, gs, nv, nd = be.route(i, cfg, R)
            rw = be.dispatch_weights(w, h, cfg)
            back = be.return_weights(rw * 2.0, h, cfg)
            out = [h.send_mask, h.recv_local_idx, h.slot_row, h.row_src, nv, nd, rw, back]
            return out + ([gs] if gs is not None else [])
        return run_per_rank(fn, mesh, "ep", idx, w)

    got, want = run(_CpuNative()), run(reference.BACKEND)
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w_))
