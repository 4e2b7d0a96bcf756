"""The fp8-e4m3 casts: per-token, per-128-channel scales (``fp8_cast``: the bits
every backend's fp8 path, normal and low-latency dispatch, must give; and
:func:`quantize_activations`, the same cast with a straight-through gradient)
and 128 x 128 block scales for expert weights (:func:`quantize_weights`)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .config import FP8_SCALE_FORMATS
from .first_order import FP8_PATH, first_order_only

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128
WEIGHT_LAYOUTS = ("gkn", "gnk")
_SOURCE_DTYPES = ("bfloat16", "float16", "float32")


def _scale_and_multiplier(amax, scale_format: str):
    """(scale, multiplier) of blocks whose largest magnitude is ``amax`` (already
    floored at 1e-4): ``x ≈ e4m3(clip(x * multiplier, ±448)) * scale``."""
    if scale_format == "ue8m0":
        m, p = jnp.frexp(amax)   # amax = m 2^p, m in [0.5, 1); 448 = 1.75 2^8
        k = jnp.where(m <= F32(0.875), p - 9, p - 8)
        return jnp.ldexp(jnp.ones_like(amax), k), jnp.ldexp(jnp.ones_like(amax), -k)
    return amax * F32(1.0 / FP8_MAX), F32(FP8_MAX) / amax


def _to_e4m3(x, multiplier):
    return jnp.clip(x * multiplier, -FP8_MAX, FP8_MAX).astype(FP8)


def _cast_blocks(xf, axes, scale_format: str):
    """f32 ``xf`` with each block's elements along ``axes`` -> (q e4m3 of
    ``xf``'s shape, one scale per block: ``xf``'s shape without ``axes``)."""
    amax = jnp.maximum(jnp.max(jnp.abs(xf), axis=axes, keepdims=True), F32(1e-4))
    scale, mult = _scale_and_multiplier(amax, scale_format)
    return _to_e4m3(xf, mult), jnp.squeeze(scale, axis=axes)


def _check_format(fn: str, scale_format: str):
    if scale_format not in FP8_SCALE_FORMATS:
        raise ValueError(f"{fn}: scale_format must be one of {FP8_SCALE_FORMATS}, got "
                         f"{scale_format!r}")


def fp8_cast(x: jax.Array, scale_format: str = "f32"):
    """Per-token, per-128-channel fp8-e4m3 cast (the bits the native kernel must match).

    ``scale_format="ue8m0"``: the scale is the smallest power of two with
    ``448 * scale >= amax`` (found from ``frexp(amax)`` without dividing), and
    ``q = e4m3(x * 2^-k)`` is a multiply by a power of two: exact, so every
    platform gives the same bits (DeepSeek-V3's UE8M0 scales). The default
    ``"f32"`` is described below.

    x ``[T, H]`` (H % 128 == 0) -> (q ``[T, H]`` e4m3, scales ``[T, H/128]`` f32)
    with ``x ≈ q * scale``: ``amax = max(max|x|, 1e-4)``, ``scale = amax / 448``,
    ``q = e4m3(clip(x * (448 / amax), ±448))`` (IEEE f32, round to nearest even).

    The scale is ``amax * f32(1/448)``, a multiply, because XLA rewrites
    division by a constant into that. ``448 / amax`` is an IEEE division on the
    CPU but XLA:GPU lowers f32 division to the approximate PTX ``div.full.f32``,
    so the bits of q differ between platforms in rare last-ulp cases. The native
    kernel follows XLA:GPU (``KernelTuning(fp8_ieee_division=True)`` switches it to IEEE), so
    native and reference agree bit for bit when both run on the GPU."""
    _check_format("fp8_cast", scale_format)
    _check_source("fp8_cast", x, 2, "x [T, H]", (1,))
    T, H = x.shape
    q, scale = _cast_blocks(x.astype(F32).reshape(T, H // FP8_BLOCK, FP8_BLOCK), 2, scale_format)
    return q.reshape(T, H), scale


def _check_source(fn: str, x, ndim: int, shape_text: str, block_dims):
    if not hasattr(x, "dtype") or x.ndim != ndim:
        raise ValueError(f"{fn}: expected {shape_text}, got shape {getattr(x, 'shape', None)}")
    if jnp.dtype(x.dtype).name not in _SOURCE_DTYPES:
        raise TypeError(f"{fn}: quantizes {'/'.join(_SOURCE_DTYPES)} values, got {x.dtype} "
                        "(an fp8 array is already quantized)")
    for d in block_dims:
        if x.shape[d] % FP8_BLOCK:
            raise ValueError(f"{fn}: {shape_text} needs dims {list(block_dims)} divisible by "
                             f"{FP8_BLOCK} (the scale blocks), got {x.shape}; pad the "
                             "model width to a multiple of 128")


def quantize_activations(x: jax.Array, scale_format: str = "f32"):
    """The fp8 cast of dispatch (:func:`fp8_cast`, bit for bit), differentiable
    straight-through.

    Args:
      x: ``[T, H]`` bf16 / f16 / f32, ``H % 128 == 0``.
      scale_format: ``"f32"`` (``amax / 448``) or ``"ue8m0"`` (powers of two).

    Returns:
      ``(q [T, H] float8_e4m3fn, scales [T, H/128] float32)``, ``x ≈ q * scales``
      per row and 128 columns: what ``jax_ep.grouped_matmul(x_scales=...)``
      takes.

    Gradient: the cotangent arriving for ``q`` is taken as the cotangent of the
    dequantized ``q * scales`` (the convention of the fp8 grouped matmul, which
    returns exactly that) and passed to ``x`` unchanged, cast to ``x.dtype``
    (straight-through); a cotangent of ``scales`` is ignored. First order
    only: a second-order derivative raises (fp8 values carry no tangent).
    """
    _check_format("quantize_activations", scale_format)
    _check_source("quantize_activations", x, 2, "x [T, H]", (1,))
    return _activations_st(x, scale_format)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _activations_st(x, scale_format):
    return fp8_cast(x, scale_format)


def _activations_st_fwd(x, scale_format):
    (x,) = first_order_only("quantize_activations", FP8_PATH, x)
    return fp8_cast(x, scale_format), jnp.zeros((0,), x.dtype)


def _activations_st_bwd(scale_format, like, g):
    return (g[0].astype(like.dtype),)


_activations_st.defvjp(_activations_st_fwd, _activations_st_bwd)


def weight_blocks_cast(w, scale_format: str = "f32"):
    """``w [G, K, N]`` -> (``q [G, K, N]`` e4m3, ``scales [G, K/128, N/128]`` f32),
    one scale per 128 x 128 block with :func:`fp8_cast`'s rounding rules."""
    G, K, N = w.shape
    wf = w.astype(F32).reshape(G, K // FP8_BLOCK, FP8_BLOCK, N // FP8_BLOCK, FP8_BLOCK)
    q, scale = _cast_blocks(wf, (2, 4), scale_format)
    return q.reshape(G, K, N), scale


def column_blocks_cast(x, scale_format: str = "f32"):
    """``x [R, C]`` -> (``q [R, C]`` e4m3, ``scales [R/128, C]`` f32): one scale
    per 128 rows of each column, :func:`fp8_cast`'s rounding rules (the fp8
    path's dw operands, whose contraction runs along the rows)."""
    _check_format("column_blocks_cast", scale_format)
    R, C = x.shape
    q, scale = _cast_blocks(x.astype(F32).reshape(R // FP8_BLOCK, FP8_BLOCK, C), 1, scale_format)
    return q.reshape(R, C), scale


def quantize_weights(w: jax.Array, *, layout: str = "gkn", scale_format: str = "f32",
                     quantized=None):
    """Expert weights to fp8-e4m3 with one scale per 128 x 128 block.

    Per block: ``amax = max(max|w|, 1e-4)``, ``scale = amax * f32(1/448)``,
    ``q = e4m3(clip(w * (448 / amax), ±448))`` (``"f32"``), or the power-of-two
    scale of :func:`fp8_cast`'s ``"ue8m0"`` (an exact cast).

    Args:
      w: ``[G, K, N]`` bf16 / f16 / f32 (one ``[K, N]`` matrix per group, as
        ``jax_ep.grouped_matmul`` takes it), ``K % 128 == N % 128 == 0``.
      layout: ``"gkn"`` -> ``q [G, K, N]``, ``scales [G, K/128, N/128]``;
        ``"gnk"`` -> the same values transposed, ``q [G, N, K]``, ``scales
        [G, N/128, K/128]`` (the contraction contiguous, as DeepGEMM and torch
        store expert weights); pass the same ``w_layout`` to the matmul.
      scale_format: ``"f32"`` or ``"ue8m0"``.
      quantized: ``(q, scales)`` of ``w`` in ``layout`` from an earlier call
        (made once per optimizer step and shared by its micro-batches, or
        once for inference): returned as they are, nothing recomputed (their
        own scale format, whatever ``scale_format`` says), with the same
        gradient to ``w``. None (default): quantize here.

    Returns:
      ``(q float8_e4m3fn, scales float32)`` in ``layout``: ``q [G, K, N]``,
      ``scales [G, K/128, N/128]`` (``"gkn"``) or ``q [G, N, K]``, ``scales
      [G, N/128, K/128]`` (``"gnk"``).

    Gradient: straight-through, as :func:`quantize_activations` (the cotangent
    of ``q`` is that of the dequantized weight; it reaches ``w`` cast to
    ``w.dtype``, transposed back for ``"gnk"``).
    """
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"quantize_weights: layout must be one of {WEIGHT_LAYOUTS}, got "
                         f"{layout!r}")
    check_weights("quantize_weights", w, scale_format)
    if quantized is None:
        return _weights_st(w, layout, scale_format)
    q, s = check_quantized_pair("quantize_weights", "quantized", w.shape, layout, quantized)
    return _reused_st(w, q, s, layout)


def check_weights(fn: str, w, scale_format: str) -> None:
    """``fn``'s checks of expert weights ``w [G, K, N]`` (bf16 / f16 / f32, K
    and N multiples of 128) and of ``scale_format``."""
    _check_format(fn, scale_format)
    _check_source(fn, w, 3, "w [G, K, N]", (1, 2))


def check_gate_up(fn: str, gate_up, scale_format: str) -> None:
    """``fn``'s checks of SwiGLU rows ``gate_up [T, 2H] = [gate | up]`` (bf16
    / f16 / f32, H a multiple of 128) and of ``scale_format``."""
    _check_format(fn, scale_format)
    _check_source(fn, gate_up, 2, "gate_up [T, 2H]", ())
    if gate_up.shape[1] % (2 * FP8_BLOCK):
        raise ValueError(f"{fn}: gate_up [T, 2H] needs H divisible by {FP8_BLOCK} (the scale "
                         f"blocks), got {gate_up.shape}; pad the expert width to a multiple "
                         "of 128")


def check_quantized_pair(fn: str, arg: str, gkn_shape, layout: str, pair):
    """``pair`` as ``(q, scales)`` of the weights ``[G, K, N]`` (``gkn_shape``)
    quantized in ``layout`` (what :func:`quantize_weights` returns) -> ``(q,
    scales)``; else one error naming the shapes wanted and the remedy."""
    g, k, n = gkn_shape
    q_dims = [g, k, n] if layout == "gkn" else [g, n, k]
    s_dims = [g, q_dims[1] // FP8_BLOCK, q_dims[2] // FP8_BLOCK]
    got = f"{type(pair).__name__}, not a (q, scales) pair"
    if isinstance(pair, (tuple, list)) and len(pair) == 2:
        q, s = (jnp.asarray(a) for a in pair)
        if (list(q.shape), list(s.shape), q.dtype, s.dtype) == (q_dims, s_dims, FP8, F32):
            return q, s
        got = f"q {list(q.shape)} {q.dtype}, scales {list(s.shape)} {s.dtype}"
    raise ValueError(
        f"{fn}: {arg} must be (q {q_dims} float8_e4m3fn, scales {s_dims} float32): the "
        f"weights [G, K, N] = {[g, k, n]} in layout {layout!r}; got {got}; make it with "
        f"jax_ep.quantize_weights(w, layout={layout!r})")


def _weights(w, layout, scale_format):
    q, s = weight_blocks_cast(w, scale_format)
    if layout == "gnk":
        return jnp.swapaxes(q, 1, 2), jnp.swapaxes(s, 1, 2)
    return q, s


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _weights_st(w, layout, scale_format):
    return _weights(w, layout, scale_format)


def _weights_st_fwd(w, layout, scale_format):
    (w,) = first_order_only("quantize_weights", FP8_PATH, w)
    return _weights(w, layout, scale_format), jnp.zeros((0,), w.dtype)


def _weights_st_bwd(layout, scale_format, like, g):
    dq = g[0] if layout == "gkn" else jnp.swapaxes(g[0], 1, 2)
    return (dq.astype(like.dtype),)


_weights_st.defvjp(_weights_st_fwd, _weights_st_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _reused_st(w, q, s, layout):
    return q, s


def _reused_st_fwd(w, q, s, layout):
    (w,) = first_order_only("quantize_weights", FP8_PATH, w)
    return (q, s), jnp.zeros((0,), w.dtype)


def _reused_st_bwd(layout, like, g):
    return _weights_st_bwd(layout, None, like, g) + (None, None)


_reused_st.defvjp(_reused_st_fwd, _reused_st_bwd)
