"""FFI attributes several kernel families share, from an :class:`EpConfig`.

The codes are ``jax_ep/abi.py``'s (compiled into the kernels); the attribute
names are those the handlers bind (cc/ffi_targets.h).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from . import abi, runtime
from .config import EpConfig
from .fp8 import FP8
from .types import Handle


def dispatch_mode(name: str) -> np.int32:
    return np.int32(abi.dispatch_mode(name))


def cast_mode(dtype) -> np.int32:
    """The DispatchMode of an fp8 cast in the send kernel, from x's dtype."""
    if dtype == jnp.bfloat16:
        return dispatch_mode("cast_bf16")
    if dtype == jnp.float32:
        return dispatch_mode("cast_f32")
    raise TypeError(f"jax_ep native dispatch: fp8 cast needs bf16/f32 x, got {dtype}")


def dispatch_rows_in(x, x_scales, cast_fp8: bool):
    """A dispatch's row operands and mode, for every family that sends rows of
    ``x [T, W]``: -> (mode, output dtype, scales operand ``[T, S]`` f32, S).
    ``cast_fp8``: the kernel casts bf16/f32 x to fp8 (S = W / 128 scales made
    there, the operand a placeholder); else x is copied, with its scales if any."""
    T, W = x.shape
    if cast_fp8:
        mode = cast_mode(x.dtype)
        if W % 128:
            raise ValueError(f"jax_ep native dispatch: fp8 cast needs H % 128 == 0, got {W}")
        return mode, FP8, empty_f32(T), W // 128
    if x_scales is not None:
        scales = x_scales.astype(jnp.float32)
        return dispatch_mode("copy"), x.dtype, scales, scales.shape[1]
    return dispatch_mode("copy"), x.dtype, empty_f32(T), 0


def num_sms(cfg: EpConfig, override=None) -> np.int32:
    """SMs the kernels may occupy: ``override``, else ``cfg.num_sms`` (0: every SM)."""
    return np.int32(override if override is not None else (cfg.num_sms or 0))


def chunk(cfg: EpConfig, op: str) -> np.int32:
    """Tokens per flag (``cfg.tuning``; 0: the kernel default) of ``op``
    (``"dispatch"``: dispatch, fp8 dispatch and the combine backward; ``"combine"``)."""
    t = cfg.tuning
    return np.int32(t.combine_chunk if op == "combine" else t.dispatch_chunk)


def fp8_scale_mode(cfg: EpConfig, scale_format: str = None) -> np.int32:
    """The kernel's Fp8ScaleMode for ``scale_format`` (None: ``cfg.fp8_scale_format``):
    UE8M0, or f32 scales with the reference's division as XLA:GPU computes
    it (or IEEE, ``cfg.tuning.fp8_ieee_division``)."""
    fmt = cfg.fp8_scale_format if scale_format is None else scale_format
    if fmt == "ue8m0":
        return np.int32(abi.fp8_scale_mode("ue8m0"))
    return np.int32(abi.fp8_scale_mode("ieee" if cfg.tuning.fp8_ieee_division else "xla_gpu"))


def timeout_ns(peer_timeout_s: float) -> np.int64:
    """The ``timeout_ns`` attribute of every target whose kernel waits for
    peers: ``peer_timeout_s`` (``KernelTuning`` / ``RaggedConfig``, checked
    there: finite, > 0) in int64 nanoseconds, rounded up (never 0)."""
    return np.int64(math.ceil(float(peer_timeout_s) * 1e9))


def row_attrs(handle: Handle, cfg: EpConfig) -> dict:
    """Which rows with no source the kernel zeroes: padding inside expert
    groups always (it finds them from the alignment), the tail past the last
    group only with ``cfg.zero_tail`` (unspecified otherwise: at EP 2 / V3-train
    that tail is half of the dropless capacity)."""
    align = cfg.expert_alignment if handle.layout == "expert_major" else 1
    return dict(align=np.int32(align), zero_tail=np.int32(cfg.zero_tail))


def empty_f32(n_rows: int):
    """A ``[n_rows, 0]`` f32 operand: no scales."""
    return jnp.zeros((n_rows, 0), jnp.float32)


def transport(where: str, field: str, name: str, code: int) -> np.int32:
    """A transport attribute (``code``, of option ``field`` = ``name``);
    "put" needs NVSHMEM PEs, said here at trace time rather than by the
    handler at run time (``where``: the error's prefix)."""
    if name == "put" and runtime.symmetric_memory() == "peer_memory":
        raise ValueError(f"{where}: {field}='put' needs the NVSHMEM transport; the runtime uses "
                         "peer memory (one process, several GPUs: no PEs to put to). Use 'auto' "
                         "or 'p2p'")
    return np.int32(code)
