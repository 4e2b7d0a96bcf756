"""The fp8-e4m3 cast with per-token, per-128-channel scales: the bits every
backend's fp8 path (normal and low-latency dispatch) must give."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import FP8_SCALE_FORMATS

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128


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
    if scale_format not in FP8_SCALE_FORMATS:
        raise ValueError(f"fp8_cast: scale_format must be one of {FP8_SCALE_FORMATS}, got "
                         f"{scale_format!r}")
    T, H = x.shape
    xf = x.astype(F32).reshape(T, H // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), F32(1e-4))
    if scale_format == "ue8m0":
        m, p = jnp.frexp(amax)   # amax = m 2^p, m in [0.5, 1); 448 = 1.75 2^8
        k = jnp.where(m <= F32(0.875), p - 9, p - 8)
        inv_pow2 = jnp.ldexp(jnp.ones_like(amax), -k)
        q = jnp.clip(xf * inv_pow2[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
        return q.reshape(T, H), jnp.ldexp(jnp.ones_like(amax), k)
    scale = amax * F32(1.0 / FP8_MAX)
    inv = F32(FP8_MAX) / amax
    q = jnp.clip(xf * inv[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return q.reshape(T, H), scale
