"""Native backend: the intranode dispatch / combine CUDA kernels as per-rank ops.

Implements :class:`jax_ep.backend.Backend`. Routing metadata (``route``) is
the shared ``jax_ep.routing`` over a small XLA all_to_all of ``[R, T, K]``
int32; the rows themselves move through ``jax_ep_dispatch`` /
``jax_ep_combine`` (cc/ffi_dispatch.cc, cc/ffi_combine.cc): P2P stores over
NVLink into the peers' NVSHMEM staging rings (bounded: credits, cc/buffer_layout.h),
one copy per (token, rank), on XLA's stream. Results are bit-identical to the reference backend (dispatch) and
equal to it op for op in f32 (combine). The backward of expert_major combine
(``combine_backward``, ``jax_ep_combine_bwd``) is the dispatch kernel with
``dy = w * g`` and ``dw = <g, y>`` formed on the expert side: dy bit-identical,
dw equal up to f32 reduction order. Rows past the last expert group are left
unspecified unless ``EpConfig.zero_tail`` (padding inside groups is always 0).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, abi, routing
from .config import EpConfig
from .types import Handle

FP8 = jnp.float8_e4m3fn

# DispatchMode codes (one source: jax_ep/abi.py, compiled into the kernels)
_COPY, _CAST_BF16, _CAST_F32 = (abi.dispatch_mode(m) for m in ("copy", "cast_bf16", "cast_f32"))


def _num_sms(cfg: EpConfig) -> np.int32:
    return np.int32(cfg.num_sms or 0)  # 0: every SM of the device


def _tuning_attrs(cfg: EpConfig, op: str, debug_skip: int) -> dict:
    """The kernels' tuning knobs (``cfg.tuning``) as FFI attributes: ``chunk``
    (tokens per flag, 0: the kernel default), and ``debug_skip`` (bench
    breakdown only: bit 0 sends no data, bit 1 skips the local gather; never
    set from a config, only by bench code through ``*_raw(debug_skip=)``)."""
    t = cfg.tuning
    chunk = t.combine_chunk if op == "combine" else t.dispatch_chunk
    skip = int(debug_skip)
    if not 0 <= skip <= 3:
        raise ValueError(f"jax_ep native: debug_skip must be in [0, 3], got {debug_skip!r}")
    return dict(chunk=np.int32(chunk), debug_skip=np.int32(skip))


def _check_staging(op: str, R: int, T: int, row_bytes: int, s_row_bytes: int, cfg: EpConfig,
                   sms) -> None:
    """Trace time: the op's staging rings fit the live runtime's symmetric
    buffer (the FFI handlers' own check, cc/kernels/launch_config.h
    ``plan_launch``). Skipped when the runtime is not up (the call then fails
    with the not-initialised message)."""
    from . import runtime

    info = runtime.info() if runtime.is_initialized() else None
    if not info:
        return
    chunk = int(_tuning_attrs(cfg, op, 0)["chunk"])
    msg = runtime._extension().staging_error(op == "combine", int(R), int(T), int(sms),
                                             int(info["num_sms"]), chunk, int(row_bytes),
                                             int(s_row_bytes), int(info["sym_bytes"]))
    if msg:
        raise ValueError(f"jax_ep native {op}: {msg}")


def nodes_of(cfg: EpConfig, R: int) -> int:
    """The node count the native kernels run an EP group of R ranks with:
    ``cfg.num_nodes`` when > 1 (explicit, or emulated nodes on one host), else
    one node per host when the group cannot fit on one host of the live
    runtime's job (:func:`jax_ep.hosts.auto_nodes`), else 1 (the intranode
    kernels). Decided at trace time, the same on every rank."""
    if cfg.num_nodes > 1:
        return cfg.num_nodes
    from . import hosts, runtime

    return hosts.auto_nodes(runtime.pe_hosts(), R)


def _check_internode(op: str, R: int, cfg: EpConfig, nodes: int) -> None:
    """Trace time, ``nodes`` > 1 (:func:`nodes_of`): the live runtime has an internode region
    (any T runs on it, as windows of its T; the handlers check the bytes too,
    naming them)."""
    from . import runtime

    cfg.ranks_per_node(R)
    info = runtime.info() if runtime.is_initialized() else None
    if not info:
        return
    if not info.get("inter_bytes"):
        why = (f"EpConfig.num_nodes={cfg.num_nodes}" if cfg.num_nodes > 1 else
               f"the EP group of {R} ranks spans hosts ({nodes} nodes, chosen "
               "automatically)")
        raise ValueError(f"jax_ep native {op}: {why} needs the internode region, which the "
                         "live runtime does not have: pass this config to the first "
                         "jax_ep.initialize(config=...) (or jax_ep.finalize() and initialize "
                         "again)")


def _net_transport(cfg: EpConfig) -> np.int32:
    """The internode net_transport attribute; "put" needs NVSHMEM PEs (said
    here, at trace time, rather than by the handler at run time)."""
    from . import runtime

    if cfg.net_transport == "put" and runtime.symmetric_memory() == "peer_memory":
        raise ValueError("jax_ep native internode: EpConfig.net_transport='put' needs the NVSHMEM "
                         "transport; the runtime uses peer memory (one process, several GPUs: "
                         "no PEs to put to). Use 'auto' or 'p2p'")
    return np.int32(abi.net_transport(cfg.net_transport))


def _fp8_scale_mode(cfg: EpConfig) -> int:
    """The kernel's Fp8ScaleMode (jax_ep/abi.py) for this config."""
    if cfg.fp8_scale_format == "ue8m0":
        return abi.fp8_scale_mode("ue8m0")
    return abi.fp8_scale_mode("ieee" if cfg.tuning.fp8_ieee_division else "xla_gpu")


def _empty_f32(n_rows: int):
    return jnp.zeros((n_rows, 0), jnp.float32)


def _row_attrs(handle: Handle, cfg: EpConfig) -> dict:
    """Which rows with no source the kernel zeroes: padding inside expert
    groups always (it finds them from the alignment), the tail past the last
    group only with ``cfg.zero_tail`` (unspecified otherwise: at EP 2 / V3-train
    that tail is half of the dropless capacity)."""
    align = cfg.expert_alignment if handle.layout == "expert_major" else 1
    return dict(align=np.int32(align), zero_tail=np.int32(cfg.zero_tail))


def dispatch_raw(x, x_scales, handle: Handle, cfg: EpConfig, *, cast_fp8: bool = False,
                 num_sms: Optional[int] = None, debug_skip: int = 0):
    """The FFI call. ``cast_fp8``: x bf16/f32 is cast to fp8 (+ scales) in the kernel.
    ``debug_skip``: bench breakdown only (see :func:`_tuning_attrs`)."""
    T = x.shape[0]
    C = handle.capacity
    W = x.shape[1]
    if cast_fp8:
        if x.dtype == jnp.bfloat16:
            mode = _CAST_BF16
        elif x.dtype == jnp.float32:
            mode = _CAST_F32
        else:
            raise TypeError(f"jax_ep native dispatch: fp8 cast needs bf16/f32 x, got {x.dtype}")
        if W % 128:
            raise ValueError(f"jax_ep native dispatch: fp8 cast needs H % 128 == 0, got {W}")
        out_dtype, S = FP8, W // 128
        scales = _empty_f32(T)
    else:
        mode, out_dtype = _COPY, x.dtype
        if x_scales is not None:
            scales = x_scales.astype(jnp.float32)
            S = scales.shape[1]
        else:
            scales, S = _empty_f32(T), 0
    sms = np.int32(num_sms) if num_sms is not None else _num_sms(cfg)
    nodes = nodes_of(cfg, handle.num_ranks)
    if nodes > 1:  # hierarchical kernels (cc/ffi_internode.cc); no debug_skip there
        _check_internode("dispatch", handle.num_ranks, cfg, nodes)
        out, out_scales = _ffi.call(
            "jax_ep_internode_dispatch",
            [((C, W), out_dtype), ((C, S), jnp.float32)],
            x, scales, handle.row_src, handle.slot_row, handle.send_mask,
            ep_axis=cfg.axis_name, has_side_effect=True, nodes=np.int32(nodes),
            net_transport=_net_transport(cfg), mode=np.int32(mode), rank_major=np.int32(handle.layout == "rank_major"), num_sms=sms,
            fp8_scale_mode=np.int32(_fp8_scale_mode(cfg)), **_row_attrs(handle, cfg),
            chunk=_tuning_attrs(cfg, "dispatch", 0)["chunk"])
        return out, (out_scales if (cast_fp8 or x_scales is not None) else None)
    _check_staging("dispatch", handle.num_ranks, T, W * jnp.dtype(out_dtype).itemsize, 4 * S,
                   cfg, sms)
    out, out_scales = _ffi.call(
        "jax_ep_dispatch",
        [((C, W), out_dtype), ((C, S), jnp.float32)],
        x, scales, handle.row_src, handle.slot_row, handle.send_mask,
        ep_axis=cfg.axis_name, has_side_effect=True,
        mode=np.int32(mode), rank_major=np.int32(handle.layout == "rank_major"), num_sms=sms,
        fp8_scale_mode=np.int32(_fp8_scale_mode(cfg)),
        **_row_attrs(handle, cfg), **_tuning_attrs(cfg, "dispatch", debug_skip))
    return out, (out_scales if (cast_fp8 or x_scales is not None) else None)


def combine_bwd_raw(g, y, w, handle: Handle, cfg: EpConfig, *, num_sms: Optional[int] = None,
                    debug_skip: int = 0):
    """Backward of expert_major ``combine_rows(y, w)`` for ``g = d_out [T, W]``
    (y's dtype), one kernel: ``g``'s rows are dispatched and, on the expert side,
    ``dy[c] = cast(w[c] * f32(g_t))`` (the reference's bits) and ``dw[c] =
    sum_h f32(g_t[h]) * f32(y[c, h])`` (f32; per lane in ascending vector order,
    then a 32-lane butterfly) are formed from them, with no ``[C, W]`` f32
    temporaries. -> (dy ``[C, W]``, dw ``[C]`` f32); padding rows 0, tail rows of
    dy as in dispatch (``cfg.zero_tail``), dw 0 on every row without a source."""
    C, W = y.shape
    sms = np.int32(num_sms) if num_sms is not None else _num_sms(cfg)
    _check_staging("dispatch", handle.num_ranks, g.shape[0], W * y.dtype.itemsize, 0, cfg, sms)
    dy, dw = _ffi.call(
        "jax_ep_combine_bwd",
        [((C, W), y.dtype), ((C,), jnp.float32)],
        g, y, w.astype(jnp.float32), handle.row_src, handle.slot_row, handle.send_mask,
        ep_axis=cfg.axis_name, has_side_effect=True, num_sms=sms, **_row_attrs(handle, cfg),
        **_tuning_attrs(cfg, "dispatch", debug_skip))
    return dy, dw


def combine_raw(y, row_weights, handle: Handle, cfg: EpConfig, *, num_sms: Optional[int] = None,
                debug_skip: int = 0):
    T = handle.num_tokens
    rank_major = handle.layout == "rank_major"
    weighted = row_weights is not None and not rank_major
    w = row_weights.astype(jnp.float32) if weighted else jnp.zeros((0,), jnp.float32)
    sms = np.int32(num_sms) if num_sms is not None else _num_sms(cfg)
    nodes = nodes_of(cfg, handle.num_ranks)
    if nodes > 1:  # hierarchical kernels (cc/ffi_internode.cc)
        _check_internode("combine", handle.num_ranks, cfg, nodes)
        (out,) = _ffi.call(
            "jax_ep_internode_combine",
            [((T, y.shape[1]), y.dtype)],
            y, w, handle.slot_row, handle.recv_local_idx, handle.send_mask,
            ep_axis=cfg.axis_name, has_side_effect=True, nodes=np.int32(nodes),
            net_transport=_net_transport(cfg), rank_major=np.int32(rank_major), weighted=np.int32(weighted), num_sms=sms,
            chunk=_tuning_attrs(cfg, "combine", 0)["chunk"])
        return out
    _check_staging("combine", handle.num_ranks, T, y.shape[1] * y.dtype.itemsize, 0, cfg, sms)
    (out,) = _ffi.call(
        "jax_ep_combine",
        [((T, y.shape[1]), y.dtype)],
        y, w, handle.slot_row, handle.recv_local_idx, handle.send_mask,
        ep_axis=cfg.axis_name, has_side_effect=True,
        rank_major=np.int32(rank_major), weighted=np.int32(weighted), num_sms=sms,
        **_tuning_attrs(cfg, "combine", debug_skip))
    return out


def bench_transfer(src_u8, token, cfg: EpConfig, mode: int, num_sms: int = 0):
    """Ceiling measurement (bench only): move ``src_u8`` to the peer.

    mode 0: SM writes both ways, 1: copy engine both ways, 2: copy engine rank
    0 -> 1 only, 3: SM writes rank 0 -> 1 only. Returns a copy of ``token``
    (chain it to make calls data-dependent). Needs an extension built with
    the test/bench helpers (CMake option JAX_EP_TESTING, on by default)."""
    from .runtime import _extension

    C = _extension()
    if C is not None and not getattr(C, "TESTING", True):
        raise RuntimeError("jax_ep was built without JAX_EP_TESTING: no link-ceiling target "
                           "(rebuild with -C cmake.define.JAX_EP_TESTING=ON)")
    (out,) = _ffi.call(
        "jax_ep_bench_transfer", [(token.shape, jnp.int32)], src_u8, token,
        ep_axis=cfg.axis_name, has_side_effect=True, mode=np.int32(mode),
        num_sms=np.int32(num_sms))
    return out


class NativeBackend:
    """Rows through the native kernels; the routing metadata and weights (a few
    bytes per token) through the shared routing (``jax_ep.routing``) over XLA's
    all_to_all, which is faster for them than a kernel launch with its flag
    round (a native all-gather variant measured slower for ``route`` at
    V3-train and was deleted: bench/results/README.md, "Deleted variants")."""

    name = "native"
    router = routing.XlaRouter()

    def layout(self, topk_idx, cfg: EpConfig, R: int):
        from . import native_layout
        return native_layout.layout(topk_idx, cfg, R)

    def dispatch_rows(self, x, x_scales, handle: Handle, cfg: EpConfig):
        # Pure data movement (also the backward of combine): never casts.
        return dispatch_raw(x, x_scales, handle, cfg)

    def dispatch_rows_fp8(self, x, handle: Handle, cfg: EpConfig):
        """bf16/f32 ``x [T, H]`` -> (fp8 ``[C, H]``, scales ``[C, H/128]``), cast in
        the send kernel with ``reference.fp8_cast``'s arithmetic (bit-identical to
        ``dispatch_rows(*reference.fp8_cast(x))``, one pass over x)."""
        return dispatch_raw(x, None, handle, cfg, cast_fp8=True)

    def combine_rows(self, y, row_weights, handle: Handle, cfg: EpConfig):
        return combine_raw(y, row_weights, handle, cfg)

    def combine_backward(self, g, y, w, handle: Handle, cfg: EpConfig):
        if w is None or handle.layout != "expert_major":  # rank_major: a dispatch of g
            return dispatch_raw(g, None, handle, cfg)[0].astype(y.dtype), None
        if nodes_of(cfg, handle.num_ranks) > 1:
            # No fused internode kernel: the internode dispatch of g (bit-identical
            # to the flat one), then the reference's dy / dw in XLA ([C, W] f32
            # temporaries, as the reference backend).
            g_rows = dispatch_raw(g.astype(y.dtype), None, handle, cfg)[0].astype(jnp.float32)
            dy = (w[:, None] * g_rows).astype(y.dtype)
            dw = jnp.sum(g_rows * y.astype(jnp.float32), axis=1)
            return dy, dw
        # combine's output is in y's dtype, so its cotangent is too
        return combine_bwd_raw(g.astype(y.dtype), y, w, handle, cfg)


BACKEND = NativeBackend()
