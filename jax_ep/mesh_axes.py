"""Mesh axes seen from per-rank code inside ``jax.shard_map``.

Varying axes (vma): under ``check_vma=True`` every operand of a primitive must
vary over the same mesh axes. :func:`vma_of` and :func:`to_vma` read and
widen them; :func:`global_sum` reduces a per-device value over every manual
axis, so each device holds the same result (one decision, taken everywhere).
"""
from __future__ import annotations

import jax


def vma_of(x) -> frozenset:
    """Mesh axes over which ``x`` varies (empty outside shard_map / check_vma=False)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
        vma = getattr(mat, "varying", None)
    return frozenset(vma or ())


def to_vma(x, axes: frozenset):
    """``x`` marked as varying over ``axes`` (a superset of its own)."""
    missing = tuple(sorted(axes - vma_of(x)))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying")


def bound_axes() -> tuple:
    """Manual mesh axes bound here (inside ``jax.shard_map``), () elsewhere.

    Only Manual axes: in a partially-manual ``shard_map`` (``axis_names=``) the
    Auto axes cannot be named by collectives."""
    try:
        m = jax.sharding.get_abstract_mesh()
        types = getattr(m, "axis_types", None) or ()
        manual = jax.sharding.AxisType.Manual
        return tuple(n for n, t in zip(m.axis_names, types) if t == manual)
    except Exception:  # noqa: BLE001 - only used for messages and psums
        return ()


def global_reduce(n, reduce):
    """``reduce(n, axes)`` over the manual axes bound here (``n`` itself outside
    shard_map)."""
    axes = bound_axes()
    if not axes:
        return n
    if vma_of(n):  # check_vma=True: a collective needs n varying over every axis it reduces
        n = to_vma(n, frozenset(axes))
    return reduce(n, axes)


def global_sum(n):
    """``n`` summed over the manual axes of the enclosing ``shard_map`` (every
    device of the mesh when it is manual over all of them), so every device
    holds the same value: one decision, taken everywhere."""
    return global_reduce(n, jax.lax.psum)
