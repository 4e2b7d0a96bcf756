"""Native low-latency (decode) ops: the send and receive custom calls.

Four FFI targets (cc/low_latency/ffi_handlers.cc over cc/low_latency/kernels.cu):
``jax_ep_ll_dispatch_send`` / ``_recv`` and ``jax_ep_ll_combine_send`` /
``_recv``. A send returns a ``[1]`` uint32 token (no data) that its receive
takes, so XLA orders the two and may schedule independent work between them.
Every call is marked side-effecting: a receive advances this rank's epoch even
when its outputs are unused, so XLA must neither drop nor merge one.

XLA computes the kernels' inputs (jax_ep/low_latency/api.py): ``slot [T, K]``
(each pair's row among its source's rows of that expert), tokens per expert ``[E]`` and the
merged weights, so the kernels never re-derive them and the reference's bits
follow.

Every call takes ``ll_transport`` (``LowLatencyConfig.ll_transport`` as its
``abi.LL_TRANSPORTS`` code): how the kernels reach each rank, P2P stores or
NVSHMEM puts (cc/low_latency/ffi_handlers.cc). The receives also take
``timeout_ns`` (``LowLatencyConfig.tuning.peer_timeout_s``): how long they
wait for a peer's signal (the send kernels never wait).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi, abi, ffi_attrs, runtime
from .config import LowLatencyConfig
from ..fp8 import FP8
from .types import LowLatencyDispatched, LowLatencyHandle, LowLatencyPending

_TOKEN = ((1,), jnp.uint32)


def _num_sms(cfg: LowLatencyConfig) -> np.int32:
    return ffi_attrs.num_sms(cfg)


def _transport(cfg: LowLatencyConfig) -> np.int32:
    return ffi_attrs.transport("jax_ep low-latency mode", "ll_transport", cfg.ll_transport,
                               abi.ll_transport(cfg.ll_transport))


def _timeout_ns(cfg: LowLatencyConfig) -> int:
    """The receives' ``timeout_ns``, kept in the pending op's meta (a plain int)."""
    return int(ffi_attrs.timeout_ns(cfg.tuning.peer_timeout_s))


def dispatch_send(x, idx, slot, per_expert, cfg: LowLatencyConfig, R: int, fp8: bool,
                  scale_format: str, after: tuple = ()) -> LowLatencyPending:
    """``after``: arrays the send takes as operands and never reads (its
    order after the previous receive: :func:`_after_operands`)."""
    if fp8:
        mode = abi.dispatch_mode("cast_bf16" if x.dtype == jnp.bfloat16 else "cast_f32")
    elif x.dtype == jnp.bfloat16:
        mode = abi.dispatch_mode("copy")
    else:
        raise ValueError("jax_ep low_latency_dispatch (native): f32 rows are sent only as fp8 "
                         "(fp8=True) or after a cast to bf16; the region holds bf16-wide rows")
    transport = _transport(cfg)
    token, = _ffi.call("jax_ep_ll_dispatch_send", [_TOKEN], x, idx, slot, per_expert, *after,
                       ep_axis=cfg.axis_name, has_side_effect=True, mode=np.int32(mode),
                       fp8_scale_mode=ffi_attrs.fp8_scale_mode(cfg, scale_format), ll_transport=transport,
                       num_sms=_num_sms(cfg))
    L, Tm, H, K = cfg.num_experts // R, cfg.max_tokens_per_rank, x.shape[1], idx.shape[1]
    dtype = FP8 if fp8 else x.dtype
    meta = ("dispatch", L, R, Tm, H, K, jnp.dtype(dtype).name, bool(fp8), cfg.axis_name,
            int(_num_sms(cfg)), int(transport), _timeout_ns(cfg))
    return LowLatencyPending(token=token, arrays=(slot,), result=None, meta=meta)


def dispatch_recv(p: LowLatencyPending) -> LowLatencyDispatched:
    _, L, R, Tm, H, K, dtype, fp8, axis, num_sms, transport, timeout_ns = p.meta
    S = H // 128 if fp8 else 0
    results = [((L, R * Tm, H), jnp.dtype(dtype)), ((L, R * Tm, S), jnp.float32),
               ((L, R * Tm), jnp.int32), ((L, R), jnp.int32), ((L,), jnp.int32)]
    x, scales, info, src_count, count = _ffi.call(
        "jax_ep_ll_dispatch_recv", results, p.token, ep_axis=axis, has_side_effect=True,
        topk=np.int32(K), ll_transport=np.int32(transport), num_sms=np.int32(num_sms),
        timeout_ns=np.int64(timeout_ns))
    slot, = p.arrays
    handle = LowLatencyHandle(slot=slot, info=info, src_count=src_count, num_ranks=R,
                              max_tokens=Tm)
    return LowLatencyDispatched(x=x, x_scales=scales if fp8 else None, count=count,
                                src_count=src_count, handle=handle)


def combine_send(y, w, handle: LowLatencyHandle, cfg: LowLatencyConfig, R: int,
                 after: tuple = ()) -> LowLatencyPending:
    if y.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise TypeError(f"jax_ep low_latency_combine (native): y must be bf16, f16 or f32, got "
                        f"{y.dtype}")
    K = handle.slot.shape[1]
    transport = _transport(cfg)
    token, = _ffi.call("jax_ep_ll_combine_send", [_TOKEN], y, handle.info, handle.src_count,
                       *after, ep_axis=cfg.axis_name, has_side_effect=True, topk=np.int32(K),
                       ll_transport=transport, num_sms=_num_sms(cfg))
    T, H = handle.slot.shape[0], y.shape[2]
    meta = ("combine", T, H, jnp.dtype(y.dtype).name, cfg.num_experts, cfg.axis_name,
            int(_num_sms(cfg)), int(transport), _timeout_ns(cfg))
    return LowLatencyPending(token=token, arrays=(handle.slot, w), result=None, meta=meta)


def combine_recv(p: LowLatencyPending) -> jax.Array:
    _, T, H, dtype, E, axis, num_sms, transport, timeout_ns = p.meta
    slot, w = p.arrays
    out, = _ffi.call("jax_ep_ll_combine_recv", [((T, H), jnp.dtype(dtype))], p.token, slot, w,
                     ep_axis=axis, has_side_effect=True, num_experts=np.int32(E),
                     ll_transport=np.int32(transport), num_sms=np.int32(num_sms),
                     timeout_ns=np.int64(timeout_ns))
    return out


def _after_operands(after) -> tuple:
    """``after``'s leaves as extra operands of a native send: a buffer read
    XLA must honour even where a command buffer orders its graph by buffer
    uses alone, which drops an optimization barrier's edge (a send before
    the previous receive of its op raises kErrLlOrder)."""
    return tuple(jax.lax.stop_gradient(a) for a in jax.tree_util.tree_leaves(after))


class NativeBackend:
    """A :class:`jax_ep.backend.LowLatencyBackend` through the ``jax_ep_ll_*`` kernels."""

    name = "native"

    def unavailable(self, cfg: LowLatencyConfig):
        """None when the live runtime has a low-latency region laid out for this
        config's (E, Tmax, K, H) (``initialize(low_latency=)``), else the error
        a native call raises."""
        if not runtime.is_initialized():
            return runtime.not_initialized_error()
        live = runtime.region("low_latency")
        if not live.nbytes:
            return ValueError("jax_ep low-latency mode, backend='native': the runtime has no "
                              "low-latency region; call jax_ep.initialize(low_latency=config) "
                              "with the decode config")
        want = cfg.shape
        if tuple(live.attach_arg) != want:   # the handlers check too; this says it at trace time
            return ValueError(
                f"jax_ep low-latency mode (native): the low-latency region was laid out for "
                f"(E, Tmax, K, H) = {tuple(live.attach_arg)} (jax_ep.initialize(low_latency=...)); "
                f"this config has {want}")
        return None

    def dispatch_send(self, x, idx, slot, per_expert, cfg: LowLatencyConfig, R: int, fp8: bool,
                      scale_format: str, after=None) -> LowLatencyPending:
        return dispatch_send(x, idx, slot, per_expert, cfg, R, fp8, scale_format,
                             after=_after_operands(after))

    def dispatch_recv(self, pending: LowLatencyPending) -> LowLatencyDispatched:
        return dispatch_recv(pending)

    def combine_send(self, y, idx, w, handle: LowLatencyHandle, cfg: LowLatencyConfig, R: int,
                     after=None) -> LowLatencyPending:
        if handle.info is None:
            raise ValueError("low_latency_combine (native): the handle has no info words "
                             "(it comes from a reference low_latency_dispatch); dispatch and "
                             "combine must use one backend")
        return combine_send(y, w, handle, cfg, R, after=_after_operands(after))

    def combine_recv(self, pending: LowLatencyPending) -> jax.Array:
        return combine_recv(pending)


BACKEND = NativeBackend()
