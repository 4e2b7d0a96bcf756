"""Expert weights quantized for the fp8 grouped matmul in both of its weight
layouts at once (:func:`quantize_weights_pair`): on a CUDA device by the
native kernel (``cuda_quant``), elsewhere by XLA (``jax_ep.fp8``), the same
bits either way."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..fp8 import F32, check_gate_up, check_weights, fp8_cast, weight_blocks_cast
from ..first_order import FP8_PATH, first_order_only
from . import cuda_quant

__all__ = ["quantize_weights_pair", "cast_rows", "quantize_swiglu", "swiglu_rows"]


def quantize_weights_pair(w: jax.Array, *, scale_format: str = "f32", impl: str = "auto"):
    """Expert weights quantized in both layouts at once: what the fp8 grouped
    matmul takes as ``w, w_scales`` and ``w_transposed`` when the weights
    change every step (training), so neither layout is re-quantized or
    transposed inside the matmul.

    Args:
      w: ``[G, K, N]`` bf16 / f16 / f32, ``K % 128 == N % 128 == 0``.
      scale_format: ``"f32"`` or ``"ue8m0"``, as ``jax_ep.quantize_weights``.
      impl: ``"auto"`` (the native kernel, ``cc/quant/``, where the program
        is lowered for CUDA, the extension is built and ``w`` is bf16 / f32:
        one pass over ``w``; else XLA), ``"native"`` (raises where it cannot
        run) or ``"xla"``. The kernel is a custom call XLA does not partition: call
        it per rank (inside ``shard_map``, as the MoE layer's experts do) or
        on unsharded weights; a sharded ``w`` under plain ``jit`` wants
        ``"xla"``.

    Returns:
      ``((q [G, K, N], scales [G, K/128, N/128]), (q_t [G, N, K], scales_t
      [G, N/128, K/128]))``: ``jax_ep.quantize_weights`` in ``"gkn"`` and in
      ``"gnk"``, bit for bit for finite weights (the kernel divides as
      XLA:GPU does; its block maximum skips a NaN that XLA's keeps).
      ``grouped_matmul(x, q, gs, x_scales=xs, w_scales=scales,
      w_transposed=(q_t, scales_t))``.

    Gradient: straight-through to ``w`` (the cotangents of ``q`` and of
    ``q_t`` transposed back, summed; ``grouped_matmul`` sends none through
    ``w_transposed``), cast to ``w.dtype``.
    """
    if impl not in ("auto", "native", "xla"):
        raise ValueError(f"quantize_weights_pair: impl must be 'auto', 'native' or 'xla', got "
                         f"{impl!r}")
    check_weights("quantize_weights_pair", w, scale_format)
    if impl == "native":
        why = cuda_quant.unavailable(w, need_gpu=True)
        if why is not None:
            raise ValueError(f"quantize_weights_pair impl='native': {why}; use impl='auto' or "
                             "'xla'")
    elif impl == "auto" and cuda_quant.unavailable(w) is not None:
        impl = "xla"
    return _pair_st(w, scale_format, impl)


def _xla_pair(w, scale_format):
    q, s = weight_blocks_cast(w, scale_format)
    return (q, s), (jnp.swapaxes(q, 1, 2), jnp.swapaxes(s, 1, 2))


def _pair(w, scale_format, impl):
    """By ``impl``: "native", "xla", or "auto": the kernel where the program
    is lowered for CUDA, XLA where for another platform (a CPU device on a GPU
    host, an export for CPU)."""
    xla = functools.partial(_xla_pair, scale_format=scale_format)
    native = functools.partial(cuda_quant.quantize_weights_pair, scale_format=scale_format)
    if impl == "auto":
        return jax.lax.platform_dependent(w, cuda=native, default=xla)
    return native(w) if impl == "native" else xla(w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _pair_st(w, scale_format, impl):
    return _pair(w, scale_format, impl)


def _pair_st_fwd(w, scale_format, impl):
    (w,) = first_order_only("quantize_weights_pair", FP8_PATH, w)
    return _pair(w, scale_format, impl), jnp.zeros((0,), w.dtype)


def _pair_st_bwd(scale_format, impl, like, g):
    (dq, _), (dq_t, _) = g
    return ((dq.astype(F32) + jnp.swapaxes(dq_t, 1, 2).astype(F32)).astype(like.dtype),)


_pair_st.defvjp(_pair_st_fwd, _pair_st_bwd)


def cast_rows(x, impl: str = "auto"):
    """:func:`jax_ep.fp8_cast` of ``x [M, H]`` with f32 scales, by ``impl``:
    ``"native"`` the row kernel (``cuda_quant.quantize_rows``: one read of
    ``x`` where XLA's cast reads it twice; the program must be lowered for
    CUDA), ``"xla"``, or ``"auto"`` (the kernel where the program is lowered
    for CUDA and it can cast ``x``, else XLA). The same bits on one GPU for
    finite ``x`` (``cuda_quant.quantize_rows``: where a NaN goes).
    -> ``(q [M, H] e4m3, scales [M, H/128] f32)``; no gradient."""
    return cuda_quant.by_impl("cast_rows", impl, lambda: cuda_quant.rows_unavailable(x),
                              cuda_quant.quantize_rows, fp8_cast, x)


def swiglu_rows(gate_up):
    """``silu(gate) * up`` of ``gate_up [M, 2H] = [gate | up]`` -> ``[M, H]``
    in ``gate_up``'s dtype: ``g / (1 + exp(-g)) * u`` in f32, rounded once
    (what the SwiGLU cast kernel computes as it reads the rows). The rounding
    is an explicit ``reduce_precision``: XLA:GPU drops an f32 -> bf16 -> f32
    convert pair (excess precision allowed), which the cast would form."""
    g, u = jnp.split(gate_up.astype(F32), 2, axis=-1)
    h = g / (1 + jnp.exp(-g)) * u
    info = jnp.finfo(gate_up.dtype)
    if info.bits < 32:
        h = lax.reduce_precision(h, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return h.astype(gate_up.dtype)


def quantize_swiglu(gate_up: jax.Array, scale_format: str = "f32", impl: str = "auto"):
    """The SwiGLU of the experts' fused gate/up output cast to fp8 as dispatch
    casts (:func:`jax_ep.fp8_cast`): the down projection's fp8 rows. On a
    GPU the kernel makes them in one pass over ``gate_up``; XLA's fusions read
    it twice (once for the blocks' maxima, once for the cast).

    Args:
      gate_up: ``[T, 2H]`` bf16 / f32 (the kernel's dtypes) or f16 (XLA only;
        a SwiGLU above 65504 rounds to inf, which empties its block),
        ``[gate | up]`` (the gate half first), ``H % 128 == 0``.
      scale_format: ``"f32"`` or ``"ue8m0"``, as :func:`jax_ep.fp8_cast`.
      impl: ``"auto"`` (the kernel, ``cc/quant/rows.cu``, where the program
        is lowered for CUDA and the extension can cast ``gate_up``; else XLA),
        ``"native"`` (the kernel or an error) or ``"xla"``.

    Returns:
      ``(q [T, H] float8_e4m3fn, scales [T, H/128] float32)`` =
      ``fp8_cast(swiglu_rows(gate_up))``: ``silu(g) * u`` in f32 rounded once
      to ``gate_up``'s dtype, then cast per row and 128 columns; what
      ``jax_ep.grouped_matmul(x_scales=...)`` takes. The kernel's block
      maximum skips a NaN that XLA's keeps (``cuda_quant.quantize_rows``).

    Gradient: the cotangent of ``q`` taken as that of the dequantized rows
    (the fp8 grouped matmul's convention), passed straight through the cast
    and back through the SwiGLU (f32) to ``gate_up``, in its dtype.
    """
    check_gate_up("quantize_swiglu", gate_up, scale_format)
    return _swiglu_st(gate_up, scale_format, impl)


def _swiglu_cast(gate_up, scale_format, impl):
    xla = lambda gu: fp8_cast(swiglu_rows(gu), scale_format)
    native = functools.partial(cuda_quant.quantize_rows, scale_format=scale_format, swiglu=True)
    unavailable = lambda: cuda_quant.rows_unavailable(gate_up, cuda_quant.SWIGLU_ROWS_TARGET, 2)
    return cuda_quant.by_impl("quantize_swiglu", impl, unavailable, native, xla, gate_up)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _swiglu_st(gate_up, scale_format, impl):
    return _swiglu_cast(gate_up, scale_format, impl)


def _swiglu_st_fwd(gate_up, scale_format, impl):
    (gate_up,) = first_order_only("quantize_swiglu", FP8_PATH, gate_up)
    return _swiglu_cast(gate_up, scale_format, impl), gate_up


def _swiglu_st_bwd(scale_format, impl, gate_up, g):
    def f32_swiglu(gu):   # jax.nn.silu: a derivative without exp(-g)'s overflow
        a, b = jnp.split(gu, 2, axis=-1)
        return jax.nn.silu(a) * b
    _, back = jax.vjp(f32_swiglu, gate_up.astype(F32))
    return (back(g[0].astype(F32))[0].astype(gate_up.dtype),)


_swiglu_st.defvjp(_swiglu_st_fwd, _swiglu_st_bwd)
