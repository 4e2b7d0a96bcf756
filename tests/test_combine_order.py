"""The reference combine's bits are docs/semantics.md §7's formula in its
order: per (token, rank) ``partial = cast_y(Σ_{k ascending} w · f32(y_row))``
in f32, then ``out = cast_y(Σ_{r ascending} f32(partial))``. A NumPy model that
sums in exactly that order (one f32 rounding per multiply and per add) must
give the same bits, so a reversed sum over k or over ranks, or a partial
left in f32, fails here.

The weights are powers of two (sums of a few where ids repeat) and the values
carry bf16's 8 significant bits, so each product is exact and the bits do not
depend on whether XLA:CPU contracts a multiply-add into an FMA (the sums'
order still decides them). Two kinds of values: magnitudes spread over
2^-8 .. 2^8 (another order moves f32 results by an ulp), and +-2^24 beside
O(1) values with unit weights (another order cancels the large terms before
or after the small ones are absorbed: visible in bf16 too)."""
import ml_dtypes
import numpy as np
import pytest

import jax_ep
import numpy_model as npm
from ep_testing import make_mesh, random_routing, run_per_rank

BF16 = ml_dtypes.bfloat16


def _row_of(disp, r, src, l, layout):
    """Row of ``src`` (= s*T + t) on rank r (in local expert l's group), or None (dropped)."""
    rows = np.nonzero(disp["row_src"][r] == src)[0]
    if layout == "rank_major":
        return int(rows[0]) if rows.size else None
    starts = np.concatenate([[0], np.cumsum(disp["group_sizes"][r])])
    rows = rows[(rows >= starts[l]) & (rows < starts[l + 1])]
    return int(rows[0]) if rows.size else None


def ordered_combine(y, idx, w, E, layout, disp):
    """§7 in its order: y [R, C, H] -> out [R, T, H] in y's dtype."""
    R, T, K = idx.shape
    L = E // R
    cidx, _ = npm.clean_routing(idx, E)
    w = npm.merged_weights(idx, w, E)        # repeated ids: §2
    f32 = np.float32
    out = np.zeros((R, T, y.shape[2]), y.dtype)
    for s in range(R):
        for t in range(T):
            acc = np.zeros(y.shape[2], f32)
            for r in range(R):                       # ranks ascending
                ks = [k for k in range(K) if cidx[s, t, k] >= 0 and cidx[s, t, k] // L == r]
                if not ks:
                    continue
                if layout == "rank_major":
                    row = _row_of(disp, r, s * T + t, None, layout)
                    if row is None:
                        continue
                    partial = y[r, row]
                else:
                    p = np.zeros(y.shape[2], f32)
                    stored = False
                    for k in ks:                     # slots ascending
                        row = _row_of(disp, r, s * T + t, int(cidx[s, t, k]) - r * L, layout)
                        if row is None:
                            continue
                        stored = True
                        p = (p + (f32(w[s, t, k]) * y[r, row].astype(f32)).astype(f32)).astype(f32)
                    if not stored:
                        continue
                    partial = p.astype(y.dtype)
                acc = (acc + partial.astype(f32)).astype(f32)
            out[s, t] = acc.astype(y.dtype)
    return out


def _values(rng, kind, shape):
    if kind == "spread":
        return rng.standard_normal(shape) * 2.0 ** rng.integers(-8, 9, shape)
    big = np.where(rng.random(shape) < 0.5, 2.0 ** 24, -(2.0 ** 24))
    return np.where(rng.random(shape) < 0.5, big, rng.standard_normal(shape))


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("capacity", [None, 60])
@pytest.mark.parametrize("values", ["spread", "cancel"])
def test_reference_combine_is_the_documented_order_bit_for_bit(layout, dtype, capacity, values):
    R, T, K, E, H = 4, 24, 6, 16, 40   # up to 4 slots of a token on one rank: order matters
    rng = np.random.default_rng(11)
    idx = random_routing(rng, R, T, K, E, minus_one=0.2, skew=True, repeat=0.1, invalid=0.05)
    w = (2.0 ** rng.integers(-3, 2, (R, T, K)) if values == "spread"
         else np.ones((R, T, K))).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                          layout=layout, capacity=capacity, backend="reference")
    C = cfg.capacity_for(R, T)
    # 8 significant bits (bf16's) even in f32: a product by a merged weight
    # (a sum of a few powers of two) stays exact
    y = _values(rng, values, (R, C, H)).astype(BF16).astype(dtype)
    disp = npm.dispatch(x, idx, w, E, layout=layout, C=C)
    if capacity is not None:
        assert disp["num_dropped"].sum() > 0   # the case drops pairs

    def fn(x, i, w, y):
        return jax_ep.combine(y, jax_ep.dispatch(x, i, w, cfg), cfg)

    got = np.asarray(run_per_rank(fn, make_mesh((R,), ("ep",)), "ep", x, idx, w, y))
    want = ordered_combine(y, idx, w, E, layout, disp)
    assert got.dtype == want.dtype
    mismatch = got.view(f"u{got.dtype.itemsize}") != want.view(f"u{want.dtype.itemsize}")
    assert not mismatch.any(), f"{int(mismatch.sum())} of {mismatch.size} elements differ"
