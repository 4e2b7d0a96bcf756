"""GPU tests of the fp8 grouped-matmul kernel (``jax_ep.gmm.pallas_fp8``; one GPU, one process).

    python -m pytest -q -m gpu tests/gpu/test_grouped_matmul_fp8_gpu.py

The kernel against dequantize-then-f32-matmul: every output element within
1e-2 of the sum of its products' magnitudes (``|x·xs| @ |v·vs|^T``), on data
with outliers (values spanning 2^±8 inside one 128-block), f32 and UE8M0
scales, empty and skewed groups, unaligned totals, NaN tail rows; on 1-CTA
clusters and CTA pairs (``cluster=2``: the x tile multicast; ``Nout % 256 != 0``
falls back to 1), whose output is the 1-CTA kernel's, bit for bit. The fp8
dw kernel (``jax_ep.gmm.pallas_fp8_dw``) against its XLA contract, and the
public call with ``fp8_dw``. The native extension's fp8 kernel
(``jax_ep.gmm.cuda_fp8``) under the forward kernel's checks, and bit for bit
against it. The masked layout through the public call on both families. The
weight quantizer kernel (``quantize_weights_pair``) and the dw operands' column
kernel (``fp8_columns.dw_operands``) bit for bit against XLA.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep.gmm.ops import offsets
from jax_ep.gmm.pallas_fp8 import gmm_fp8_nt
from test_grouped_matmul_gpu import _hopper, sizes_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) CUDA GPU"),
]

E4M3_MAX = 448.0


def outliers(key, shape):
    """Normal data times 2^u, u uniform in [-8, 8]: magnitudes spanning 2^±8 in every block."""
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, shape) * jnp.exp2(jax.random.uniform(k2, shape, minval=-8, maxval=8))


def block_quant(a, rows_block, pow2):
    """fp8 e4m3 of ``a [..., R, C]`` with one scale per ``rows_block x 128`` block."""
    *lead, r, c = a.shape
    b = a.reshape(*lead, r // rows_block, rows_block, c // 128, 128)
    amax = jnp.maximum(jnp.max(jnp.abs(b), axis=(-3, -1), keepdims=True), 1e-4)
    s = amax / E4M3_MAX
    if pow2:
        s = jnp.exp2(jnp.ceil(jnp.log2(s)))
    q = jnp.clip(b / s, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(a.shape), s.reshape(*lead, r // rows_block, c // 128)


def case(m, g, kc, n, sizes, pow2, seed=0):
    kx, kv = jax.random.split(jax.random.key(seed))
    x, xs = block_quant(outliers(kx, (m, kc)), 1, pow2)
    v, vs = block_quant(outliers(kv, (g, n, kc)), 128, pow2)
    tot = int(np.sum(sizes))
    if tot < m:
        xs = xs.at[tot:].set(jnp.nan)       # tail rows must never be read
    return x, xs, v, vs, jnp.asarray(sizes, jnp.int32)


def reference(x, xs, v, vs, sizes):
    """f32 dequantize-then-matmul per group, and the magnitude bound ``|x| @ |v|^T``."""
    xd = np.asarray(x, np.float32) * np.repeat(np.asarray(xs, np.float32), 128, axis=1)
    vd = (np.asarray(v, np.float32)
          * np.repeat(np.repeat(np.asarray(vs, np.float32), 128, axis=1), 128, axis=2))
    out = np.zeros((x.shape[0], v.shape[1]), np.float64)
    mag = np.zeros_like(out)
    off = np.concatenate([[0], np.cumsum(sizes)])
    for gi in range(v.shape[0]):
        a, b = off[gi], off[gi + 1]
        out[a:b] = xd[a:b].astype(np.float64) @ vd[gi].T.astype(np.float64)
        mag[a:b] = np.abs(xd[a:b]).astype(np.float64) @ np.abs(vd[gi]).T.astype(np.float64)
    return out, mag


def run(x, xs, v, vs, gs, out_dtype=jnp.bfloat16, cluster=1, kernel="pallas"):
    """The Pallas kernel, or (``kernel="cuda"``, ``"cuda tma"``: TMA tile
    stores) the native extension's."""
    if kernel.startswith("cuda"):
        from jax_ep.gmm.cuda_fp8 import gmm_fp8_nt_cuda
        return jax.jit(lambda *a: gmm_fp8_nt_cuda(*a, offsets(gs, x.shape[0]), out_dtype=out_dtype,
                                                  tma_store=kernel == "cuda tma"))(x, xs, v, vs)
    return jax.jit(lambda *a: gmm_fp8_nt(*a, offsets(gs, x.shape[0]), out_dtype=out_dtype,
                                         cluster=cluster))(x, xs, v, vs)


def check(x, xs, v, vs, gs, out_dtype=jnp.bfloat16, cluster=1, kernel="pallas"):
    out = run(x, xs, v, vs, gs, out_dtype, cluster, kernel)
    ref, mag = reference(x, xs, v, vs, np.asarray(gs))
    o = np.asarray(out, np.float64)
    tot = int(np.sum(gs))
    assert np.all(o[tot:] == 0), "rows past the groups must be zero"
    err = np.abs(o - ref)[:tot]
    bound = 1e-2 * mag[:tot] + 1e-30
    worst = float(np.max(err / bound)) if tot else 0.0
    assert worst <= 1.0, f"error {worst:.3g} x 1e-2 of the products' magnitude"
    rel = float(np.linalg.norm(o[:tot] - ref[:tot]) / max(np.linalg.norm(ref[:tot]), 1e-30))
    assert rel < 1e-2, rel
    return out


# (cluster, Nout): 1 CTA; pairs on 2 pairs of column tiles; pairs asked for on
# 3 column tiles (falls back to 1 CTA)
CLUSTER_N = [(1, 384), (2, 512), (2, 384)]


@pytest.mark.parametrize("kind,total", [("uniform", 2048), ("skew", 2048), ("unaligned", 1901)])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("cluster,n", CLUSTER_N)
def test_fp8_kernel_small(kind, total, pow2, cluster, n):
    sizes = sizes_for(kind, 8, total)
    check(*case(2048, 8, 512, n, sizes, pow2), cluster=cluster)


@pytest.mark.parametrize("cluster", [1, 2])
def test_fp8_kernel_f32_out_and_empty(cluster):
    sizes = np.array([0, 300, 0, 0, 129, 7, 0, 1], np.int32)
    check(*case(1024, 8, 256, 256, sizes, False, seed=3), out_dtype=jnp.float32, cluster=cluster)
    check(*case(1024, 8, 256, 256, np.zeros(8, np.int32), False, seed=4), cluster=cluster)


@pytest.mark.parametrize("cluster", [1, 2])
def test_fp8_kernel_v3_down(cluster):
    g, m = 32, 8192       # V3 down projection, a quarter of the experts
    sizes = sizes_for("skew", g, m)
    check(*case(m, g, 2048, 7168, sizes, True, seed=5), cluster=cluster)


@pytest.mark.parametrize("kind,n", [("skew", 512), ("unaligned", 768), ("skew", 384)])
def test_fp8_kernel_cluster_is_bitwise_the_1cta_kernel(kind, n):
    """CTA pairs compute each tile as one CTA does (same WGMMAs, same k
    order): the same bits, also where the pair falls back (N = 384)."""
    sizes = sizes_for(kind, 8, 1901)
    sizes[3] = 0
    ops = case(2048, 8, 1024, n, sizes, False, seed=6)
    np.testing.assert_array_equal(np.asarray(run(*ops, cluster=2), np.float32),
                                  np.asarray(run(*ops, cluster=1), np.float32))



def _api_operands(m, g, k, n, sizes, seed):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = outliers(kx, (m, k)).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (g, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (m, n)).astype(jnp.bfloat16)
    return x, w, dy, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("w_layout", ["gkn", "gnk"])
@pytest.mark.parametrize("fp8_dx", [True, False])
@pytest.mark.parametrize("fp8_cluster,fp8_kernel", [(1, "pallas"), (2, "pallas"), (1, "cuda")])
def test_api_kernels_match_reference_with_grads(w_layout, fp8_dx, fp8_cluster, fp8_kernel):
    """``jax_ep.grouped_matmul`` on fp8 operands: the kernel path (forward and
    dx in fp8, on the Pallas or the CUDA kernels) against the dequantizing XLA
    reference, forward and both gradients, skewed groups with an empty one and
    a tail (``fp8_cluster=2``: the forward's N = 384 falls back to 1 CTA, dx's
    K = 512 runs on pairs)."""
    if fp8_cluster == 2 and not fp8_dx:
        pytest.skip("no pairs run: the forward falls back to 1 CTA and dx runs in bf16")
    import jax_ep
    from jax_ep.gmm import GroupedMatmulConfig
    if fp8_kernel == "cuda":
        _native()

    sizes = sizes_for("skew", 8, 1901)
    x, w, dy, gs = _api_operands(2048, 8, 512, 384, sizes, seed=11)
    xq, xs = jax_ep.quantize_activations(x)
    wq, ws = jax_ep.quantize_weights(w, layout=w_layout)

    def run(impl):
        cfg = GroupedMatmulConfig(impl=impl, fp8_dx=fp8_dx, fp8_cluster=fp8_cluster,
                                  fp8_kernel=fp8_kernel)

        def f(a, b):
            return jax_ep.grouped_matmul(a, b, gs, x_scales=xs, w_scales=ws, w_layout=w_layout,
                                         config=cfg)
        y, vjp = jax.vjp(f, xq, wq)
        return (y, *vjp(dy))
    got = jax.jit(lambda: run("pallas"))()
    want = jax.jit(lambda: run("xla"))()
    tot = int(np.sum(sizes))
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a)), name
        if name != "dw":
            assert np.all(a[tot:] == 0), name
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        # both paths cast dy the same way for an fp8 dx: what differs is the
        # accumulation order and the bf16 rounding of the outputs
        assert rel < 1e-2, (name, rel)


def _dw_operands(kind, total, seed=21):
    from jax_ep.gmm import fp8_columns

    m, g, k, n = 2048, 8, 512, 384
    sizes = sizes_for(kind, g, total)
    kx, kd = jax.random.split(jax.random.key(seed))
    xq, xs = block_quant(outliers(kx, (m, k)), 1, False)
    xs = xs.at[total:].set(jnp.nan)
    dy = jax.random.normal(kd, (m, n)).at[total:].set(jnp.inf)
    return sizes, fp8_columns.dw_operands(xq, xs, dy, jnp.asarray(sizes, jnp.int32))


def _dw_kernel(kernel):
    if kernel == "cuda":
        _native()
        from jax_ep.gmm.cuda_fp8 import tgmm_fp8_nt_cuda
        return tgmm_fp8_nt_cuda
    from jax_ep.gmm.pallas_fp8_dw import tgmm_fp8_nt
    return tgmm_fp8_nt


@pytest.mark.parametrize("kernel", ["pallas", "cuda"])
@pytest.mark.parametrize("kind,total", [("uniform", 2048), ("skew", 2048), ("unaligned", 1901)])
def test_fp8_dw_kernel_matches_reference(kind, total, kernel):
    """The fp8 dw kernel (Pallas, or the native extension's: f32 out) against
    ``tgmm_fp8_nt_xla`` on operands regrouped and recast by ``fp8_columns``,
    x's tail scales NaN, dy's tail Inf; an empty group's dw is zero."""
    from jax_ep.gmm.xla import tgmm_fp8_nt_xla

    fn = _dw_kernel(kernel)
    sizes, ops = _dw_operands(kind, total)
    got = np.asarray(jax.jit(lambda *o: fn(*o, out_dtype=jnp.float32))(*ops))
    want = np.asarray(jax.jit(lambda *o: tgmm_fp8_nt_xla(*o, jnp.float32))(*ops))
    assert np.all(np.isfinite(got))
    for e in np.flatnonzero(np.asarray(sizes) == 0):
        assert np.all(got[e] == 0)
    # the tensor core keeps fewer bits than f32 while it sums a 128-block of fp8
    # products (measured on an H200: 2.2-2.4e-4 normwise), the reference none
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3


def test_cuda_fp8_dw_kernel_is_bitwise_the_pallas_kernel():
    """Same tiles, WGMMAs, block order and promotion ((product * row scale) *
    column scale + sum, from zero): the same bits, bf16 out."""
    sizes, ops = _dw_operands("skew", 2048, seed=22)
    got = np.asarray(jax.jit(_dw_kernel("cuda"))(*ops), np.float32)
    np.testing.assert_array_equal(got, np.asarray(jax.jit(_dw_kernel("pallas"))(*ops),
                                                  np.float32))


@pytest.mark.parametrize("num_sms", [1, 5])
def test_cuda_fp8_dw_kernel_few_ctas_walk_many_tiles(num_sms):
    """On 1 or 5 CTAs each CTA walks many tiles, its bf16 output tile reused
    while the previous tile's TMA store may still read it: the bits of one
    CTA per SM (at these shapes one tile each)."""
    sizes, ops = _dw_operands("skew", 2048, seed=23)
    fn = _dw_kernel("cuda")
    want = np.asarray(jax.jit(fn)(*ops), np.float32)
    got = np.asarray(jax.jit(functools.partial(fn, num_sms=num_sms))(*ops), np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dy_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind,total", [("skew", 2048), ("unaligned", 1901)])
def test_native_dw_operands_are_bitwise_xla(kind, total, dy_dtype):
    """The column kernel (``cuda_quant.cast_columns_t``, one pass per operand)
    gives the bits of ``fp8_columns``' XLA passes on the same GPU: x e4m3
    with its row scales (NaN past the groups), dy bf16 or f32 (Inf past them),
    skewed groups with an empty one; the tables' gaps zero."""
    from jax_ep.gmm import fp8_columns

    _native()
    m, g, k, n = 2048, 8, 512, 384
    sizes = jnp.asarray(sizes_for(kind, g, total), jnp.int32)
    kx, kd = jax.random.split(jax.random.key(31))
    xq, xs = block_quant(outliers(kx, (m, k)), 1, False)
    xs = xs.at[total:].set(jnp.nan)
    dy = jax.random.normal(kd, (m, n)).astype(dy_dtype).at[total:].set(jnp.inf)
    got = jax.jit(functools.partial(fp8_columns.dw_operands, impl="native"))(xq, xs, dy, sizes)
    want = jax.jit(functools.partial(fp8_columns.dw_operands, impl="xla"))(xq, xs, dy, sizes)
    for name, a, b in zip(("a", "as", "c", "cs", "segments"), got, want):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.itemsize == 1:
            a, b = a.view(np.uint8), b.view(np.uint8)
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("kernel", ["pallas", "cuda"])
def test_api_fp8_dw_matches_reference(kernel):
    """``jax_ep.grouped_matmul`` with ``fp8_dw`` on the Pallas or the CUDA
    kernels (``fp8_kernel``): forward, dx and dw against the dequantizing
    reference of the same casts, skewed groups with an empty one and a tail."""
    import jax_ep
    from jax_ep.gmm import GroupedMatmulConfig

    if kernel == "cuda":
        _native()
    sizes = sizes_for("skew", 8, 1901)
    x, w, dy, gs = _api_operands(2048, 8, 512, 384, sizes, seed=12)
    xq, xs = jax_ep.quantize_activations(x)
    wq, ws = jax_ep.quantize_weights(w)

    def run(impl):
        cfg = GroupedMatmulConfig(impl=impl, fp8_dw=True, fp8_kernel=kernel)
        y, vjp = jax.vjp(lambda a, b: jax_ep.grouped_matmul(a, b, gs, x_scales=xs, w_scales=ws,
                                                            config=cfg), xq, wq)
        return (y, *vjp(dy))
    got = jax.jit(lambda: run("pallas"))()
    want = jax.jit(lambda: run("xla"))()
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a)), name
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2, name


def _native():
    from jax_ep import extension
    if extension.load() is None:
        pytest.skip(f"needs the native extension: {extension.error()}")


@pytest.mark.parametrize("kind,total", [("uniform", 2048), ("skew", 2048), ("unaligned", 1901)])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kernel", ["cuda", "cuda tma"])
def test_cuda_fp8_kernel_small(kind, total, pow2, kernel):
    """The native extension's fp8 kernel (``cuda_fp8``) under the same checks,
    its tiles stored from registers and by TMA."""
    _native()
    check(*case(2048, 8, 512, 384, sizes_for(kind, 8, total), pow2), kernel=kernel)


def test_cuda_fp8_kernel_f32_out_empty_and_v3_down():
    _native()
    sizes = np.array([0, 300, 0, 0, 129, 7, 0, 1], np.int32)
    check(*case(1024, 8, 256, 256, sizes, False, seed=3), out_dtype=jnp.float32, kernel="cuda")
    check(*case(1024, 8, 256, 256, np.zeros(8, np.int32), False, seed=4), kernel="cuda")
    g, m = 32, 8192
    check(*case(m, g, 2048, 7168, sizes_for("skew", g, m), True, seed=5), kernel="cuda")


@pytest.mark.parametrize("m,sizes", [(200, [150, 50]), (136, [100, 30]), (520, [300, 212])])
@pytest.mark.parametrize("kernel", ["cuda", "cuda tma"])
def test_cuda_fp8_kernel_tiles_past_m(m, sizes, kernel):
    """The kernel's 256-row tiles where M is under 256 (the tile starts at row
    0 and its boxes reach past M: TMA reads zeros there) or the last tile is
    moved back to end at M; tail rows NaN-scaled."""
    _native()
    check(*case(m, 2, 256, 256, np.array(sizes, np.int32), False, seed=13), kernel=kernel)


@pytest.mark.parametrize("m,sizes", [(1024, [300, 0, 257, 130]), (2048, [128, 640, 1, 0, 700]),
                                     (520, [300, 212]), (200, [150, 50])])
def test_cuda_fp8_tma_store_is_bitwise_the_register_store(m, sizes):
    """TMA tile stores (whole 64-row blocks of one group through shared
    memory, the rest from registers) write every output element, tail rows
    included, as the register stores do: same bits over the whole ``[M, N]``."""
    _native()
    ops = case(m, len(sizes), 512, 384, np.array(sizes, np.int32), False, seed=17)
    tma = check(*ops, kernel="cuda tma")
    np.testing.assert_array_equal(np.asarray(tma).view(np.uint16),
                                  np.asarray(run(*ops, kernel="cuda")).view(np.uint16))


@pytest.mark.parametrize("k", [384, 640, 512])
@pytest.mark.parametrize("kernel", ["cuda", "cuda tma"])
def test_cuda_fp8_kernel_lone_blocks(k, kernel):
    """Tiles with one 64-row block to store (a 320-row group's second tile, a
    group of 64 rows or fewer: those in block 0 run in pairs, one per
    consumer; in the tiles moved back to end at M, lone blocks 1, 2 and 3:
    each consumer's both sums), an odd number of k-steps among the cases:
    the reference's bound, and the Pallas kernel's bits; on 1 and 5 CTAs
    (pairs, lone and whole tiles in one CTA's ring, its stages reused across
    them), the same bits."""
    _native()
    from jax_ep.gmm.cuda_fp8 import gmm_fp8_nt_cuda
    sizes = np.array([320, 64, 300, 7, 0, 129, 1, 19, 20, 40, 50, 10, 41], np.int32)
    ops = case(1024, len(sizes), k, 384, sizes, False, seed=21)
    want = np.asarray(run(*ops), np.float32)
    np.testing.assert_array_equal(np.asarray(check(*ops, kernel=kernel), np.float32), want)
    for num_sms in (1, 5):
        got = jax.jit(lambda *a: gmm_fp8_nt_cuda(*a, offsets(ops[4], 1024), num_sms=num_sms,
                                                 tma_store=kernel == "cuda tma"))(*ops[:4])
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.parametrize("kind,n", [("skew", 512), ("unaligned", 768)])
def test_cuda_fp8_kernel_is_bitwise_the_pallas_kernel(kind, n):
    """Per row the same four 64 x 128 x 32 WGMMAs per k-step (the CUDA kernel
    on 256-row tiles, Pallas on 128), the same promotion (one FMA of the
    product and xs * vs into the sum, from zero): the same bits as the Pallas
    kernel. (Should Mosaic ever leave the Pallas kernel's multiply and add
    uncontracted, they would differ by an ulp.)"""
    _native()
    ops = case(2048, 8, 1024, n, sizes_for(kind, 8, 1901), False, seed=9)
    np.testing.assert_array_equal(np.asarray(run(*ops, kernel="cuda"), np.float32),
                                  np.asarray(run(*ops), np.float32))


@pytest.mark.parametrize("path", ["bf16", "fp8-pallas", "fp8-cuda"])
def test_masked_layout_matches_reference(path):
    """The masked layout ``x [G, C, K]`` (the kernels at fixed starts, no tail
    tiles) through the public call with gradients, against the XLA path on
    the groups' rows: NaN rows outside the groups, an empty and a full group,
    C = 200 (groups start off the 128-row grid); dx zero outside the groups."""
    import jax_ep
    from jax_ep.gmm import GroupedMatmulConfig
    if path == "fp8-cuda":
        _native()
    sizes, c, k, n = [37, 0, 200, 130], 200, 512, 384
    g = len(sizes)
    valid = (np.arange(c)[None, :] < np.asarray(sizes)[:, None])[..., None]
    kx, kw, kd = jax.random.split(jax.random.key(11), 3)
    x = jnp.where(valid, jax.random.normal(kx, (g, c, k)), jnp.nan).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (g, k, n)) / 16).astype(jnp.bfloat16)
    dy = jnp.where(valid, jax.random.normal(kd, (g, c, n)), jnp.inf).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    if path == "bf16":
        operands, extra = (x, w), {}
    else:
        xq, xs = jax_ep.quantize_activations(jnp.nan_to_num(x).reshape(g * c, k))
        xq = jnp.where(valid, xq.reshape(g, c, k), jnp.asarray(jnp.nan, xq.dtype))
        wq, ws = jax_ep.quantize_weights(w)
        operands, extra = (xq, wq), {"x_scales": xs.reshape(g, c, -1), "w_scales": ws}
    family = "cuda" if path == "fp8-cuda" else "pallas"

    def run(cfg):
        f = jax.jit(lambda a, b, d: jax.vjp(
            lambda a_, b_: jax_ep.grouped_matmul(a_, b_, gs, config=cfg, **extra), a, b)[1](d))
        y = jax.jit(lambda a, b: jax_ep.grouped_matmul(a, b, gs, config=cfg, **extra))(*operands)
        return (y, *f(*operands, dy))
    got = run(GroupedMatmulConfig(impl="pallas", fp8_kernel=family))
    want = run(GroupedMatmulConfig(impl="xla"))
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if name == "dx":
            assert np.all(a[~np.broadcast_to(valid, a.shape)] == 0)
        if name != "dw":
            a, b = a[np.broadcast_to(valid, a.shape)], b[np.broadcast_to(valid, b.shape)]
        assert np.all(np.isfinite(a)), name
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2, name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_native_row_cast_is_bitwise_xla(dtype):
    """The row kernel (``cc/quant/rows.cu``, dispatch's cast) against
    ``jax_ep.fp8_cast`` compiled by XLA on this GPU, bit for bit: outliers, a
    zero block (the 1e-4 floor), 1001 rows of 7168 (56 scales per row, the
    scales gathered) and 3 of 16512 (129 blocks: stored one by one); then the
    fp8 gradients with ``fp8_dx_cast="native"`` against ``"xla"``."""
    import jax_ep
    from jax_ep.gmm import GroupedMatmulConfig
    from jax_ep.gmm.quantize import cast_rows
    _native()
    for i, shape in enumerate(((1001, 7168), (3, 16512))):
        x = outliers(jax.random.key(31 + i), shape).astype(dtype)
        x = x.at[0, 128:256].set(0)
        got = jax.jit(lambda a: cast_rows(a, "native"))(x)
        want = jax.jit(lambda a: cast_rows(a, "xla"))(x)
        np.testing.assert_array_equal(np.asarray(got[0].view(jnp.uint8)),
                                      np.asarray(want[0].view(jnp.uint8)))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    x, w = outliers(jax.random.key(41), (512, 256)), outliers(jax.random.key(42), (3, 256, 384))
    xq, xs = jax_ep.quantize_activations(x)
    wq, ws = jax_ep.quantize_weights(w)
    gs = jnp.asarray([200, 0, 250], jnp.int32)
    dy = outliers(jax.random.key(43), (512, 384)).astype(jnp.bfloat16)

    def grads(cast):
        cfg = GroupedMatmulConfig(fp8_dx_cast=cast)
        f = lambda a, b: jax_ep.grouped_matmul(a, b, gs, x_scales=xs, w_scales=ws, config=cfg)
        return jax.jit(lambda a, b, d: jax.vjp(f, a, b)[1](d))(xq, wq, dy)
    for got, want in zip(grads("native"), grads("xla")):
        np.testing.assert_array_equal(np.asarray(got[:450], np.float32),
                                      np.asarray(want[:450], np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scale_format", ["f32", "ue8m0"])
def test_native_swiglu_cast_is_bitwise_xla(dtype, scale_format):
    """``jax_ep.quantize_swiglu`` on the kernel (``cc/quant/rows.cu``, the
    SwiGLU computed as the rows are read) against its XLA form compiled on
    this GPU, bit for bit: outlier data (``silu`` of -2^8 .. 2^8, exp's
    overflow included), a zero block, 1001 rows of 2 x 2048 (16 scales per
    row) and 3 of 2 x 16512; then that the kernel's path is differentiable
    under jit (its backward reads only ``gate_up``, so the gradients are
    XLA's either way)."""
    import jax_ep
    _native()
    for i, shape in enumerate(((1001, 4096), (3, 33024))):
        gu = outliers(jax.random.key(51 + i), shape).astype(dtype)
        gu = gu.at[0, 128:256].set(0).at[0, shape[1] // 2 + 128:shape[1] // 2 + 256].set(0)
        got = jax.jit(lambda a: jax_ep.quantize_swiglu(a, scale_format, impl="native"))(gu)
        want = jax.jit(lambda a: jax_ep.quantize_swiglu(a, scale_format, impl="xla"))(gu)
        np.testing.assert_array_equal(np.asarray(got[0].view(jnp.uint8)),
                                      np.asarray(want[0].view(jnp.uint8)))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    c = outliers(jax.random.key(55), (1001, 2048))
    grads = [jax.jit(jax.grad(lambda a, impl=impl: jnp.sum(
        jax_ep.quantize_swiglu(a, scale_format, impl=impl)[0].astype(jnp.float32) * c)))(gu)
        for impl, gu in (("native", outliers(jax.random.key(51), (1001, 4096)).astype(dtype)),
                         ("xla", outliers(jax.random.key(51), (1001, 4096)).astype(dtype)))]
    np.testing.assert_array_equal(np.asarray(grads[0], np.float32),
                                  np.asarray(grads[1], np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scale_format", ["f32", "ue8m0"])
def test_native_weight_pair_is_bitwise_xla(dtype, scale_format):
    """``quantize_weights_pair`` on the kernel (``cc/quant/``: one pass, both
    layouts) against XLA's quantization on this GPU, bit for bit: data with
    outliers, a zero block (the 1e-4 floor), G = 3 of 384 x 640 (blocks
    along both axes), and under shard_map on one device."""
    import jax_ep
    _native()
    w = outliers(jax.random.key(21), (3, 384, 640)).astype(dtype)
    w = w.at[1, 128:256, :128].set(0)
    native = jax.jit(lambda a: jax_ep.quantize_weights_pair(a, scale_format=scale_format,
                                                            impl="native"))(w)
    xla = jax.jit(lambda a: jax_ep.quantize_weights_pair(a, scale_format=scale_format,
                                                         impl="xla"))(w)
    for got, want in zip(jax.tree.leaves(native), jax.tree.leaves(xla)):
        assert got.shape == want.shape and got.dtype == want.dtype
        if got.dtype == jnp.float8_e4m3fn:
            got, want = got.view(jnp.uint8), want.view(jnp.uint8)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.jit(jax.shard_map(lambda a: jax_ep.quantize_weights_pair(a, scale_format=scale_format),
                              mesh=mesh, in_specs=jax.sharding.PartitionSpec("ep"),
                              out_specs=jax.sharding.PartitionSpec("ep")))
    for got, want in zip(jax.tree.leaves(f(w)), jax.tree.leaves(native)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
