"""A loop-by-loop NumPy model of ``jax.lax.ragged_all_to_all`` (its docstring's
pseudocode), written independently of jax_ep.ragged.reference, plus random
cases and the transpose (the gradient) of the same loops.

Arrays are stacked per rank: ``operand [R, N, ...]``, ``output [R, M, ...]``,
offsets and sizes ``[R, K]`` with ``K = G * S`` (G ranks per group, S slices
per destination). A slice is written only when it fits ``operand`` and the
receiver's ``output`` and its size equals the receiver's ``recv_sizes``
(docs/ragged.md; lax leaves other inputs undefined).
"""
from __future__ import annotations

import numpy as np


def _groups(R, groups):
    return [list(g) for g in groups] if groups else [list(range(R))]


def slices(operand, output, io, ss, oo, rs, groups=None):
    """Every (sender, destination, src row, dst row, rows) that lax writes."""
    R, N = operand.shape[:2]
    M = output.shape[1]
    out = []
    for g in _groups(R, groups):
        S = io.shape[1] // len(g)
        for si, s in enumerate(g):
            for p in range(io.shape[1]):
                d, k = g[p // S], p % S
                a, n, b = int(io[s, p]), int(ss[s, p]), int(oo[s, p])
                fits = 0 <= a and 0 <= n and a + n <= N and 0 <= b and b + n <= M
                if fits and int(rs[d, si * S + k]) == n and n > 0:
                    out.append((s, d, a, b, n))
    return out


def ragged_all_to_all(operand, output, io, ss, oo, rs, groups=None):
    """-> ``[R, M, ...]``: every rank's result."""
    result = np.array(output, copy=True)
    for s, d, a, b, n in slices(operand, output, io, ss, oo, rs, groups):
        result[d, b:b + n] = operand[s, a:a + n]
    return result


def transpose(ct, operand, output, io, ss, oo, rs, groups=None):
    """The gradient of ``sum(result * ct)``: (d_operand, d_output). A row sent
    to several places gets the sum of their cotangents (lax's transpose, which
    sets instead of adding, agrees when no operand row is sent twice)."""
    d_operand = np.zeros(operand.shape, np.float64)
    d_output = np.array(ct, np.float64, copy=True)
    for s, d, a, b, n in slices(operand, output, io, ss, oo, rs, groups):
        d_operand[s, a:a + n] += ct[d, b:b + n]
        d_output[d, b:b + n] = 0
    return d_operand, d_output


def _cuts(rng, total, parts, fill):
    """``parts`` disjoint ranges in [0, total) in random order, sizes summing
    to about ``fill * total`` -> (starts, sizes)."""
    sizes = rng.multinomial(int(fill * total), rng.dirichlet(np.ones(parts))) if parts else []
    gaps = rng.multinomial(total - int(np.sum(sizes)), np.ones(parts + 1) / (parts + 1))
    order = rng.permutation(parts)
    starts = np.zeros(parts, np.int64)
    pos = 0
    for i, p in enumerate(order):
        pos += gaps[i]
        starts[p] = pos
        pos += sizes[p]
    return starts, np.asarray(sizes, np.int64)


def random_case(rng, R, N, M, S=1, feature=(), dtype=np.float32, groups=None, fill=0.8,
                empty=0.2):
    """A valid random case: each rank's slices take disjoint ranges of its
    operand (about ``fill`` of it), each receiver's slices disjoint ranges of
    its output (random order, gaps; slices shrunk where a receiver would get
    more than M rows), ``empty`` of the slices zero-sized.
    -> (operand, output, io, ss, oo, rs) stacked per rank."""
    G = len(groups[0]) if groups else R
    K = G * S
    io = np.zeros((R, K), np.int32)
    ss = np.zeros((R, K), np.int32)
    oo = np.zeros((R, K), np.int32)
    rs = np.zeros((R, K), np.int32)
    for g in _groups(R, groups):
        for s in g:
            io[s], ss[s] = _cuts(rng, N, K, fill)
        ss[g] = np.where(rng.random((G, K)) < empty, 0, ss[g])
        for di, d in enumerate(g):    # receiver d: sender si's slice k is column di*S + k
            cols = [(g[si], di * S + k) for si in range(G) for k in range(S)]
            want = np.array([ss[c] for c in cols], np.int64)
            if want.sum() > M:
                want = want * M // want.sum()
                for c, w in zip(cols, want):
                    ss[c] = w
            starts, _ = _cuts(rng, M - int(want.sum()), K, 0.0)
            shift = 0
            for q in np.argsort(starts, kind="stable"):  # in start order, each its own rows
                oo[cols[q]] = starts[q] + shift
                shift += want[q]
            rs[d] = want
    operand = _values(rng, (R, N) + tuple(feature), dtype)
    output = _values(rng, (R, M) + tuple(feature), dtype)
    return operand, output, io, ss, oo, rs


def _values(rng, shape, dtype):
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
