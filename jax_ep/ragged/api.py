"""``jax_ep.ragged_all_to_all``: ``jax.lax.ragged_all_to_all`` on jax_ep's backends.

Same signature and semantics as lax's (docs/ragged.md), plus an optional
``config``. Its gradient is lax's transpose: the cotangent of the result
travels back by a ragged_all_to_all with the roles of the offsets and sizes
swapped (into zeros: ``operand`` rows sent nowhere get 0), and ``output``'s
cotangent is the result's, zero on the rows the call wrote.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from .. import backend as _backend
from .. import runtime
from ..api import _reject_forward_mode
from ..mesh_axes import bound_axes, to_vma, vma_of
from . import reference
from .config import RaggedCall, RaggedConfig

_NAMES = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
_noticed = set()


def _axis(axis_name) -> str:
    """The one mesh axis of the exchange (a name, or a tuple of one name)."""
    if isinstance(axis_name, (tuple, list)):
        if len(axis_name) != 1:
            raise NotImplementedError(
                f"jax_ep.ragged_all_to_all: axis_name={tuple(axis_name)!r} names several mesh "
                "axes; jax_ep exchanges over one axis: lay the mesh out so that the group is "
                "one axis (e.g. jax.make_mesh with a merged axis)")
        axis_name = axis_name[0]
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        bound = bound_axes()
        raise ValueError(
            f"jax_ep.ragged_all_to_all: axis_name {axis_name!r} is not a mesh axis bound here "
            f"({'bound: ' + str(bound) if bound else 'not inside jax.shard_map?'}); call it "
            "inside jax.shard_map over a mesh with that axis") from None
    return axis_name


def _groups(axis_name: str, axis_index_groups) -> tuple:
    """-> (R, groups as a tuple of tuples or None), checked: the groups must
    cover the axis's positions once each, all of one size."""
    size = jax.lax.axis_size(axis_name)
    if axis_index_groups is None:
        return size, None
    try:
        groups = tuple(tuple(int(i) for i in g) for g in axis_index_groups)
    except TypeError:
        groups = None
    flat = sorted(i for g in groups or () for i in g)
    if (not groups or flat != list(range(size)) or len({len(g) for g in groups}) != 1):
        raise ValueError(
            f"jax_ep.ragged_all_to_all: axis_index_groups={axis_index_groups!r} must be lists "
            f"of axis indices of one size that cover 0..{size - 1} (axis {axis_name!r}) once "
            "each, e.g. [[0, 1], [2, 3]] for an axis of 4")
    return len(groups[0]), groups


def _as_int32(name: str, v):
    """An offsets / sizes argument, checked (lax's rules) and as int32. Wider
    values are clipped in their own dtype first, so none wraps into range."""
    if not jnp.issubdtype(v.dtype, jnp.integer):
        raise ValueError(f"ragged_all_to_all {name} must be integer type (got {v.dtype}); "
                         "jax_ep.ragged_all_to_all takes any integer dtype, int32 preferred")
    if v.ndim != 1 or v.shape[0] < 1:
        raise ValueError(f"ragged_all_to_all {name} must be rank 1 with positive dimension size, "
                         f"but got shape {v.shape}")
    info = jnp.iinfo(v.dtype)
    if info.bits > 32 or (info.bits == 32 and info.min == 0):
        lo = max(int(info.min), -(2**31))
        v = jnp.clip(v, jnp.asarray(lo, v.dtype), jnp.asarray(2**31 - 1, v.dtype))
    return v.astype(jnp.int32)


def _check_rows(operand, output):
    if operand.ndim < 1 or output.ndim != operand.ndim or output.shape[1:] != operand.shape[1:]:
        raise ValueError(
            f"jax_ep.ragged_all_to_all: operand {operand.shape} and output {output.shape} must "
            "have one rank >= 1 and equal sizes after the first dimension (rows of one shape)")
    if output.dtype != operand.dtype:
        raise TypeError(f"jax_ep.ragged_all_to_all: operand ({operand.dtype}) and output "
                        f"({output.dtype}) must have one dtype")


def _row_bytes(x):
    """Bytes of one row; None for sub-byte dtypes (the native kernel copies whole bytes)."""
    dt = jnp.dtype(x.dtype)
    try:
        bits = (jnp.finfo(dt) if jnp.issubdtype(dt, jnp.floating) else jnp.iinfo(dt)).bits
    except ValueError:   # bool, complex: whole bytes
        bits = dt.itemsize * 8
    return math.prod(x.shape[1:]) * bits // 8 if bits % 8 == 0 else None


def _call(operand, output, ints, axis_name, axis_index_groups, config) -> RaggedCall:
    """Checks every argument (at trace time) -> the call's :class:`RaggedCall`."""
    cfg = RaggedConfig() if config is None else config
    if not isinstance(cfg, RaggedConfig):
        raise TypeError(f"jax_ep.ragged_all_to_all: config must be a jax_ep.RaggedConfig or None, "
                        f"got {type(cfg).__name__}")
    _check_rows(operand, output)
    K = ints[0].shape[0]
    if any(v.shape[0] != K for v in ints):
        raise ValueError("jax_ep.ragged_all_to_all: input_offsets, send_sizes, output_offsets and "
                         f"recv_sizes must have one length, got {[v.shape[0] for v in ints]}")
    axis = _axis(axis_name)
    R, groups = _groups(axis, axis_index_groups)
    if K % R:
        raise ValueError(
            f"jax_ep.ragged_all_to_all: the offsets and sizes have length {K}, not a multiple of "
            f"the {R} ranks of a group on axis {axis!r}: give each rank S slices (length R * S)")
    return RaggedCall(config=cfg, axis_name=axis, groups=groups, num_ranks=R, slices=K // R,
                      in_rows=operand.shape[0], out_rows=output.shape[0],
                      row_bytes=_row_bytes(operand))


def _select(call: RaggedCall):
    be = _backend.select(_backend.RAGGED, call)
    if be is _backend.RAGGED.reference and call.backend == "auto" and runtime.is_initialized():
        why = str(_backend.RAGGED.native.unavailable(call))
        if why not in _noticed:   # the runtime is up, so the user may expect the kernel
            _noticed.add(why)
            logging.getLogger("jax_ep").warning(
                "jax_ep.ragged_all_to_all: using the reference backend: %s", why)
    return be


# -- the differentiable op (backend and call static) -------------------------
@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ragged(be, call, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    return be.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, call)


def _ragged_fwd(be, call, operand, output, *ints):
    return _ragged(be, call, operand, output, *ints), ints


def _ragged_bwd(be, call, ints, g):
    input_offsets, send_sizes, output_offsets, recv_sizes = ints
    # lax's transpose: the received slices go back from where they landed
    # (the senders' output_offsets, exchanged) to where they came from (the
    # senders' input_offsets, exchanged), sizes swapped, into zeros.
    start, _, rows = reference.incoming(input_offsets, send_sizes, output_offsets, recv_sizes,
                                        call)
    back_offsets = reference.exchange(input_offsets, call)
    back = dataclasses.replace(call, in_rows=call.out_rows, out_rows=call.in_rows)
    zeros = to_vma(jnp.zeros((call.in_rows,) + g.shape[1:], g.dtype), vma_of(g))
    d_operand = _ragged(be, back, g, zeros, start, recv_sizes, back_offsets, send_sizes)
    d_output = jnp.where(_written_mask(start, rows, call, g.ndim), jnp.zeros_like(g), g)
    return d_operand, d_output, None, None, None, None


def _written_mask(start, rows, call: RaggedCall, ndim: int):
    """``[M, 1, ...]`` bool: the output rows this rank's received slices wrote
    (+1 where a written slice starts, -1 past its end, summed)."""
    M = call.out_rows
    lo = jnp.where(rows > 0, start, M)
    hi = jnp.where(rows > 0, start + rows, M)
    marks = jnp.zeros((M + 1,), jnp.int32).at[lo].add(1).at[hi].add(-1)
    return (jnp.cumsum(marks)[:M] > 0).reshape((-1,) + (1,) * (ndim - 1))


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                      send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array,
                      *, axis_name, axis_index_groups=None,
                      config: Optional[RaggedConfig] = None) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` on jax_ep's backends; per rank, inside ``jax.shard_map``.

    Rank i sends rows ``operand[input_offsets[p] : input_offsets[p] + send_sizes[p]]``
    to rank ``p // S`` of its group, where they land at rows
    ``output_offsets[p] ...`` of that rank's result (``output_offsets`` is where
    the rows go on the *receiver*, as in lax); every row no slice writes keeps
    ``output``'s value. ``recv_sizes[q]`` is the size of slice ``q = s * S + k``
    received from rank s, and must equal the size s sends (else that slice is
    not written; the native backend raises a device-side error).

    Args:
      operand: ``[N, ...]`` rows to send (any dtype lax takes; rank >= 1).
      output: ``[M, ...]`` the result's initial value (same dtype and row shape).
      input_offsets, send_sizes, output_offsets, recv_sizes: ``[K]`` integers,
        ``K = R * S`` (R: ranks of the group, S: slices per destination rank).
      axis_name: the mesh axis of the exchange (a name or a 1-tuple).
      axis_index_groups: optional groups of axis indices (lists of one size
        that cover the axis), each exchanging among itself; R is their size.
      config: a :class:`jax_ep.RaggedConfig` (backend, transport, SMs);
        None: the defaults (native when the runtime is up with a ragged
        region that fits, ``jax_ep.initialize(ragged_bytes=...)``).

    Returns:
      ``[M, ...]``, ``output`` with the received rows written. Differentiable
      in reverse mode (``jax.grad``, ``jax.vjp``) with lax's transpose.
    """
    ints = [_as_int32(n, v) for n, v in zip(_NAMES, (input_offsets, send_sizes, output_offsets,
                                                    recv_sizes))]
    call = _call(operand, output, ints, axis_name, axis_index_groups, config)
    _reject_forward_mode("ragged_all_to_all", operand, output)
    vma = frozenset({call.axis_name}).union(*(vma_of(a) for a in (operand, output, *ints)))
    operand, output, *ints = (to_vma(a, vma) for a in (operand, output, *ints))
    return _ragged(_select(call), call, operand, output, *ints)
