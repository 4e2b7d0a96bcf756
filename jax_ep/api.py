"""Public dispatch / combine / layout functions and their gradients.

Every function here is called per rank inside ``jax.shard_map`` over
``config.axis_name`` (``check_vma=True`` works; the axis may be one axis of a
larger mesh). Shapes below are per rank: T tokens, H hidden, K top-k, E
experts, R ranks on the axis, L = E / R local experts, C rows of capacity.

Gradients follow docs/semantics.md §9 and are backend-independent (the backend:
``jax_ep.backend.select``): the backward of
dispatch is a combine of the row gradients (unweighted) plus the return of the
``weights`` gradients to ``topk_weights``; the backward of combine is a
dispatch of ``d_out`` (weighted on the expert side) plus
``d_w = <d_out[t], y_row>``. Both reuse the forward ``handle``.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from . import backend as _backend
from . import validate
from .config import EpConfig
from .first_order import FP8_PATH, NATIVE_KERNELS, first_order_only
from .mesh_axes import to_vma, vma_of
from .routing import merge_duplicate_weights
from .types import Dispatched

try:   # JAX internals, used only to word an error
    from jax._src.interpreters.ad import JVPTracer
except ImportError:  # pragma: no cover - JAX internals moved
    JVPTracer = None


def _reject_forward_mode(fn: str, *arrays):
    """Forward-mode AD (``jax.jvp`` / ``jax.jacfwd``) meets jax_ep's ``custom_vjp``
    rules; say so clearly instead of JAX's generic custom_vjp error. Seen when
    the jvp is traced around the per-rank code (``jax.jvp(shard_map(...))``,
    ``jax.jit(jax.jacfwd(...))``); a jvp of an already-jitted function still
    gets JAX's own message."""
    if not getattr(jax.config, "jax_use_direct_linearize", True) or JVPTracer is None:
        return  # jax.grad itself runs through JVP tracers then
    if any(isinstance(a, JVPTracer) and type(getattr(a, "tangent", None)).__name__ != "Zero"
           for a in arrays if a is not None):
        raise TypeError(
            f"jax_ep.{fn} supports reverse-mode differentiation only (jax.grad, jax.vjp, "
            "jax.value_and_grad, jax.jacrev); forward mode (jax.jvp, jax.jacfwd, jax.hessian) is "
            "not implemented: use jax.vjp / jax.jacrev instead")


# -- differentiable pieces (backend and config static) ------------------------
# Second order differentiates these rules as ordinary code: so each op's
# primal is a plain function that its forward rule calls, not the custom_vjp
# function again (a jvp of a nested custom_vjp call is an error), and on the
# native backend every rule passes its arrays through _first_order, whose
# derivative raises one clear error.
def _first_order(be, where, *arrays):
    return arrays if be.name == "reference" else first_order_only(where, NATIVE_KERNELS, *arrays)


def _rows_forward(be, cfg, x, handle):
    return be.dispatch_rows(x, None, handle, cfg)[0]


_move_rows = partial(jax.custom_vjp, nondiff_argnums=(0, 1))(_rows_forward)


def _move_rows_fwd(be, cfg, x, handle):
    (x,) = _first_order(be, "dispatch", x)
    return _rows_forward(be, cfg, x, handle), handle


def _move_rows_bwd(be, cfg, handle, g):
    (g,) = _first_order(be, "dispatch", g)
    return be.combine_rows(g, None, handle, cfg), None


_move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def _weights_forward(be, cfg, w, handle):
    return be.router.dispatch_weights(w, handle, cfg)


_move_weights = partial(jax.custom_vjp, nondiff_argnums=(0, 1))(_weights_forward)


def _move_weights_fwd(be, cfg, w, handle):
    (w,) = _first_order(be, "dispatch", w)
    return _weights_forward(be, cfg, w, handle), handle


def _move_weights_bwd(be, cfg, handle, g):
    (g,) = _first_order(be, "dispatch", g)
    return be.router.return_weights(g, handle, cfg), None


_move_weights.defvjp(_move_weights_fwd, _move_weights_bwd)


def _combine_forward(be, cfg, y, w, handle):
    return be.combine_rows(y, w, handle, cfg)


_combine = partial(jax.custom_vjp, nondiff_argnums=(0, 1))(_combine_forward)


def _combine_fwd(be, cfg, y, w, handle):
    y, w = _first_order(be, "combine", y, w)
    return _combine_forward(be, cfg, y, w, handle), (y, w, handle)


def _combine_bwd(be, cfg, res, g):
    y, w, handle = res
    (g,) = _first_order(be, "combine", g)
    # a dispatch of g, weighted on the expert side (w None: rank_major, the
    # user weighted there), plus dw = <g_t, y_row>; native: one fused kernel
    dy, dw = be.combine_backward(g, y, w, handle, cfg)
    return dy, dw, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def _fp8_rows_forward(be, cfg, x_dtype, x, handle):
    return be.dispatch_rows_fp8(x, handle, cfg)


_fp8_rows = partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))(_fp8_rows_forward)


def _fp8_rows_fwd(be, cfg, x_dtype, x, handle):
    (x,) = first_order_only("dispatch", FP8_PATH, x)   # its fp8 rows carry no tangent
    return _fp8_rows_forward(be, cfg, x_dtype, x, handle), handle


def _fp8_rows_bwd(be, cfg, x_dtype, handle, g):
    # Straight-through: the rows' cotangent is that of the dequantized rows (the
    # fp8 grouped matmul's convention), any float dtype; it returns to x as the
    # bf16/f32 dispatch's does. A cotangent of the scales is ignored.
    g_rows, _ = g
    return _move_rows_bwd(be, cfg, handle, g_rows.astype(x_dtype))


_fp8_rows.defvjp(_fp8_rows_fwd, _fp8_rows_bwd)


# -- public API ---------------------------------------------------------------
def _one_empty_row(x, topk_idx, topk_weights, x_scales):
    """T = 0 inputs as one row naming no expert (fresh rows: the empty inputs'
    gradients are empty)."""
    vma = vma_of(x) | vma_of(topk_idx) | vma_of(topk_weights)
    row = lambda a, v: to_vma(jnp.full((1, a.shape[1]), v, a.dtype), vma)
    return (row(x, 0), row(topk_idx, -1), row(topk_weights, 0),
            None if x_scales is None else row(x_scales, 0))


def dispatch(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, config: EpConfig,
             x_scales: Optional[jax.Array] = None) -> Dispatched:
    """Send each token to the ranks holding its top-k experts.

    Args:
      x: ``[T, H]`` bf16 / f32 tokens, or fp8-e4m3 (then ``x_scales`` is required).
        T may be 0: ``group_sizes``, ``num_valid`` and ``num_dropped`` are 0,
        combine returns ``[0, H]``; ``x`` keeps its C rows (unwritten unless
        ``zero_tail``).
      topk_idx: ``[T, K]`` expert ids in ``[-1, E)``, any integer dtype (cast to
        int32); -1 = slot unused. Ids outside that range are treated as -1 and
        counted in ``num_dropped``. An expert named in several slots of one
        token is reached once, with the sum of those slots' weights (the dense
        MoE ``sum_k w_k f_(e_k)(x)``); every such slot gets the gradient
        ``<d_out, f_e(x)>``.
      topk_weights: ``[T, K]`` routing weights, any float dtype (used as f32).
      config: :class:`EpConfig`.
      x_scales: ``[T, H/128]`` f32 dequantisation scales of an fp8 ``x``.

    Returns:
      :class:`Dispatched` (``x [C, H]``, ``group_sizes [L]`` / ``weights [C]``
      for expert_major, ``topk_idx [C, K]`` / ``topk_weights [C, K]`` for
      rank_major, ``num_valid [1]``, ``num_dropped [1]``, ``handle``). Each
      token crosses the link at most once per destination rank. With
      ``config.fp8_dispatch`` a bf16/f32 ``x`` is sent as fp8 and ``x_scales``
      is filled; its gradient is straight-through: the rows' cotangent, taken
      as that of the dequantized rows (what ``jax_ep.grouped_matmul`` returns
      for fp8 rows), reaches ``x`` as the bf16/f32 dispatch's does; one of
      ``x_scales`` is ignored (docs/semantics.md §8). An fp8 ``x`` given with
      its scales gets no gradient. Reverse mode only (``jax.grad``, ``jax.vjp``).

    With ``config.check_overflow`` the drop count is summed over every device
    of the mesh first and a host callback raises one ``OverflowError`` on all of
    them before any row moves (so no rank is left waiting in a collective);
    it works under ``jax.jit`` and ``jax.checkpoint``.
    """
    R = validate.axis_size(config)
    _reject_forward_mode("dispatch", x, topk_weights, x_scales)
    topk_idx, topk_weights = validate.dispatch_args(x, topk_idx, topk_weights, x_scales, config, R)
    pad = int(x.shape[0] == 0)
    if pad:  # T = 0: route one empty row (no expert), stripped again by combine
        x, topk_idx, topk_weights, x_scales = _one_empty_row(x, topk_idx, topk_weights, x_scales)
    be = _backend.select(_backend.normal_family(config, R), config)
    # dense-MoE weights for repeated ids (plain jnp, so autodiff spreads the gradient)
    topk_weights = merge_duplicate_weights(topk_idx, topk_weights, config.num_experts)
    handle, group_sizes, num_valid, num_dropped = be.router.route(topk_idx, config, R)
    handle = dataclasses.replace(handle, padded_tokens=pad,
                                 dispatch_config=validate.dispatch_config(config))
    if config.check_overflow:
        # every device gets the same global count, raises (or not) in the callback, and
        # moves no row before it: the rows' send mask depends on the callback's result
        ok = validate.check_drops(validate.drop_report(topk_idx, handle, config, num_dropped),
                                  config, handle.capacity)
        handle = dataclasses.replace(handle, send_mask=handle.send_mask & (ok == 0))
        num_dropped = num_dropped + ok
    num_valid = jnp.reshape(num_valid, (1,))
    num_dropped = jnp.reshape(num_dropped, (1,))

    if config.fp8_dispatch and x.dtype != jnp.float8_e4m3fn:
        recv_x, recv_scales = _fp8_rows(be, config, jnp.dtype(x.dtype), x, handle)
    elif x.dtype == jnp.float8_e4m3fn:  # forward-only: fp8 data carries no gradient
        recv_x, recv_scales = be.dispatch_rows(
            jax.lax.stop_gradient(x), jax.lax.stop_gradient(x_scales), handle, config)
    else:
        recv_x, recv_scales = _move_rows(be, config, x, handle), None
    recv_w = _move_weights(be, config, topk_weights, handle)

    if config.layout == "expert_major":
        return Dispatched(x=recv_x, x_scales=recv_scales, group_sizes=group_sizes,
                          weights=recv_w, topk_idx=None, topk_weights=None,
                          num_valid=num_valid, num_dropped=num_dropped, handle=handle)
    rows = handle.row_src
    R_, T, K = handle.recv_local_idx.shape
    recv_idx = handle.recv_local_idx.reshape(R_ * T, K)[jnp.maximum(rows, 0)]
    recv_idx = jnp.where((rows >= 0)[:, None], recv_idx, -1)
    return Dispatched(x=recv_x, x_scales=recv_scales, group_sizes=None, weights=None,
                      topk_idx=recv_idx, topk_weights=recv_w, num_valid=num_valid,
                      num_dropped=num_dropped, handle=handle)


def combine(y: jax.Array, dispatched: Dispatched, config: EpConfig) -> jax.Array:
    """Bring expert outputs back to their tokens and reduce them.

    Args:
      y: ``[C, H]`` bf16 / f32, one row per row of ``dispatched.x``.
        expert_major: the expert's output for that (token, expert) pair; the
        routing weight ``dispatched.weights`` is applied here, on the expert
        side. rank_major: the already weighted sum over this rank's experts.
      dispatched: the :class:`Dispatched` returned by :func:`dispatch`.
      config: the same :class:`EpConfig`.

    Returns:
      ``[T, H]`` in y's dtype: ``out[t] = sum over ranks r (ascending) of
      cast(sum over k on r (ascending) of w_k * y_(t,k))``, accumulated in f32.
      Deterministic. Rows that were dropped contribute zero. Differentiable
      in reverse mode only (``jax.grad`` / ``jax.vjp``).
    """
    R = validate.axis_size(config)
    w = dispatched.weights if config.layout == "expert_major" else None
    _reject_forward_mode("combine", y, w)
    validate.combine_args(y, dispatched, config, R)
    be = _backend.select(_backend.normal_family(config, R), config)
    out = _combine(be, config, y, w, dispatched.handle)
    pad = dispatched.handle.padded_tokens
    return out[:out.shape[0] - pad] if pad else out


def get_dispatch_layout(topk_idx: jax.Array, config: EpConfig):
    """Routing statistics of this rank's tokens (no communication).

    Args:
      topk_idx: ``[T, K]`` expert ids in ``[-1, E)``, any integer dtype.
    Returns:
      ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
      is_token_in_rank [T, R] bool)``. A token counts once per rank and once
      per expert however many of its slots point there; ids outside
      ``[0, E)`` count nowhere.
    """
    R = validate.axis_size(config)
    topk_idx = validate.topk_idx(topk_idx, config, R)
    be = _backend.select(_backend.normal_family(config, R), config)
    if topk_idx.shape[0] == 0:  # T = 0: one row with no expert counts nowhere
        empty = jnp.full((1, topk_idx.shape[1]), -1, jnp.int32)
        per_rank, per_expert, in_rank = be.layout(jnp.concatenate([topk_idx, empty]), config, R)
        return per_rank, per_expert, in_rank[:0]
    return be.layout(topk_idx, config, R)
