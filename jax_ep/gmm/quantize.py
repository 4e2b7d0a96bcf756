"""Expert weights quantized for the fp8 grouped matmul in both of its weight
layouts at once (:func:`quantize_weights_pair`): on a CUDA device by the
native kernel (``cuda_quant``), elsewhere by XLA (``jax_ep.fp8``), the same
bits either way."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..fp8 import F32, check_weights, weight_blocks_cast
from . import cuda_quant

__all__ = ["quantize_weights_pair"]


def quantize_weights_pair(w: jax.Array, *, scale_format: str = "f32", impl: str = "auto"):
    """Expert weights quantized in both layouts at once: what the fp8 grouped
    matmul takes as ``w, w_scales`` and ``w_transposed`` when the weights
    change every step (training), so neither layout is re-quantized or
    transposed inside the matmul.

    Args:
      w: ``[G, K, N]`` bf16 / f16 / f32, ``K % 128 == N % 128 == 0``.
      scale_format: ``"f32"`` or ``"ue8m0"``, as ``jax_ep.quantize_weights``.
      impl: ``"auto"`` (the native kernel, ``cc/quant/``, on a CUDA device
        where the extension is built and ``w`` is bf16 / f32: one pass over
        ``w``; else XLA), ``"native"`` (raises where it cannot run) or
        ``"xla"``. The kernel is a custom call XLA does not partition: call
        it per rank (inside ``shard_map``, as the MoE layer's experts do) or
        on unsharded weights; a sharded ``w`` under plain ``jit`` wants
        ``"xla"``.

    Returns:
      ``((q [G, K, N], scales [G, K/128, N/128]), (q_t [G, N, K], scales_t
      [G, N/128, K/128]))``: ``jax_ep.quantize_weights`` in ``"gkn"`` and in
      ``"gnk"``, bit for bit (the kernel divides as XLA:GPU does).
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
    why = cuda_quant.unavailable(w) if impl != "xla" else "impl='xla'"
    if impl == "native" and why is not None:
        raise ValueError(f"quantize_weights_pair impl='native': {why}; use impl='auto' or 'xla'")
    return _pair_st(w, scale_format, why is None)


def _pair(w, scale_format, native):
    if native:
        return cuda_quant.quantize_weights_pair(w, scale_format)
    q, s = weight_blocks_cast(w, scale_format)
    return (q, s), (jnp.swapaxes(q, 1, 2), jnp.swapaxes(s, 1, 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _pair_st(w, scale_format, native):
    return _pair(w, scale_format, native)


def _pair_st_fwd(w, scale_format, native):
    return _pair(w, scale_format, native), jnp.zeros((0,), w.dtype)


def _pair_st_bwd(scale_format, native, like, g):
    (dq, _), (dq_t, _) = g
    return ((dq.astype(F32) + jnp.swapaxes(dq_t, 1, 2).astype(F32)).astype(like.dtype),)


_pair_st.defvjp(_pair_st_fwd, _pair_st_bwd)
