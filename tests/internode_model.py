"""NumPy model of the internode (hierarchical) kernels, docs/internode.md.

R = N nodes x G ranks, rank r = (r // G, r % G). Used by the CPU tests
(tests/test_internode_model.py) and by the GPU loopback tests
(tests/gpu/test_loopback_internode.py) for the combine's expected bits.

Inputs are the intranode handle fields stacked per rank, as the reference
computes them: ``send_mask [R(src), T, R]``, ``recv_local_idx`` and
``slot_row`` ``[R(expert rank), R(src), T, K]``.
"""
from __future__ import annotations

import numpy as np


def node_masks(send_mask, N):
    """[R(src), T, R] bool -> [R(src), T, N] int: the G-bit mask of node m's
    ranks that want each token (what the sender ships with the row)."""
    R = send_mask.shape[-1]
    G = R // N
    bits = (1 << np.arange(G)).astype(np.int64)
    return (send_mask.reshape(send_mask.shape[:-1] + (N, G)).astype(np.int64) * bits).sum(-1)


def dispatch_plan(send_mask, N):
    """The rows each leg moves, as the kernels move them.

    -> dict with
      net[(s, f)]: tokens source s sends across the network to forwarder f
                   (f = (m, s % G) for every node m that wants the token),
      nvl[(f, r)]: (s, t) rows forwarder f stores into rank r's area,
      delivered[r]: set of (s, t) that reach rank r.
    """
    R, T, _ = send_mask.shape
    G = R // N
    masks = node_masks(send_mask, N)
    net, nvl, delivered = {}, {}, {r: set() for r in range(R)}
    for s in range(R):
        for m in range(N):
            f = m * G + s % G
            toks = [t for t in range(T) if masks[s, t, m]]
            net[(s, f)] = toks
            for t in toks:
                for g in range(G):
                    if (masks[s, t, m] >> g) & 1:
                        r = m * G + g
                        nvl.setdefault((f, r), []).append((s, t))
                        delivered[r].add((s, t))
    return dict(net=net, nvl=nvl, delivered=delivered)


def _partials(y, w, recv_local_idx, slot_row, rank_major):
    """Expert-side partials, as the intranode combine forms them:
    -> (p [R(expert), R(src), T, H] in y's dtype, received [R, R, T] bool).
    f32 sum over k ascending from +0 (expert_major: w * f32(y) per slot),
    cast to y's dtype; rank_major: the row of y (first stored slot)."""
    R = y.shape[0]
    _, _, T, K = slot_row.shape
    C, H = y.shape[1], y.shape[2]
    dt = y.dtype
    p = np.zeros((R, R, T, H), dt)
    received = np.any(recv_local_idx >= 0, axis=-1)
    for r in range(R):
        yf = y[r].astype(np.float32)
        for s in range(R):
            li, rows = recv_local_idx[r, s], slot_row[r, s]
            ok = (li >= 0) & (rows >= 0) & (rows < C)
            safe = np.where(ok, rows, 0)
            if rank_major:
                first = np.argmax(ok, axis=1)
                has = ok.any(axis=1)
                row = safe[np.arange(T), first]
                p[r, s] = np.where(has[:, None], y[r][row], np.zeros((), dt))
                continue
            acc = np.zeros((T, H), np.float32)
            for k in range(K):
                term = yf[safe[:, k]]
                if w is not None:
                    term = w[r][safe[:, k]][:, None].astype(np.float32) * term
                acc = np.where(ok[:, k:k + 1], acc + term, acc)
            p[r, s] = acc.astype(dt)
    return p, received


def combine_flat(y, w, send_mask, recv_local_idx, slot_row, rank_major=False):
    """The intranode / reference formula: out[s, t] = cast(sum_{r ascending,
    t sent to r} f32(partial_r)). -> [R(src), T, H]."""
    p, received = _partials(y, w, recv_local_idx, slot_row, rank_major)
    R, T, H = y.shape[0], slot_row.shape[2], y.shape[2]
    out = np.zeros((R, T, H), np.float32)
    for s in range(R):
        for r in range(R):
            sel = received[r, s][:, None]
            out[s] = np.where(sel, out[s] + p[r, s].astype(np.float32), out[s])
    return out.astype(y.dtype)


def combine_hier(y, w, send_mask, recv_local_idx, slot_row, N, rank_major=False):
    """The internode kernels' formula: per node m, P_m = cast(sum_{g ascending,
    (m, g) received t} f32(partial_(m,g))); out = cast(sum_{m ascending, t sent
    to a rank of m} f32(P_m)); 0 for a token sent nowhere. -> [R(src), T, H]."""
    p, received = _partials(y, w, recv_local_idx, slot_row, rank_major)
    R, T, H = y.shape[0], slot_row.shape[2], y.shape[2]
    G = R // N
    dt = y.dtype
    out = np.zeros((R, T, H), np.float32)
    for s in range(R):
        for m in range(N):
            acc = np.zeros((T, H), np.float32)
            for g in range(G):
                r = m * G + g
                sel = received[r, s][:, None]
                acc = np.where(sel, acc + p[r, s].astype(np.float32), acc)
            pm = acc.astype(dt).astype(np.float32)
            sent = send_mask[s][:, m * G:(m + 1) * G].any(axis=1)[:, None]
            out[s] = np.where(sent, out[s] + pm, out[s])
    return out.astype(dt)


def group_limited_routing(rng, R, T, K, E, N, M, minus_one=0.0):
    """topk_idx [R, T, K] whose experts (distinct) lie on at most M of the N
    nodes (DeepSeek-V3's group-limited routing, nodes as groups), some -1."""
    G = R // N
    per_node = E // N
    assert K <= M * per_node
    idx = np.empty((R, T, K), np.int32)
    for r in range(R):
        for t in range(T):
            nodes = rng.choice(N, size=M, replace=False)
            pool = np.concatenate([np.arange(n * per_node, (n + 1) * per_node) for n in nodes])
            idx[r, t] = rng.choice(pool, size=K, replace=False)
    idx = np.where(rng.random((R, T, K)) < minus_one, -1, idx)
    del G
    return idx.astype(np.int32)
