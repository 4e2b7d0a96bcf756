"""Trace-time argument checks: bad input fails with a message naming the argument."""
from __future__ import annotations

import atexit
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch as _jax_dispatch

from .config import EpConfig
from .mesh_axes import bound_axes, global_reduce, global_sum
from .routing import invalid_ids

_X_DTYPES = (jnp.bfloat16, jnp.float32, jnp.float16)
_FP8 = jnp.float8_e4m3fn


def mesh_axis_size(cfg) -> int:
    """Size R of ``cfg.axis_name`` (any config type); clear error outside a
    matching shard_map."""
    owner = type(cfg).__name__
    try:
        return jax.lax.axis_size(cfg.axis_name)
    except NameError:
        bound = bound_axes()
        where = (f"the axes bound here are {bound}" if bound else
                 "no mesh axis is bound here (not inside jax.shard_map?)")
        raise ValueError(
            f"axis_name {cfg.axis_name!r} ({owner}.axis_name) is not a mesh axis bound here; "
            f"{where}: call jax_ep inside jax.shard_map over a mesh that has an axis named "
            f"{cfg.axis_name!r}, or set {owner}.axis_name to one of them") from None


def axis_size(cfg: EpConfig) -> int:
    """Size R of ``cfg.axis_name``, checked against the config's E and nodes."""
    R = mesh_axis_size(cfg)
    cfg.local_experts(R)  # E % R check
    cfg.ranks_per_node(R)  # R % num_nodes check
    return R


def _shape(name, a, ndim):
    if not hasattr(a, "shape") or a.ndim != ndim:
        raise ValueError(f"{name} must be a rank-{ndim} array, got shape "
                         f"{getattr(a, 'shape', type(a).__name__)}")


def _tokens_per_rank(name, n, cfg: EpConfig):
    if n > cfg.max_tokens_per_rank:
        raise ValueError(f"{name} has {n} tokens per rank, more than "
                         f"EpConfig.max_tokens_per_rank={cfg.max_tokens_per_rank} (shapes inside "
                         "jax.shard_map are per rank)")


def topk_idx(idx, cfg: EpConfig, R: int):
    """Checks ``topk_idx``; returns it as int32 (any integer dtype is accepted)."""
    _shape("topk_idx", idx, 2)
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"topk_idx must be an integer array (expert ids, int32 preferred), "
                        f"got {idx.dtype}")
    if idx.shape[1] != cfg.topk:
        raise ValueError(f"topk_idx has {idx.shape[1]} columns, EpConfig.topk is {cfg.topk}")
    _tokens_per_rank("topk_idx", idx.shape[0], cfg)
    if idx.dtype != jnp.int32:
        info = jnp.iinfo(idx.dtype)
        if info.bits < 32 or (info.bits == 32 and info.min < 0):
            idx = idx.astype(jnp.int32)  # exact: every value fits
        else:
            # wide ids (int64, uint32/64) are clipped in their own dtype first, where -2 and E
            # are representable, so none can wrap into [0, E): out-of-range stays invalid
            E = cfg.num_experts
            lo = -2 if info.min < 0 else 0
            idx = jnp.clip(idx, jnp.asarray(lo, idx.dtype), jnp.asarray(E, idx.dtype))
            idx = idx.astype(jnp.int32)
    return idx


def dispatch_args(x, idx, w, x_scales, cfg: EpConfig, R: int):
    """Checks the arguments of dispatch; returns ``(topk_idx int32, topk_weights f32)``."""
    _shape("x", x, 2)
    _tokens_per_rank("x", x.shape[0], cfg)
    idx = topk_idx(idx, cfg, R)
    _shape("topk_weights", w, 2)
    T, H = x.shape
    if H != cfg.hidden:
        raise ValueError(f"x has hidden size {H}, EpConfig.hidden is {cfg.hidden}")
    if idx.shape[0] != T:
        raise ValueError(f"topk_idx has {idx.shape[0]} rows but x has {T} tokens")
    if w.shape != idx.shape:
        raise ValueError(f"topk_weights shape {w.shape} != topk_idx shape {idx.shape}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"topk_weights must be a floating-point array (float32 preferred), "
                        f"got {w.dtype}")
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
    buffer_size(cfg, R, T, x.dtype)
    return idx, w.astype(jnp.float32)


_WARN_BYTES = 1 << 30  # padding beyond this many bytes per rank is reported


def buffer_size(cfg: EpConfig, R: int, T: int, dtype) -> int:
    """C, with a warning when capacity / expert_alignment make ``x [C, H]``
    mostly padding and more than 1 GiB (e.g. ``expert_alignment=2**20``)."""
    C = cfg.capacity_for(R, max(T, 1))
    L = cfg.local_experts(R)
    useful = R * max(T, 1) * (1 if cfg.layout == "rank_major" else min(cfg.topk, L))
    item = np.dtype(dtype).itemsize
    waste = (C - useful) * cfg.hidden * item
    if C > 2 * useful and waste > _WARN_BYTES:
        warnings.warn(
            f"jax_ep.dispatch: C={C} rows of capacity (EpConfig.capacity={cfg.capacity}, "
            f"expert_alignment={cfg.expert_alignment}) allocate {C * cfg.hidden * item:,} bytes "
            f"per rank for x [C, {cfg.hidden}] alone, though at most {useful} rows can hold "
            "data; lower capacity / expert_alignment", RuntimeWarning, stacklevel=3)
    return C


# EpConfig fields a combine must share with its dispatch (the handle's layout,
# capacity and rows follow from them).
DISPATCH_FIELDS = ("num_experts", "topk", "max_tokens_per_rank", "capacity", "expert_alignment",
                   "fp8_dispatch", "axis_name")


def dispatch_config(cfg: EpConfig) -> tuple:
    """``((field, value), ...)`` of :data:`DISPATCH_FIELDS` (kept in the handle)."""
    return tuple((f, getattr(cfg, f)) for f in DISPATCH_FIELDS)


def combine_args(y, d, cfg: EpConfig, R: int):
    for (field, was), now in zip(d.handle.dispatch_config, dispatch_config(cfg)):
        if was != now[1]:
            raise ValueError(
                f"jax_ep.combine: EpConfig.{field} is {now[1]!r} here but the dispatch ran with "
                f"{was!r}; pass combine the config dispatch was given")
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


class _QuietOverflow:
    """logging filter for JAX's callback logger: JAX logs every failed callback
    with its traceback, once per device; the error it then raises carries the
    same message, so jax_ep's own overflow error is not logged again."""

    @staticmethod
    def filter(record):
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, OverflowError) and str(exc).startswith(_MSG_HEAD))


_MSG_HEAD = "jax_ep.dispatch (EpConfig.check_overflow)"
_quiet_installed = False


def _quiet_callback_logs():
    """JAX's callback log filtered, and its runtime tokens cleared of jax_ep's
    own overflow before JAX's exit handlers wait on them: the error reached
    the user once, where the computation was read; JAX would print it twice
    more at exit ("Exception ignored in atexit callback")."""
    global _quiet_installed
    if not _quiet_installed:
        _quiet_installed = True
        logging.getLogger("jax._src.callback").addFilter(_QuietOverflow())
        atexit.register(_drop_overflow_tokens)   # runs before JAX's (registered earlier)


def _drop_overflow_tokens():
    try:
        tokens = _jax_dispatch.runtime_tokens.output_runtime_tokens
    except AttributeError:
        return
    for device, token in list(tokens.items()):
        try:
            token.block_until_ready()
        except Exception as e:  # noqa: BLE001 - only jax_ep's own error is dropped
            if _MSG_HEAD in str(e):
                del tokens[device]


# The checked dispatch's global report, one int32 vector, the same on every device.
_FIELDS = ("dropped", "invalid", "invalid_min", "invalid_max", "over", "rank", "needed",
           "expert", "expert_pairs")
_BIG = np.iinfo(np.int32).max


def drop_report(topk_idx, handle, cfg: EpConfig, num_dropped):
    """The facts :func:`check_drops` names: global drops; ids outside
    ``[-1, E)`` (how many, the smallest and largest); the rank furthest over
    its capacity (rows it needs, by how many over) and its busiest expert
    (global id, pairs). Collective over the manual axes."""
    E, R, C = cfg.num_experts, handle.num_ranks, handle.capacity
    L = E // R
    bad = invalid_ids(topk_idx, E)
    invalid = jnp.sum(bad, dtype=jnp.int32)
    lo = jnp.min(jnp.where(bad, topk_idx, _BIG)).astype(jnp.int32)
    hi = jnp.max(jnp.where(bad, topk_idx, -_BIG)).astype(jnp.int32)
    # pairs per local expert on this rank (each source token once per expert)
    per_expert = jnp.sum((handle.recv_local_idx[..., None] == jnp.arange(L)).any(axis=2),
                         axis=(0, 1), dtype=jnp.int32)                     # [L]
    if cfg.layout == "expert_major":
        a = cfg.expert_alignment
        needed = jnp.sum((per_expert + a - 1) // a * a, dtype=jnp.int32)
    else:
        needed = jnp.sum(jnp.any(handle.recv_local_idx >= 0, axis=2), dtype=jnp.int32)
    over = needed - C
    me = jax.lax.axis_index(cfg.axis_name).astype(jnp.int32)
    worst = global_reduce(over, jax.lax.pmax)
    rank = global_reduce(jnp.where(over == worst, me, _BIG), jax.lax.pmin)
    mine = me == rank
    busiest = jnp.argmax(per_expert).astype(jnp.int32)

    def from_worst(v):   # the worst rank's value, on every device
        return global_reduce(jnp.where(mine, v, jnp.int32(-_BIG)), jax.lax.pmax)

    return jnp.stack([global_sum(num_dropped), global_sum(invalid), global_reduce(lo, jax.lax.pmin),
                      global_reduce(hi, jax.lax.pmax), worst, rank, from_worst(needed),
                      from_worst(me * L + busiest), from_worst(per_expert[busiest])])


def overflow_message(report, cfg: EpConfig, capacity: int) -> str:
    """The one error of a checked dispatch that dropped pairs: its cause(s) and
    the remedy for each ('' when nothing was dropped)."""
    r = dict(zip(_FIELDS, (int(v) for v in np.asarray(report).reshape(-1))))
    if r["dropped"] <= 0:
        return ""
    parts = []
    if r["invalid"] > 0:
        parts.append(
            f"{r['invalid']} expert id(s) outside [-1, {cfg.num_experts}) (smallest "
            f"{r['invalid_min']}, largest {r['invalid_max']}): the router must give ids in "
            f"[0, num_experts={cfg.num_experts}), or -1 for an unused slot")
    spilled = r["dropped"] - r["invalid"]
    if spilled > 0:
        fix = ("a larger EpConfig.capacity" if cfg.capacity is None else
               f"EpConfig.capacity >= {r['needed']}, or capacity=None (dropless)")
        parts.append(
            f"{spilled} (token, expert) pair(s) over capacity: rank {r['rank']} of axis "
            f"{cfg.axis_name!r} needs {r['needed']} rows but has C={capacity} "
            f"({r['over']} over; its busiest expert, {r['expert']}, received "
            f"{r['expert_pairs']} pairs); use {fix}")
    return f"{_MSG_HEAD}: dropped {r['dropped']} pair(s): " + "; ".join(parts)


def _raise_if_dropped(report, cfg: EpConfig, capacity: int):
    msg = overflow_message(report, cfg, capacity)
    if msg:
        raise OverflowError(msg)
    return np.zeros((), np.int32)


def check_drops(report, cfg: EpConfig, capacity: int):
    """Checked mode: a host callback that raises ``OverflowError`` naming the
    cause when ``report`` (:func:`drop_report`, the same on every device) shows
    drops, else returns int32 0. A ``pure_callback`` (no effects, so it
    also works under ``jax.checkpoint``); the caller makes the data movement
    depend on its result, so it is never dead code and runs before any rank
    can block in a later collective."""
    names, manual = tuple(jax.sharding.get_abstract_mesh().axis_names), bound_axes()
    if len(manual) != len(names):
        raise ValueError(
            "EpConfig.check_overflow needs a jax.shard_map that is manual over every mesh axis "
            f"(here {manual} of {names}): JAX runs no host callback in a "
            "partially-manual shard_map. Return Dispatched.total_dropped and check it on the "
            "host instead")
    _quiet_callback_logs()
    return jax.pure_callback(lambda v: _raise_if_dropped(v, cfg, capacity),
                             jax.ShapeDtypeStruct((), jnp.int32), report)
