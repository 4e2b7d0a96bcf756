"""Intranode native backend: the dispatch / combine CUDA kernels as per-rank ops.

Implements :class:`jax_ep.backend.RowBackend`. Routing metadata (``route``) is
the shared ``jax_ep.routing`` over a small XLA all_to_all of ``[R, T, K]``
int32; the rows themselves move through ``jax_ep_dispatch`` /
``jax_ep_combine`` (cc/intranode/ffi_dispatch.cc, cc/intranode/ffi_combine.cc): P2P stores over
NVLink into the peers' NVSHMEM staging rings (bounded: credits, cc/low_latency/region_layout.h),
one copy per (token, rank), on XLA's stream. Results are bit-identical to the
reference backend (dispatch) and equal to it op for op in f32 (combine). The
backward of expert_major combine (``combine_backward``, ``jax_ep_combine_bwd``)
is the dispatch kernel with ``dy = w * g`` and ``dw = <g, y>`` formed on the
expert side: dy bit-identical, dw equal up to f32 reduction order. Rows past
the last expert group are left unspecified unless ``EpConfig.zero_tail``
(padding inside groups is always 0).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import jax.numpy as jnp
import numpy as np

from .. import _ffi, extension, ffi_attrs, routing, runtime
from ..config import EpConfig
from ..types import Handle
from . import layout as _layout


def _check_staging(op: str, R: int, T: int, row_bytes: int, s_row_bytes: int, cfg: EpConfig,
                   sms) -> None:
    """Trace time: the op's staging rings fit the live runtime's symmetric
    buffer (the FFI handlers' own check, cc/intranode/launch_config.h
    ``plan_launch``). Skipped when the runtime is not up (the call then fails
    with the not-initialised message)."""
    info = runtime.info() if runtime.is_initialized() else None
    if not info:
        return
    msg = extension.load().staging_error(op == "combine", int(R), int(T), int(sms),
                                         int(info["num_sms"]), int(ffi_attrs.chunk(cfg, op)),
                                         int(row_bytes), int(s_row_bytes),
                                         int(info["sym_bytes"]))
    if msg:
        raise ValueError(f"jax_ep native {op}: {msg}")


def dispatch_raw(x, x_scales, handle: Handle, cfg: EpConfig, *, cast_fp8: bool = False,
                 num_sms: Optional[int] = None):
    """The ``jax_ep_dispatch`` call: ``x [T, W]`` (+ ``x_scales``) -> (``[C, W]``,
    scales ``[C, S]`` or None). ``cast_fp8``: x bf16/f32 is cast to fp8 (+ scales)
    in the kernel."""
    T, W = x.shape
    C = handle.capacity
    mode, out_dtype, scales, S = ffi_attrs.dispatch_rows_in(x, x_scales, cast_fp8)
    sms = ffi_attrs.num_sms(cfg, num_sms)
    _check_staging("dispatch", handle.num_ranks, T, W * jnp.dtype(out_dtype).itemsize, 4 * S,
                   cfg, sms)
    out, out_scales = _ffi.call(
        "jax_ep_dispatch",
        [((C, W), out_dtype), ((C, S), jnp.float32)],
        x, scales, handle.row_src, handle.slot_row, handle.send_mask,
        ep_axis=cfg.axis_name, has_side_effect=True,
        mode=mode, rank_major=np.int32(handle.layout == "rank_major"), num_sms=sms,
        fp8_scale_mode=ffi_attrs.fp8_scale_mode(cfg), **ffi_attrs.row_attrs(handle, cfg),
        chunk=ffi_attrs.chunk(cfg, "dispatch"),
        timeout_ns=ffi_attrs.timeout_ns(cfg.tuning.peer_timeout_s))
    return out, (out_scales if (cast_fp8 or x_scales is not None) else None)


def combine_bwd_raw(g, y, w, handle: Handle, cfg: EpConfig, *, num_sms: Optional[int] = None):
    """Backward of expert_major ``combine_rows(y, w)`` for ``g = d_out [T, W]``
    (y's dtype), one kernel: ``g``'s rows are dispatched and, on the expert side,
    ``dy[c] = cast(w[c] * f32(g_t))`` (the reference's bits) and ``dw[c] =
    sum_h f32(g_t[h]) * f32(y[c, h])`` (f32; per lane in ascending vector order,
    then a 32-lane butterfly) are formed from them, with no ``[C, W]`` f32
    temporaries. -> (dy ``[C, W]``, dw ``[C]`` f32); padding rows 0, tail rows of
    dy as in dispatch (``cfg.zero_tail``), dw 0 on every row without a source."""
    C, W = y.shape
    sms = ffi_attrs.num_sms(cfg, num_sms)
    _check_staging("dispatch", handle.num_ranks, g.shape[0], W * y.dtype.itemsize, 0, cfg, sms)
    dy, dw = _ffi.call(
        "jax_ep_combine_bwd",
        [((C, W), y.dtype), ((C,), jnp.float32)],
        g, y, w.astype(jnp.float32), handle.row_src, handle.slot_row, handle.send_mask,
        ep_axis=cfg.axis_name, has_side_effect=True, num_sms=sms,
        **ffi_attrs.row_attrs(handle, cfg), chunk=ffi_attrs.chunk(cfg, "dispatch"),
        timeout_ns=ffi_attrs.timeout_ns(cfg.tuning.peer_timeout_s))
    return dy, dw


def combine_raw(y, row_weights, handle: Handle, cfg: EpConfig, *, num_sms: Optional[int] = None):
    """The ``jax_ep_combine`` call: ``y [C, W]`` -> ``[T, W]`` (``Backend.combine_rows``)."""
    T = handle.num_tokens
    rank_major = handle.layout == "rank_major"
    weighted = row_weights is not None and not rank_major
    w = row_weights.astype(jnp.float32) if weighted else jnp.zeros((0,), jnp.float32)
    sms = ffi_attrs.num_sms(cfg, num_sms)
    _check_staging("combine", handle.num_ranks, T, y.shape[1] * y.dtype.itemsize, 0, cfg, sms)
    (out,) = _ffi.call(
        "jax_ep_combine",
        [((T, y.shape[1]), y.dtype)],
        y, w, handle.slot_row, handle.recv_local_idx, handle.send_mask,
        ep_axis=cfg.axis_name, has_side_effect=True,
        rank_major=np.int32(rank_major), weighted=np.int32(weighted), num_sms=sms,
        chunk=ffi_attrs.chunk(cfg, "combine"),
        timeout_ns=ffi_attrs.timeout_ns(cfg.tuning.peer_timeout_s))
    return out


_NOT_TESTING = ("jax_ep was built without its test/bench helpers (cc/testing): rebuild with "
                "JAX_EP_TESTING=1 python3 -m pip install .")


def _testing_ext():
    """The extension, when it is the test build (CMake option JAX_EP_TESTING);
    raises otherwise."""
    C = extension.load()
    if not getattr(C, "TESTING", False):
        raise RuntimeError(_NOT_TESTING)
    return C


def bench_transfer(src_u8, token, cfg: EpConfig, mode: int, num_sms: int = 0):
    """Ceiling measurement (bench only): move ``src_u8`` to the peer.

    mode 0: SM writes both ways, 1: copy engine both ways, 2: copy engine rank
    0 -> 1 only, 3: SM writes rank 0 -> 1 only. Returns a copy of ``token``
    (chain it to make calls data-dependent). Needs the test build."""
    _testing_ext()
    (out,) = _ffi.call(
        "jax_ep_bench_transfer", [(token.shape, jnp.int32)], src_u8, token,
        ep_axis=cfg.axis_name, has_side_effect=True, mode=np.int32(mode),
        num_sms=np.int32(num_sms))
    return out


@contextlib.contextmanager
def debug_skip(skip: int):
    """Bench breakdown of the intranode dispatch / combine (test build only):
    while the block runs (calls executed, not traced), bit 0 sends no data and
    bit 1 skips the receive-side gather / reduce, in every such call of this
    process. ``skip=0`` (the full op) needs no test build."""
    skip = int(skip)
    if not 0 <= skip <= 3:
        raise ValueError(f"jax_ep native: debug_skip must be in [0, 3], got {skip!r}")
    if skip == 0:
        yield
        return
    C = _testing_ext()
    C.set_debug_skip(skip)
    try:
        yield
    finally:
        C.set_debug_skip(0)


class NativeBackend:
    """Rows through the intranode kernels; the routing metadata and weights (a few
    bytes per token) through the shared routing (``jax_ep.routing``) over XLA's
    all_to_all, which is faster for them than a kernel launch with its flag
    round (a native all-gather variant measured slower for ``route`` at
    V3-train and was deleted: bench/results/README.md, "Deleted variants").
    The internode backend is this one with its own row calls."""

    name = "native"
    router = routing.XlaRouter()
    # the family's row calls (dispatch_raw / combine_raw signatures)
    _dispatch = staticmethod(dispatch_raw)
    _combine = staticmethod(combine_raw)

    def unavailable(self, cfg: EpConfig):
        """None when the runtime is up, else the error a native call raises."""
        return None if runtime.is_initialized() else runtime.not_initialized_error()

    def layout(self, topk_idx, cfg: EpConfig, R: int):
        return _layout.layout(topk_idx, cfg, R)

    def dispatch_rows(self, x, x_scales, handle: Handle, cfg: EpConfig):
        # Pure data movement (also the backward of combine): never casts.
        return self._dispatch(x, x_scales, handle, cfg)

    def dispatch_rows_fp8(self, x, handle: Handle, cfg: EpConfig):
        """bf16/f32 ``x [T, H]`` -> (fp8 ``[C, H]``, scales ``[C, H/128]``), cast in
        the send kernel with ``jax_ep.fp8_cast``'s arithmetic (bit-identical to
        ``dispatch_rows(*fp8_cast(x))``, one pass over x)."""
        return self._dispatch(x, None, handle, cfg, cast_fp8=True)

    def combine_rows(self, y, row_weights, handle: Handle, cfg: EpConfig):
        return self._combine(y, row_weights, handle, cfg)

    def combine_backward(self, g, y, w, handle: Handle, cfg: EpConfig):
        if w is None or handle.layout != "expert_major":  # rank_major: a dispatch of g
            return self._dispatch(g, None, handle, cfg)[0].astype(y.dtype), None
        return self._weighted_combine_backward(g, y, w, handle, cfg)

    def _weighted_combine_backward(self, g, y, w, handle: Handle, cfg: EpConfig):
        # combine's output is in y's dtype, so its cotangent is too
        return combine_bwd_raw(g.astype(y.dtype), y, w, handle, cfg)


BACKEND = NativeBackend()
