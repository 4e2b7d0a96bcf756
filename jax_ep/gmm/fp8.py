"""The fp8 grouped matmul: ``x`` e4m3 with per-row, per-128-column scales (what
dispatch sends) times ``w`` e4m3 with 128 x 128 block scales, f32
accumulation, under a ``custom_vjp``.

Cotangent convention: the cotangent of an fp8 operand is the cotangent of its
*dequantized* value (``x * x_scales``, ``w * w_scales``), in a wider float
dtype (JAX lets a ``custom_vjp`` return a wider float cotangent for an fp8
primal); the scales get none. ``jax_ep.quantize_activations`` /
``quantize_weights`` and fp8 dispatch pass such a cotangent straight through
to the bf16/f32 values they cast.

The forward and dx run in the fp8 kernel's NT form (``ops_nt``): forward
``(x * xs) @ ((v * vs)[g])^T`` with ``v = w^T`` (``w_layout="gkn"``) or ``w``
as stored (``"gnk"``); dx ``(dy_q * dys) @ ((w * ws)[g])`` with ``dy`` cast
as dispatch casts (``GroupedMatmulConfig.fp8_dx``; else in bf16) against
``w`` as stored (``"gkn"``) or ``w^T`` (``"gnk"``). dw runs in bf16 (``tgmm``
on ``x * xs`` rounded to bf16), or with ``GroupedMatmulConfig.fp8_dw`` in the
fp8 dw kernel's form: ``x``'s per-row scales vary along dw's contraction (the
rows), so they cannot be applied after an fp8 product; ``x * xs`` and ``dy``
are recast per column and 128 rows of their group (``fp8_columns``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._ffi import to_vma, vma_of
from ..first_order import FP8_PATH, first_order_only
from ..fp8 import FP8_BLOCK, WEIGHT_LAYOUTS, check_quantized_pair
from . import fp8_columns, rows
from .config import GroupedMatmulConfig
from .ops import gmm, offsets, tgmm
from .quantize import cast_rows
from .select import fp8_cluster, fp8_tma_store, plan_fp8
from .xla import dequantize_blocks, dequantize_rows

E4M3 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16


def is_fp8_call(x, w, x_scales, w_scales) -> bool:
    """Whether these operands ask for the fp8 path (a scale, or an fp8 operand)."""
    return (x_scales is not None or w_scales is not None
            or jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits == 8
            or jnp.issubdtype(w.dtype, jnp.floating) and jnp.finfo(w.dtype).bits == 8)


def check_operands(x, x_scales, w, w_scales, w_layout: str, out_dtype):
    """Trace-time checks of the fp8 path: one clear error naming cause and remedy."""
    fn = "jax_ep.grouped_matmul (fp8)"
    if w_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"{fn}: w_layout must be one of {WEIGHT_LAYOUTS}, got {w_layout!r}")
    _check_pairing(fn, x, x_scales, w, w_scales)
    w_dims = "[G, K, N]" if w_layout == "gkn" else "[G, N, K]"
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"{fn}: expected x [M, K] (or [G, C, K], the masked layout) and w "
                         f"{w_dims} (w_layout={w_layout!r}), got {x.shape} and {w.shape}")
    m, k = x.shape
    g, kw, n = w.shape if w_layout == "gkn" else (w.shape[0], w.shape[2], w.shape[1])
    if k != kw:
        raise ValueError(f"{fn}: contracting dims differ: x {x.shape}, w {w.shape} "
                         f"(w_layout={w_layout!r}: w is {w_dims})")
    if k % FP8_BLOCK or n % FP8_BLOCK:
        raise ValueError(f"{fn}: K and N must be multiples of {FP8_BLOCK} (the scale blocks), "
                         f"got K={k}, N={n}; pad the widths, or use the bf16 path")
    ws_want = ((g, k // FP8_BLOCK, n // FP8_BLOCK) if w_layout == "gkn"
               else (g, n // FP8_BLOCK, k // FP8_BLOCK))
    for name, s, want, src in (("x_scales", x_scales, (m, k // FP8_BLOCK),
                                "Dispatched.x_scales or jax_ep.quantize_activations"),
                               ("w_scales", w_scales, ws_want,
                                f"jax_ep.quantize_weights(layout={w_layout!r})")):
        if s.dtype != jnp.float32:
            raise TypeError(f"{fn}: {name} must be float32 (UE8M0 scales as their f32 powers "
                            f"of two), got {s.dtype}")
        if s.shape != want:
            raise ValueError(f"{fn}: {name} must be {list(want)} for x {x.shape}, w {w.shape} "
                             f"(w_layout={w_layout!r}), got {s.shape}; take it from {src}")
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"{fn}: preferred_element_type must be a float dtype, got {out_dtype}")


def flatten_masked(x, x_scales, w):
    """``(x, x_scales, C)``: the masked layout ``x [G, C, K]`` with ``x_scales
    [G, C, K/128]`` flattened to ``[G·C, *]`` (``C`` None for ``x [M, K]``,
    returned as is); the flat operands then go through :func:`check_operands`."""
    if w.ndim != 3:   # check_operands names the shapes
        return x, x_scales, None
    x2, c = rows.flatten_masked(x, w.shape[0])
    if c is None or x_scales is None:
        return x2, x_scales, c
    if x_scales.ndim != 3 or x_scales.shape[:2] != x.shape[:2]:
        raise ValueError(f"jax_ep.grouped_matmul (fp8): the masked layout x {x.shape} takes "
                         f"x_scales [G, C, K/128], got {x_scales.shape}")
    return x2, x_scales.reshape(x2.shape[0], x_scales.shape[2]), c


def _check_pairing(fn, x, x_scales, w, w_scales):
    """Both operands fp8-e4m3, each with its scales."""
    for name, a, s, sname, quant in (("x", x, x_scales, "x_scales", "jax_ep.quantize_activations"),
                                     ("w", w, w_scales, "w_scales", "jax_ep.quantize_weights")):
        if s is None:
            raise ValueError(
                f"{fn}: {sname} is missing. An fp8 operand or a scale selects the fp8 path, "
                f"which needs both x with x_scales and w with w_scales: quantize {name} with "
                f"{quant}, or pass bf16/f32 x and w without scales for the bf16 path")
        if a.dtype != E4M3:
            raise TypeError(f"{fn}: {name} must be float8_e4m3fn when {sname} is given, got "
                            f"{a.dtype}; quantize it with {quant}, or drop the scales")


def check_transposed(w, w_layout: str, w_transposed):
    """``w_transposed`` (``(q, scales)`` of ``w`` in the other layout) checked
    against ``w``, with no gradient: ``(q, scales)``, or None."""
    if w_transposed is None:
        return None
    other = "gnk" if w_layout == "gkn" else "gkn"
    gkn = w.shape if w_layout == "gkn" else (w.shape[0], w.shape[2], w.shape[1])
    q, s = check_quantized_pair("jax_ep.grouped_matmul (fp8)", "w_transposed", gkn, other,
                                w_transposed)
    return jax.lax.stop_gradient(q), jax.lax.stop_gradient(s)


def grouped_matmul_fp8(x, x_scales, w, w_scales, group_sizes, *, w_layout: str,
                       out_dtype, cfg: GroupedMatmulConfig, w_t=None, c=None):
    """The fp8 path of :func:`jax_ep.grouped_matmul` (operands checked by
    :func:`check_operands`, ``group_sizes`` int32 ``[G]``; ``w_t``: ``w`` in
    the other layout, :func:`check_transposed`; ``c``: the masked layout's
    rows per group, ``x`` flattened to ``[G·C, K]``) -> ``[M, N]``."""
    ops = (x, x_scales, w, w_scales, group_sizes) + (w_t or ())
    axes = frozenset().union(*(vma_of(a) for a in ops))
    ops = tuple(to_vma(a, axes) for a in ops)
    return _fp8_vjp(*ops[:5], ops[5:] or None, cfg, jnp.dtype(out_dtype), w_layout, c)


def _nt_weights(w, ws, w_layout: str, op: str, w_t=None):
    """``(v [G, Nout, Kc], vs)`` of ``op`` in the kernel's NT form: the forward
    contracts K (``v = w^T`` for ``"gkn"``), dx contracts N (``v = w`` for
    ``"gkn"``); ``w^T`` is ``w_t`` where given, else a transpose."""
    if (w_layout == "gkn") == (op == "fwd"):
        return w_t if w_t is not None else (jnp.swapaxes(w, 1, 2), jnp.swapaxes(ws, 1, 2))
    return w, ws


def ops_nt(cfg: GroupedMatmulConfig, op: str, x, xs, v, vs, group_sizes, out_dtype,
           row_groups=None):
    """``out[rows of g] = (x * xs)[rows of g] @ ((v * vs)[g])^T`` on the variant
    ``select.plan_fp8`` picks, on ``select.fp8_cluster``'s clusters and with
    ``select.fp8_tma_store``'s stores; ``x [M, Kc]``, ``v [G, Nout, Kc]`` ->
    ``[M, Nout]``; ``row_groups``: as ``ops.gmm``'s."""
    off = offsets(group_sizes, x.shape[0]) if row_groups is None else row_groups
    variant = plan_fp8(cfg, op, x, xs, v, vs, out_dtype)
    out = variant.launch(x, xs, v, vs, off, out_dtype, cfg.interpret,
                         fp8_cluster(cfg, variant, v), fp8_tma_store(cfg, variant, v, out_dtype))
    axes = vma_of(x) | vma_of(xs) | vma_of(v) | vma_of(vs) | vma_of(group_sizes)
    return to_vma(out, axes)


def _forward(x, xs, w, ws, group_sizes, w_t, cfg, out_dtype, w_layout, c):
    v, vs = _nt_weights(w, ws, w_layout, "fwd", w_t)
    return ops_nt(cfg, "fwd", x, xs, v, vs, group_sizes, out_dtype,
                  rows.of_layout(group_sizes, c))


_fp8_vjp = functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))(_forward)


def _fp8_vjp_fwd(x, xs, w, ws, group_sizes, w_t, cfg, out_dtype, w_layout, c):
    x, xs, w, ws = first_order_only("grouped_matmul", FP8_PATH, x, xs, w, ws)
    return (_forward(x, xs, w, ws, group_sizes, w_t, cfg, out_dtype, w_layout, c),
            (x, xs, w, ws, group_sizes, w_t))


def _fp8_vjp_bwd(cfg, out_dtype, w_layout, c, res, dy):
    x, xs, w, ws, group_sizes, w_t = res
    if cfg.fp8_dx or cfg.fp8_dw:   # dy is cast to fp8 below
        (dy,) = first_order_only("grouped_matmul", FP8_PATH, dy)
    b = rows.backward_rows(group_sizes, c)   # masked: rows outside the groups get none
    dy = b.clean(dy)
    dx = b.clean(_dx(cfg, w_layout, w, ws, group_sizes, dy, w_t, b.row_groups))
    dw = _dw(cfg, w_layout, b.clean(x), b.clean(xs), b.dw_groups, dy)
    axes = vma_of(x) | vma_of(xs) | vma_of(w) | vma_of(ws) | vma_of(group_sizes)
    return to_vma(dx, axes), None, to_vma(dw, axes), None, None, None


_fp8_vjp.defvjp(_fp8_vjp_fwd, _fp8_vjp_bwd)


def _dx(cfg, w_layout, w, ws, group_sizes, dy, w_t=None, row_groups=None):
    """``dy @ (w * ws)[g]^T`` in dy's dtype: in fp8 (``cfg.fp8_dx``) or bf16;
    ``row_groups``: as ``ops.gmm``'s."""
    if cfg.fp8_dx:
        # rows past the groups' end may hold anything; each row is cast on its own
        # and those rows are never read
        dq, ds = cast_rows(dy, cfg.fp8_dx_cast)
        v, vs = _nt_weights(w, ws, w_layout, "dx", w_t)
        return ops_nt(cfg, "dx", dq, ds, v, vs, group_sizes, dy.dtype, row_groups)
    wd = dequantize_blocks(w, ws).astype(BF16)
    dx = gmm(dy.astype(BF16), wd, group_sizes, transpose_rhs=w_layout == "gkn", config=cfg,
             out_dtype=BF16, row_groups=row_groups)
    return dx.astype(dy.dtype)


def _dw(cfg, w_layout, x, xs, group_sizes, dy):
    """``(x * xs)[rows of g]^T @ dy[rows of g]`` (f32 accumulation, the result
    rounded to bf16 as the bf16 path's dw is: the Pallas dw kernels write
    their input dtype), returned as an f32 cotangent of the dequantized weight
    in ``w_layout``: on bf16 operands, or (``cfg.fp8_dw``) on both recast to
    fp8 per column and 128 rows of their group."""
    dw = (dw_fp8 if cfg.fp8_dw else dw_bf16)(cfg, x, xs, group_sizes, dy).astype(jnp.float32)
    return dw if w_layout == "gkn" else jnp.swapaxes(dw, 1, 2)


def dw_bf16(cfg, x, xs, group_sizes, dy):
    """dw on the bf16 dw kernels (``tgmm``) on ``x * xs`` and ``dy`` rounded to
    bf16 -> ``[G, K, N]`` bf16."""
    xd = dequantize_rows(x, xs).astype(BF16)
    return tgmm(xd, dy.astype(BF16), group_sizes, config=cfg, out_dtype=BF16)


def dw_fp8(cfg, x, xs, group_sizes, dy):
    """dw on the fp8 dw kernel (``pallas_fp8_dw``, or its XLA contract): rows
    regrouped onto 128-row blocks, transposed and cast per column
    (``fp8_columns``) -> ``[G, K, N]`` bf16."""
    a, a_s, c, c_s, seg = fp8_columns.dw_operands(x, xs, dy, group_sizes)
    variant = plan_fp8(cfg, "dw", a, a_s, c, c_s, BF16)
    return variant.launch(a, a_s, c, c_s, seg, BF16, cfg.interpret, 1)
