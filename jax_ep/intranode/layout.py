"""Native dispatch layout: the ``jax_ep_layout`` CUDA kernel as a per-rank op.

Same contract as ``RowBackend.layout`` (jax_ep/backend.py): call per rank inside
``jax.shard_map``; returns ``(num_tokens_per_rank [R] i32,
num_tokens_per_expert [E] i32, is_token_in_rank [T, R] bool)`` over this rank's
tokens, ids outside ``[0, E)`` counting nowhere and a token counting once per
rank (and once per expert). Needs only a CUDA GPU, not ``initialize()``.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .. import _ffi
from ..config import EpConfig


def layout(topk_idx, cfg: EpConfig, R: int):
    if topk_idx.ndim != 2:
        raise ValueError(f"layout: topk_idx must be [T, K], got shape {topk_idx.shape}")
    T = topk_idx.shape[0]
    E = cfg.num_experts
    cfg.local_experts(R)  # checks E % R == 0
    return _ffi.call(
        "jax_ep_layout",
        [((R,), jnp.int32), ((E,), jnp.int32), ((T, R), jnp.bool_)],
        topk_idx.astype(jnp.int32),
        num_experts=np.int32(E), num_ranks=np.int32(R))
