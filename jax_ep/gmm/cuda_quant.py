"""The native fp8 quantization kernel (``cc/quant/``, XLA FFI target
``jax_ep_quantize_weights``): expert weights to fp8 with 128 x 128 block
scales in both layouts in one pass over ``w`` (one read, one write of each
copy), the bits of :func:`jax_ep.quantize_weights` in each layout
(``quantize.quantize_weights_pair``). Needs the native extension and a CUDA
device; no runtime (``jax_ep.initialize``)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import abi, extension
from .._ffi import result_type
from ..mesh_axes import vma_of

TARGET = "jax_ep_quantize_weights"
_DTYPES = ("bfloat16", "float32")


def unavailable(w, need_gpu: bool = False) -> Optional[str]:
    """Why the kernel cannot quantize ``w`` (None: it can, wherever the
    program is lowered for CUDA). ``need_gpu``: also when the default device
    is no CUDA device."""
    if extension.load() is None:
        return f"the native extension is not loaded: {extension.error()}"
    if jnp.dtype(w.dtype).name not in _DTYPES:
        return f"the kernel reads {'/'.join(_DTYPES)} weights, got {w.dtype}"
    if w.size == 0:
        return "w is empty"
    if need_gpu:
        try:
            platform = jax.devices()[0].platform
        except Exception:  # pragma: no cover -- no backend at all
            platform = ""
        if platform != "gpu":
            return f"the kernel runs on CUDA devices (the default device is {platform or 'none'})"
    return None


def quantize_weights_pair(w, scale_format: str):
    """``((q [G, K, N], s [G, K/128, N/128]), (q_t [G, N, K], s_t [G, N/128,
    K/128]))`` of ``w [G, K, N]`` by the kernel (shapes checked by the caller).
    f32 scales divide as XLA:GPU does (``div.full.f32``), so the bits equal
    XLA's quantization on the same GPU."""
    G, K, N = w.shape
    mode = abi.fp8_scale_mode("ue8m0" if scale_format == "ue8m0" else "xla_gpu")
    vma = vma_of(w)
    outs = (result_type((G, K, N), jnp.float8_e4m3fn, vma=vma),
            result_type((G, K // 128, N // 128), jnp.float32, vma=vma),
            result_type((G, N, K), jnp.float8_e4m3fn, vma=vma),
            result_type((G, N // 128, K // 128), jnp.float32, vma=vma))
    # vmap: one call per batch element (a batch of expert stacks is rare)
    q, s, q_t, s_t = jax.ffi.ffi_call(TARGET, outs, vmap_method="sequential")(
        w, scale_mode=np.int32(mode))
    return (q, s), (q_t, s_t)
