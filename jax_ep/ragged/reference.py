"""``ragged_all_to_all`` in pure JAX: the semantics (docs/ragged.md), on any platform.

Per rank, inside ``jax.shard_map``; R ranks in the group, K = R * S slices
(S per destination), ``operand [N, ...]``, ``output [M, ...]``.

Slice ``p`` of this rank (destination ``d = p // S``) is *valid* when
``0 <= input_offsets[p]``, ``0 <= send_sizes[p]``, ``input_offsets[p] +
send_sizes[p] <= N``, ``0 <= output_offsets[p]`` and ``output_offsets[p] +
send_sizes[p] <= M``; it then declares ``send_sizes[p]`` rows to ``d``, else -1.
On the receiving side, slice ``q = s * S + k`` (the k-th slice of sender s) is
written when its declared size is ``recv_sizes[q]`` (lax requires the two to
agree): rows ``output_offsets_s[me * S + k] + i`` of the result take the
sender's ``operand[input_offsets_s[me * S + k] + i]``, ``i < recv_sizes[q]``.
Every other row keeps ``output``'s value. A slice that breaks these rules is
not written (the native kernel also raises a device-side error); rows that
several received slices cover are unspecified, as in lax.

How: one XLA all_to_all of the ``[2, K]`` int32 slice words (where each
slice lands, its declared size), then each rank packs the rows it sends to
each destination into a chunk of ``C = min(M, S * N)`` rows (``[R, C, ...]``:
a valid slice has at most N rows, and the slices a rank receives from one
sender cover at most M rows), one XLA all_to_all of the chunks, and a gather
of every output row from its chunk row. Cost per rank: two buffers of
``R * C`` rows (send and receive) and that all_to_all's traffic, R times the
rows that really move in the worst case; the native kernel moves only those.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import RaggedCall


def exchange(v, call: RaggedCall, axis: int = 0):
    """XLA's tiled all_to_all of ``v`` along ``axis`` over the call's group:
    block r of ``v`` goes to rank r; block s of the result came from rank s."""
    groups = [list(g) for g in call.groups] if call.groups else None
    return jax.lax.all_to_all(v, call.axis_name, axis, axis, tiled=True,
                              axis_index_groups=groups)


def declared_sizes(input_offsets, send_sizes, output_offsets, call: RaggedCall):
    """``[K]`` int32: the rows each slice of this rank declares to its
    destination, -1 for a slice outside ``operand`` or the destination's ``output``."""
    N, M = call.in_rows, call.out_rows
    n = send_sizes
    ok = ((input_offsets >= 0) & (n >= 0) & (output_offsets >= 0)
          & (input_offsets <= N - n) & (output_offsets <= M - n))
    return jnp.where(ok, n, -1)


def incoming(input_offsets, send_sizes, output_offsets, recv_sizes, call: RaggedCall):
    """What this rank receives, from the slice words of every sender
    (one all_to_all of ``[2, K]`` int32) -> (``start [K]``: where slice q lands in
    this rank's output, ``sent [K]``: the rows its sender packed for it,
    ``rows [K]``: the rows written, 0 for a slice not written)."""
    words = jnp.stack([output_offsets, declared_sizes(input_offsets, send_sizes,
                                                      output_offsets, call)])
    start, declared = exchange(words, call, axis=1)
    written = (declared >= 0) & (declared == recv_sizes)
    return start, jnp.maximum(declared, 0), jnp.where(written, recv_sizes, 0)


def _chunk_rows(call: RaggedCall) -> int:
    return min(call.out_rows, call.slices * call.in_rows)


def _pack(operand, input_offsets, sizes, call: RaggedCall, C: int):
    """``[R * C, ...]``: block d holds the rows this rank sends to rank d, its
    slices one after another (``sizes``: the rows of each, 0 when invalid)."""
    R, S = call.num_ranks, call.slices
    incl = jnp.cumsum(sizes.reshape(R, S), axis=1)                      # [R, S]
    j = jnp.arange(C, dtype=jnp.int32)
    k = jax.vmap(lambda c: jnp.searchsorted(c, j, side="right"))(incl)  # [R, C]: slice of row j
    k = jnp.minimum(k, S - 1).astype(jnp.int32)
    excl = incl - sizes.reshape(R, S)
    src = jnp.take_along_axis(input_offsets.reshape(R, S), k, axis=1) + j[None, :] - \
        jnp.take_along_axis(excl, k, axis=1)
    src = jnp.clip(src, 0, call.in_rows - 1)       # rows past a block's slices are never read
    return jnp.take(operand, src.reshape(-1), axis=0)


def written_rows(start, sent, rows, call: RaggedCall):
    """For each output row m: (``covered [M]`` bool, ``row [M]`` int32: its row in
    the received chunks ``[R * C, ...]``). The slices are searched by start
    (slices that write nothing are moved past the end): with disjoint slices
    the one covering m is the last to start at or before it."""
    M, S, C = call.out_rows, call.slices, _chunk_rows(call)
    key = jnp.where(rows > 0, start, M)
    order = jnp.argsort(key)
    m = jnp.arange(M, dtype=jnp.int32)
    pos = jnp.searchsorted(key[order], m, side="right") - 1
    q = order[jnp.maximum(pos, 0)]
    off = m - start[q]
    excl = (jnp.cumsum(sent.reshape(-1, S), axis=1) - sent.reshape(-1, S)).reshape(-1)
    j = excl[q] + off
    covered = (pos >= 0) & (off < rows[q]) & (j < C)
    return covered, (q // S) * C + j


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      call: RaggedCall):
    """The op on int32 offsets and sizes, operands already varying over the axis."""
    C = _chunk_rows(call)
    if C == 0:    # nothing can be sent (N = 0) or received (M = 0)
        return output
    start, sent, rows = incoming(input_offsets, send_sizes, output_offsets, recv_sizes, call)
    mine = jnp.maximum(declared_sizes(input_offsets, send_sizes, output_offsets, call), 0)
    chunks = exchange(_pack(operand, input_offsets, mine, call, C), call)
    covered, row = written_rows(start, sent, rows, call)
    got = jnp.take(chunks, jnp.clip(row, 0, chunks.shape[0] - 1), axis=0)
    mask = covered.reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(mask, got, output)


class ReferenceBackend:
    """The ragged family's reference backend (``jax_ep.backend.RAGGED``)."""

    name = "reference"

    def unavailable(self, call: RaggedCall):
        del call
        return None

    def ragged_all_to_all(self, operand, output, input_offsets, send_sizes, output_offsets,
                          recv_sizes, call: RaggedCall):
        return ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                 recv_sizes, call)


BACKEND = ReferenceBackend()
