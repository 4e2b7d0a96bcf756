"""A loop-by-loop NumPy model of docs/semantics.md, written independently of
jax_ep.intranode.reference, so the reference is checked against the contract itself."""
from __future__ import annotations

import numpy as np


def clean_routing(idx, E):
    """-> (cleaned idx [R,T,K], invalid count per rank [R])."""
    R, T, K = idx.shape
    out = idx.copy()
    invalid = np.zeros(R, np.int64)
    for r in range(R):
        for t in range(T):
            seen = set()
            for k in range(K):
                e = int(idx[r, t, k])
                if e < -1 or e >= E:
                    invalid[r] += 1
                    e = -1
                if e >= 0 and e in seen:
                    e = -1
                if e >= 0:
                    seen.add(e)
                out[r, t, k] = e
    return out, invalid


def merged_weights(idx, w, E):
    """§2: a slot naming an expert again adds its weight to the first slot
    naming it (f32, slots ascending); repeats, -1 and invalid slots keep their
    own (they are not routed). -> [R,T,K] f32."""
    out = w.astype(np.float32).copy()
    R, T, K = idx.shape
    for r in range(R):
        for t in range(T):
            for k in range(K):
                e = int(idx[r, t, k])
                if not 0 <= e < E or e in (int(v) for v in idx[r, t, :k]):
                    continue
                acc = np.float32(0)
                for j in range(K):
                    if int(idx[r, t, j]) == e:
                        acc = np.float32(acc + np.float32(w[r, t, j]))
                out[r, t, k] = acc
    return out


def dispatch(x, idx, w, E, layout="expert_major", align=1, C=None, scales=None):
    """x [R,T,H], idx/w [R,T,K] -> dict of per-rank outputs stacked on axis 0."""
    R, T, K = idx.shape
    H = x.shape[2]
    L = E // R
    cidx, invalid = clean_routing(idx, E)
    w = merged_weights(idx, w, E)
    if C is None:
        C = R * T if layout == "rank_major" else max(align, -(-(R * T * min(K, L) + L * (align - 1)) // align) * align)
    res = {k: [] for k in ("x", "scales", "group_sizes", "weights", "topk_idx", "topk_weights",
                          "num_valid", "num_dropped", "row_src")}
    for d in range(R):
        ox = np.zeros((C, H), x.dtype)
        osc = None if scales is None else np.zeros((C, scales.shape[2]), scales.dtype)
        row_src = -np.ones(C, np.int64)
        dropped = 0
        valid_rows = 0
        if layout == "expert_major":
            ow = np.zeros(C, np.float32)
            gs = np.zeros(L, np.int64)
            start = 0
            for l in range(L):
                e = d * L + l
                members = [(s, t, k) for s in range(R) for t in range(T) for k in range(K)
                           if cidx[s, t, k] == e]
                n = len(members)
                aligned = -(-n // align) * align
                for i, (s, t, k) in enumerate(members):
                    row = start + i
                    if row < C:
                        ox[row] = x[s, t]
                        if osc is not None:
                            osc[row] = scales[s, t]
                        ow[row] = w[s, t, k]
                        row_src[row] = s * T + t
                        valid_rows += 1
                    else:
                        dropped += 1
                gs[l] = min(start + aligned, C) - min(start, C)
                start += aligned
            res["weights"].append(ow)
            res["group_sizes"].append(gs)
        else:
            oi = -np.ones((C, K), np.int32)
            ow = np.zeros((C, K), np.float32)
            row = 0
            for s in range(R):
                for t in range(T):
                    mine = [k for k in range(K) if cidx[s, t, k] >= 0 and cidx[s, t, k] // L == d]
                    if not mine:
                        continue
                    if row < C:
                        ox[row] = x[s, t]
                        if osc is not None:
                            osc[row] = scales[s, t]
                        for k in mine:
                            oi[row, k] = cidx[s, t, k] - d * L
                            ow[row, k] = w[s, t, k]
                        row_src[row] = s * T + t
                        valid_rows += 1
                    else:
                        dropped += len(mine)
                    row += 1
            res["topk_idx"].append(oi)
            res["topk_weights"].append(ow)
        res["x"].append(ox)
        res["scales"].append(osc)
        res["row_src"].append(row_src)
        res["num_valid"].append(valid_rows)
        res["num_dropped"].append(dropped + invalid[d])
    return {k: (np.stack(v) if v and v[0] is not None else None) for k, v in res.items()}


def combine(y, disp, idx, E, layout="expert_major"):
    """f64 combine of y [R,C,H] back to [R,T,H] using the NumPy dispatch result."""
    R, T, K = idx.shape
    H = y.shape[2]
    out = np.zeros((R, T, H), np.float64)
    for d in range(R):
        for row, src in enumerate(disp["row_src"][d]):
            if src < 0:
                continue
            s, t = divmod(int(src), T)
            v = y[d, row].astype(np.float64)
            if layout == "expert_major":
                v = v * float(disp["weights"][d, row])
            out[s, t] += v
    return out


def layout(idx, E, R):
    """Per rank: (tokens per rank [R], tokens per expert [E], is_token_in_rank [T,R])."""
    Rr, T, K = idx.shape
    L = E // R
    cidx, _ = clean_routing(idx, E)
    ntr, nte, itr = [], [], []
    for r in range(Rr):
        in_rank = np.zeros((T, R), bool)
        per_e = np.zeros(E, np.int32)
        for t in range(T):
            for e in set(int(v) for v in cidx[r, t] if v >= 0):
                per_e[e] += 1
                in_rank[t, e // L] = True
        ntr.append(in_rank.sum(0).astype(np.int32))
        nte.append(per_e)
        itr.append(in_rank)
    return np.stack(ntr), np.stack(nte), np.stack(itr)
