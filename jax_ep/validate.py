"""Trace-time argument checks: bad input fails with a message naming the argument."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import EpConfig

_X_DTYPES = (jnp.bfloat16, jnp.float32, jnp.float16)
_FP8 = jnp.float8_e4m3fn


def axis_size(cfg: EpConfig) -> int:
    """Size R of ``cfg.axis_name``; clear error outside a matching shard_map."""
    try:
        R = jax.lax.axis_size(cfg.axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name {cfg.axis_name!r} is not a mesh axis bound here: call jax_ep inside "
            f"jax.shard_map over a mesh that has an axis named {cfg.axis_name!r} "
            f"(EpConfig.axis_name)") from e
    cfg.local_experts(R)  # E % R check
    return R


def _shape(name, a, ndim):
    if not hasattr(a, "shape") or a.ndim != ndim:
        raise ValueError(f"{name} must be a rank-{ndim} array, got shape "
                         f"{getattr(a, 'shape', type(a).__name__)}")


def topk_idx(idx, cfg: EpConfig, R: int):
    _shape("topk_idx", idx, 2)
    if idx.dtype != jnp.int32:
        raise TypeError(f"topk_idx must be int32, got {idx.dtype}")
    if idx.shape[1] != cfg.topk:
        raise ValueError(f"topk_idx has {idx.shape[1]} columns, EpConfig.topk is {cfg.topk}")
    if idx.shape[0] > cfg.max_tokens_per_rank:
        raise ValueError(f"topk_idx has {idx.shape[0]} tokens, more than "
                         f"EpConfig.max_tokens_per_rank={cfg.max_tokens_per_rank}")


def dispatch_args(x, idx, w, x_scales, cfg: EpConfig, R: int):
    _shape("x", x, 2)
    topk_idx(idx, cfg, R)
    _shape("topk_weights", w, 2)
    T, H = x.shape
    if H != cfg.hidden:
        raise ValueError(f"x has hidden size {H}, EpConfig.hidden is {cfg.hidden}")
    if idx.shape[0] != T:
        raise ValueError(f"topk_idx has {idx.shape[0]} rows but x has {T} tokens")
    if w.shape != idx.shape:
        raise ValueError(f"topk_weights shape {w.shape} != topk_idx shape {idx.shape}")
    if w.dtype != jnp.float32:
        raise TypeError(f"topk_weights must be float32, got {w.dtype}")
    if x.dtype == _FP8:
        if H % 128 != 0:
            raise ValueError(f"fp8 x needs hidden % 128 == 0, got {H}")
        if x_scales is None:
            raise ValueError("fp8 x needs x_scales [T, H/128] float32")
    elif not any(x.dtype == d for d in _X_DTYPES):
        raise TypeError(f"x dtype {x.dtype} unsupported: use bfloat16, float32, float16 "
                        "or float8_e4m3fn with x_scales")
    elif x_scales is not None:
        raise ValueError("x_scales is only meaningful with an fp8 (float8_e4m3fn) x")
    elif cfg.fp8_dispatch and x.dtype not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"EpConfig.fp8_dispatch casts bfloat16 or float32 x, got {x.dtype}")
    if x_scales is not None:
        _shape("x_scales", x_scales, 2)
        if x_scales.shape != (T, H // 128) or x_scales.dtype != jnp.float32:
            raise ValueError(f"x_scales must be float32 [{T}, {H // 128}], got "
                             f"{x_scales.dtype} {x_scales.shape}")


def combine_args(y, d, cfg: EpConfig, R: int):
    _shape("y", y, 2)
    C, H = d.x.shape
    if y.shape != (C, cfg.hidden):
        raise ValueError(f"y must be [{C}, {cfg.hidden}] (rows of dispatched.x, hidden), "
                         f"got {y.shape}")
    if not any(y.dtype == dt for dt in _X_DTYPES):
        raise TypeError(f"y dtype {y.dtype} unsupported: use bfloat16, float32 or float16")
    if d.handle.num_ranks != R:
        raise ValueError(f"dispatched was made on an EP axis of {d.handle.num_ranks} ranks, axis "
                         f"{cfg.axis_name!r} here has {R}")
    if d.handle.layout != cfg.layout:
        raise ValueError(f"dispatched was made with layout {d.handle.layout!r}, config has "
                         f"{cfg.layout!r}")


def _raise_if_dropped(n, axis):
    if int(np.asarray(n)) > 0:
        raise OverflowError(
            f"jax_ep.dispatch dropped {n} (token, expert) pairs on a rank of axis {axis!r}: "
            "capacity too small (raise EpConfig.capacity or use None for dropless) or expert "
            "ids outside [-1, num_experts)")
    return np.asarray(n, np.int32)


def raise_on_drops(num_dropped, cfg: EpConfig):
    """Checked mode: pass ``num_dropped`` through a host callback that raises when
    rows were dropped. An ``io_callback`` (it has a side effect) so XLA keeps it
    even when the caller never reads ``num_dropped``."""
    from jax.experimental import io_callback

    from ._ffi import result_type  # the varying-axes type inside shard_map

    out = result_type((), jnp.int32, like=num_dropped)
    return io_callback(lambda n: _raise_if_dropped(n, cfg.axis_name), out, num_dropped)
