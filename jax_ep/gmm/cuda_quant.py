"""The native fp8 quantization kernels (``cc/quant/``): expert weights to
fp8 with 128 x 128 block scales in both layouts in one pass over ``w``
(``jax_ep_quantize_weights``: one read, one write of each copy), the bits of
:func:`jax_ep.quantize_weights` in each layout (``quantize.quantize_weights_pair``);
the fp8 dw kernel's operands cast per column per 128 regrouped rows and
transposed in one pass (``jax_ep_quantize_columns``), the bits of
``fp8_columns``' XLA path; activation rows cast per row and 128 columns in one
read (``jax_ep_quantize_rows``), the bits of dispatch's cast and of
:func:`jax_ep.fp8_cast` on the same GPU, and that cast of the SwiGLU of
``[gate | up]`` rows computed as they are read (``jax_ep_quantize_swiglu_rows``).
Need the native extension and a CUDA device; no runtime
(``jax_ep.initialize``)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import abi, extension
from .._ffi import result_type
from ..mesh_axes import to_vma, vma_of
from .config import CAST_IMPLS

TARGET = "jax_ep_quantize_weights"
COLUMNS_TARGET = "jax_ep_quantize_columns"
ROWS_TARGET = "jax_ep_quantize_rows"
SWIGLU_ROWS_TARGET = "jax_ep_quantize_swiglu_rows"
_DTYPES = ("bfloat16", "float32")
_COLUMN_DTYPES = ("float8_e4m3fn", "bfloat16", "float32")


def by_impl(what: str, impl: str, unavailable, native, xla, *operands):
    """``native(*operands)`` or ``xla(*operands)`` as ``impl`` says:
    ``"native"`` (the kernel; the program must be lowered for CUDA; an error
    naming why where ``unavailable()`` says it cannot run), ``"xla"``, or
    ``"auto"`` (the kernel where the program is lowered for CUDA and it can
    run, else XLA). ``what``: the caller, for the errors."""
    if impl not in CAST_IMPLS:
        raise ValueError(f"{what}: impl must be one of {CAST_IMPLS}, got {impl!r}")
    why = None if impl == "xla" else unavailable()
    if impl == "native" and why is not None:
        raise ValueError(f"{what} impl='native': {why}; use impl='auto' or 'xla'")
    if impl == "xla" or why is not None:
        return xla(*operands)
    if impl == "native":
        return native(*operands)
    return jax.lax.platform_dependent(*operands, cuda=native, default=xla)


def scale_mode(scale_format: str = "f32") -> np.int32:
    """The kernels' ``scale_mode`` attribute of a ``scale_format``: UE8M0, or
    f32 scales dividing as XLA:GPU does (so the bits are XLA's on one GPU)."""
    return np.int32(abi.fp8_scale_mode("ue8m0" if scale_format == "ue8m0" else "xla_gpu"))


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
    vma = vma_of(w)
    outs = (result_type((G, K, N), jnp.float8_e4m3fn, vma=vma),
            result_type((G, K // 128, N // 128), jnp.float32, vma=vma),
            result_type((G, N, K), jnp.float8_e4m3fn, vma=vma),
            result_type((G, N // 128, K // 128), jnp.float32, vma=vma))
    # vmap: one call per batch element (a batch of expert stacks is rare)
    q, s, q_t, s_t = jax.ffi.ffi_call(TARGET, outs, vmap_method="sequential")(
        w, scale_mode=scale_mode(scale_format))
    return (q, s), (q_t, s_t)


def columns_unavailable(*rows) -> Optional[str]:
    """Why the column kernel cannot cast these ``[M, C]`` operands (None: it
    can, wherever the program is lowered for CUDA)."""
    if extension.load() is None:
        return f"the native extension is not loaded: {extension.error()}"
    for r in rows:
        if jnp.dtype(r.dtype).name not in _COLUMN_DTYPES:
            return f"the kernel reads {'/'.join(_COLUMN_DTYPES)} rows, got {r.dtype}"
        if r.ndim != 2 or r.shape[0] == 0 or r.shape[1] % 128:
            return f"the kernel casts [M, C] rows, M > 0, C a multiple of 128, got {r.shape}"
    return None


def cast_columns_t(rows, row_scales, blocks, p: int):
    """``(q_t [C, P] e4m3, scales [P/128, C] f32)``: ``rows [M, C]`` (e4m3 with
    ``row_scales [M, C/128]``, dequantized first; or bf16 / f32 with None)
    regrouped into ``P`` rows by ``blocks = (src, count)`` (int32 ``[P/128]``:
    block ``b`` takes ``count[b]`` rows from row ``src[b]`` on, zeros after)
    and cast per column per 128 of them with ``f32`` scales, as
    ``fp8_columns``' XLA path does on the same GPU (shapes checked by the
    caller)."""
    c = rows.shape[1]
    src, count = blocks
    if row_scales is None:
        row_scales = jnp.zeros((0,), jnp.float32)
    ops = (rows, row_scales, src.astype(jnp.int32), count.astype(jnp.int32))
    axes = frozenset().union(*(vma_of(a) for a in ops))
    ops = tuple(to_vma(a, axes) for a in ops)
    outs = (result_type((c, p), jnp.float8_e4m3fn, vma=axes),
            result_type((p // 128, c), jnp.float32, vma=axes))
    return jax.ffi.ffi_call(COLUMNS_TARGET, outs, vmap_method="sequential")(
        *ops, scale_mode=scale_mode())


def rows_unavailable(x, target: str = ROWS_TARGET, width: int = 1) -> Optional[str]:
    """Why the row kernel (``target``: the plain cast, or the SwiGLU cast of
    ``x = [gate | up]``, ``width`` 2) cannot cast ``x`` (None: it can,
    wherever the program is lowered for CUDA)."""
    ext = extension.load()
    if ext is None:
        return f"the native extension is not loaded: {extension.error()}"
    if hasattr(ext, "registrations") and target not in ext.registrations():
        return f"the built extension has no {target} (built before it): rebuild it"
    if jnp.dtype(x.dtype).name not in _DTYPES:
        return f"the kernel reads {'/'.join(_DTYPES)} rows, got {x.dtype}"
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0 or x.shape[1] % (128 * width):
        what = "[M, H] rows" if width == 1 else "[M, 2H] rows ([gate | up])"
        return (f"the kernel casts {what}, M > 0, H a positive multiple of 128, got "
                f"{x.shape}")
    return None


def quantize_rows(x, scale_format: str = "f32", swiglu: bool = False):
    """``(q [M, H] e4m3, scales [M, H/128] f32)`` of ``x [M, H]`` (bf16 / f32)
    by the kernel: :func:`jax_ep.fp8_cast` (``scale_format``), f32 scales
    dividing as XLA:GPU does, so the bits equal XLA's cast on the same GPU
    (shapes checked by the caller). A NaN is the one difference: XLA's block
    maximum keeps it (the block's scale and values NaN), the kernel's skips it
    (the NaN stays in its element), as dispatch's cast does. ``swiglu``: ``x
    [M, 2H] = [gate | up]``, the rows cast are ``silu(gate) * up``
    (``quantize.swiglu_rows``) computed as they are read. No gradient (not
    differentiable)."""
    m, h = x.shape[0], x.shape[1] // (2 if swiglu else 1)
    vma = vma_of(x)
    outs = (result_type((m, h), jnp.float8_e4m3fn, vma=vma),
            result_type((m, h // 128), jnp.float32, vma=vma))
    return jax.ffi.ffi_call(SWIGLU_ROWS_TARGET if swiglu else ROWS_TARGET, outs,
                            vmap_method="sequential")(x, scale_mode=scale_mode(scale_format))
