"""Native kernels on meshes whose devices are not in process order (2 GPUs).

Peers must come from the mesh's real devices (DESIGN §4): a reversed device
list, ('ep', 'data') axis order and EP on a sub-axis give the reference's
results — dispatch bit-identical on every valid row, combine and gradients
equal within f32 tolerance — never a silently wrong result."""
from __future__ import annotations

import numpy as np
import pytest

import harness
from gpu_helpers import from_stacked, gather, mesh_case_data

_REASON = harness.skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _mesh_worker(rank: int, n: int):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ep

    devs = np.array(jax.devices())
    meshes = {
        "natural": (Mesh(devs, ("ep",)), ("ep",)),
        "reversed": (Mesh(devs[::-1], ("ep",)), ("ep",)),
        "data_ep_reversed": (Mesh(devs[::-1].reshape(1, n), ("data", "ep")), ("data", "ep")),
        "ep_data_reversed": (Mesh(devs[::-1].reshape(n, 1), ("ep", "data")), ("ep", "data")),
    }
    idx, x, w = mesh_case_data(n)
    T, H, K, E = x.shape[1], x.shape[2], idx.shape[2], 16
    results = {}

    for mname, (mesh, axes) in meshes.items():
        spec = P(axes)
        for layout in ("expert_major", "rank_major"):
            outs = {}
            for be in ("native", "reference"):
                cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                                      layout=layout, backend=be)

                def body(a, b, c, cfg=cfg):
                    d = jax_ep.dispatch(a, b, c, cfg)
                    y = d.x * 2 if layout == "expert_major" else d.x
                    out = jax_ep.combine(y, d, cfg)
                    def loss(a_, c_):
                        dd = jax_ep.dispatch(a_, b, c_, cfg)
                        return jnp.sum(jax_ep.combine(dd.x, dd, cfg).astype(jnp.float32) ** 2)

                    g = jax.grad(loss, argnums=(0, 1))(a, c)
                    used = (jnp.sum(d.group_sizes) if layout == "expert_major"
                            else jnp.reshape(d.num_valid, ()))
                    return d.x, used.reshape(1), out, g[0], g[1]

                f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3,
                                          out_specs=spec))
                res = f(from_stacked(mesh, spec, x), from_stacked(mesh, spec, idx),
                        from_stacked(mesh, spec, w))
                outs[be] = [gather(r) for r in res]
            (dx_n, used_n, out_n, gx_n, gw_n), (dx_r, used_r, out_r, gx_r, gw_r) = (
                outs["native"], outs["reference"])
            C = dx_n.shape[0] // n
            ok = np.array_equal(used_n, used_r)
            for s in range(n):  # valid rows of every shard, bit for bit
                u = int(used_r[s])
                ok &= np.array_equal(dx_n[s * C:s * C + u].view(np.uint16),
                                     dx_r[s * C:s * C + u].view(np.uint16))
            tol = dict(rtol=2e-2, atol=2e-2)
            ok_c = np.allclose(out_n.astype(np.float32), out_r.astype(np.float32), **tol)
            ok_g = (np.allclose(gx_n.astype(np.float32), gx_r.astype(np.float32), **tol)
                    and np.allclose(gw_n, gw_r, rtol=2e-2, atol=1e-1))
            results[f"{mname}_{layout}"] = [bool(ok and ok_c and ok_g),
                                            f"dispatch={bool(ok)} combine={bool(ok_c)} grad={bool(ok_g)}"]
    return results


def test_permuted_meshes_match_reference():
    res = harness.run("test_native_mesh:_mesh_worker", timeout=400)
    bad = {k: v for r in res for k, v in r.items() if not v[0]}
    assert not bad, bad
    assert len(res[0]) == 8
