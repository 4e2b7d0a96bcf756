"""Where each group's rows lie in ``x``: back to back from row 0 (row
``offsets``, ``ops.offsets``; the contiguous layout) or at fixed starts
(:class:`FixedStarts`; the masked layout ``[G, C, K]``)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class FixedStarts(NamedTuple):
    """Row groups at fixed starts: group ``g`` is rows ``[start[g], start[g] +
    size[g])``, ``start`` int32 ``[G]`` ascending from 0, ``size`` no larger
    than the gap to the next start. The forward/dx kernels take it where they
    take row offsets; rows outside every group get no tile (not written)."""
    start: jax.Array
    size: jax.Array


def masked(group_sizes, c: int) -> FixedStarts:
    """The groups of the masked layout ``[G, C, *]`` flattened to ``[G·C, *]``:
    group ``g`` is its first ``group_sizes[g]`` rows (clipped to ``[0, C]``)."""
    g = group_sizes.shape[0]
    return FixedStarts(jnp.arange(g, dtype=jnp.int32) * c,
                       jnp.clip(group_sizes.astype(jnp.int32), 0, c))


def flatten_masked(x, groups: int):
    """``(x [G·C, ...], C)`` for the masked layout ``x [G, C, ...]``, else ``(x, None)``."""
    if x.ndim != 3:
        return x, None
    if x.shape[0] != groups:
        raise ValueError(f"grouped_matmul: the masked layout x [G, C, K] has {x.shape[0]} "
                         f"groups but w has {groups} (x {x.shape}): one block of C rows per "
                         "group")
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2]), x.shape[1]


def unflatten(y, c):
    """``y [G·C, N]`` back to ``[G, C, N]`` for the masked layout (``c`` not None)."""
    return y if c is None else y.reshape(y.shape[0] // c, c, y.shape[1])


def of_layout(group_sizes, c):
    """The rows argument of the kernels for a layout: None (contiguous: the
    kernels take offsets from ``group_sizes``) or, for ``c`` rows per group,
    :func:`masked`."""
    return None if c is None else masked(group_sizes, c)


class BackwardRows(NamedTuple):
    """How a backward on one layout sees its rows: ``row_groups``, dx's groups
    (:func:`of_layout`); ``dw_groups``, the group sizes ``tgmm`` takes over
    the same rows (the masked layout: ``C`` each, contiguous spans); ``keep``,
    ``[G·C, 1]`` whether each row is in its group (None: contiguous, whose
    rows past the groups the kernels never read nor write)."""
    row_groups: object
    dw_groups: jax.Array
    keep: object

    def clean(self, a):
        """``a`` with the rows outside the groups zeroed (they may hold
        anything, NaN included): a ``tgmm`` operand, or dx (no gradient out)."""
        return a if self.keep is None else jnp.where(self.keep, a, jnp.zeros((), a.dtype))


def backward_rows(group_sizes, c) -> BackwardRows:
    """:class:`BackwardRows` of the contiguous layout (``c`` None) or of the
    masked layout of ``c`` rows per group."""
    if c is None:
        return BackwardRows(None, group_sizes, None)
    g = group_sizes.shape[0]
    r = jnp.arange(g * c, dtype=jnp.int32)
    keep = (r % c < jnp.clip(group_sizes.astype(jnp.int32), 0, c)[r // c])[:, None]
    return BackwardRows(masked(group_sizes, c), jnp.full((g,), c, jnp.int32), keep)


def spans_and_mask(rows, m: int):
    """``(spans [G], keep [m, 1])``: contiguous spans group by group, as
    ``jax.lax.ragged_dot`` takes groups, and whether each row is in its group.
    Of row ``offsets``: the groups' sizes (rows from ``offsets[-1]`` on are in
    no span); of :class:`FixedStarts`: each span runs to the next start, the
    last to row ``m``, so the spans cover ``[0, m)``."""
    r = jnp.arange(m, dtype=jnp.int32)
    if isinstance(rows, FixedStarts):
        start = rows.start.astype(jnp.int32)
        spans = jnp.diff(jnp.append(start, jnp.int32(m)))
        g = jnp.clip(jnp.searchsorted(start, r, side="right") - 1, 0, start.shape[0] - 1)
        return spans, (r - start[g] < rows.size.astype(jnp.int32)[g])[:, None]
    spans = jnp.diff(rows)
    return spans, (r < rows[-1])[:, None]
