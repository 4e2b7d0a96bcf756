"""Shared helpers for the CPU tests: meshes, sharded runs, random routings."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def make_mesh(shape, names):
    types = (jax.sharding.AxisType.Auto,) * len(names)
    return jax.make_mesh(shape, names, axis_types=types)


def run_per_rank(fn, mesh, ep_axis, *arrays, out_specs=None):
    """Run fn per rank inside shard_map; arrays are [R, ...] stacked per EP rank
    (leading dim split over all mesh axes, EP axis innermost). Returns numpy
    outputs re-stacked to [num_shards, ...]."""
    axes = tuple(mesh.axis_names)
    n = int(np.prod(mesh.devices.shape))
    flat = [jnp.asarray(a).reshape((-1,) + a.shape[2:]) for a in arrays]
    spec = P(axes)
    put = [jax.device_put(a, NamedSharding(mesh, spec)) for a in flat]

    def body(*xs):
        out = fn(*xs)
        return jax.tree_util.tree_map(lambda o: o[None] if o.ndim == 0 else o, out)

    if out_specs is None:
        out_specs = spec
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(put), out_specs=out_specs))
    out = f(*put)
    return jax.tree_util.tree_map(lambda o: np.asarray(o).reshape((n, -1) + o.shape[1:]), out)


def random_routing(rng, R, T, K, E, *, minus_one=0.2, skew=False, invalid=0.0, repeat=0.0):
    """topk_idx [R, T, K] int32 with distinct experts per token, some -1 slots,
    optional skew (half the tokens pick expert 0), out-of-range ids and
    repeated ids (``repeat``: the chance that a slot names its token's first
    id again; semantics §2 merges their weights onto the first)."""
    idx = np.empty((R, T, K), np.int32)
    for r in range(R):
        for t in range(T):
            idx[r, t] = rng.choice(E, size=K, replace=False)
    if skew:
        hot = rng.random((R, T)) < 0.5
        idx[..., 0] = np.where(hot, 0, idx[..., 0])
        # keep distinct: move a clashing later slot away from 0
        for k in range(1, K):
            clash = hot & (idx[..., k] == 0)
            idx[..., k] = np.where(clash, -1, idx[..., k])
    idx = np.where(rng.random((R, T, K)) < minus_one, -1, idx)
    if invalid:
        bad = rng.random((R, T, K)) < invalid
        idx = np.where(bad, rng.choice([-5, E, E + 3], size=(R, T, K)), idx)
    if repeat and K > 1:
        again = rng.random((R, T, K)) < repeat
        again[..., 0] = False
        idx = np.where(again, idx[..., :1], idx)
    return idx.astype(np.int32)
