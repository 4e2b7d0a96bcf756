"""Internode native backend: the hierarchical kernels (cc/internode/ffi_handlers.cc) as per-rank ops.

Implements :class:`jax_ep.backend.RowBackend` for an EP group of ``nodes``
blocks of ranks (:func:`nodes_of`, decided at trace time). Routing and
weights are the shared ``jax_ep.routing`` (as intranode); the layout kernel
is intranode's. Rows move through ``jax_ep_internode_dispatch`` /
``jax_ep_internode_combine`` on the internode region, as windows of its W
tokens. There is no fused combine backward: the internode dispatch of the
output cotangent (bit-identical to the flat one), then the reference's
``dy`` / ``dw`` in XLA.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .. import _ffi, abi, ffi_attrs, hosts, runtime
from ..config import EpConfig
from ..intranode import native as intranode_native
from ..types import Handle


def nodes_of(cfg: EpConfig, R: int) -> int:
    """The node count the native kernels run an EP group of R ranks with:
    ``cfg.num_nodes`` when > 1 (explicit, or emulated nodes on one host), else
    one node per host when the group cannot fit on one host of the live
    runtime's job (:func:`jax_ep.hosts.auto_nodes`), else 1 (the intranode
    kernels). Decided at trace time, the same on every rank."""
    if cfg.num_nodes > 1:
        return cfg.num_nodes
    return hosts.auto_nodes(runtime.pe_hosts(), R)


def _check_region(op: str, R: int, cfg: EpConfig, nodes: int) -> None:
    """Trace time: the live runtime has an internode region (any T runs on
    it, as windows of its T; the handlers check the bytes too, naming them)."""
    cfg.ranks_per_node(R)
    live = runtime.region("internode")
    if live is None:
        return
    if not live.nbytes:
        why = (f"EpConfig.num_nodes={cfg.num_nodes}" if cfg.num_nodes > 1 else
               f"the EP group of {R} ranks spans hosts ({nodes} nodes, chosen "
               "automatically)")
        raise ValueError(f"jax_ep native {op}: {why} needs the internode region, which the "
                         "live runtime does not have: pass this config to the first "
                         "jax_ep.initialize(config=...) (or jax_ep.finalize() and initialize "
                         "again)")


def _net_transport(cfg: EpConfig) -> np.int32:
    return ffi_attrs.transport("jax_ep native internode", "EpConfig.net_transport",
                               cfg.net_transport, abi.net_transport(cfg.net_transport))


def dispatch_raw(x, x_scales, handle: Handle, cfg: EpConfig, *, cast_fp8: bool = False,
                 num_sms=None):
    """The ``jax_ep_internode_dispatch`` call, as ``intranode.native.dispatch_raw``."""
    T, W = x.shape
    C = handle.capacity
    mode, out_dtype, scales, S = ffi_attrs.dispatch_rows_in(x, x_scales, cast_fp8)
    nodes = nodes_of(cfg, handle.num_ranks)
    _check_region("dispatch", handle.num_ranks, cfg, nodes)
    out, out_scales = _ffi.call(
        "jax_ep_internode_dispatch",
        [((C, W), out_dtype), ((C, S), jnp.float32)],
        x, scales, handle.row_src, handle.slot_row, handle.send_mask,
        ep_axis=cfg.axis_name, has_side_effect=True, nodes=np.int32(nodes),
        net_transport=_net_transport(cfg), mode=mode,
        rank_major=np.int32(handle.layout == "rank_major"),
        num_sms=ffi_attrs.num_sms(cfg, num_sms), fp8_scale_mode=ffi_attrs.fp8_scale_mode(cfg),
        **ffi_attrs.row_attrs(handle, cfg), chunk=ffi_attrs.chunk(cfg, "dispatch"),
        timeout_ns=ffi_attrs.timeout_ns(cfg.tuning.peer_timeout_s))
    return out, (out_scales if (cast_fp8 or x_scales is not None) else None)


def combine_raw(y, row_weights, handle: Handle, cfg: EpConfig, *, num_sms=None):
    """The ``jax_ep_internode_combine`` call: ``y [C, W]`` -> ``[T, W]``; each
    node's partials are summed before the network leg."""
    T = handle.num_tokens
    rank_major = handle.layout == "rank_major"
    weighted = row_weights is not None and not rank_major
    w = row_weights.astype(jnp.float32) if weighted else jnp.zeros((0,), jnp.float32)
    nodes = nodes_of(cfg, handle.num_ranks)
    _check_region("combine", handle.num_ranks, cfg, nodes)
    (out,) = _ffi.call(
        "jax_ep_internode_combine",
        [((T, y.shape[1]), y.dtype)],
        y, w, handle.slot_row, handle.recv_local_idx, handle.send_mask,
        ep_axis=cfg.axis_name, has_side_effect=True, nodes=np.int32(nodes),
        net_transport=_net_transport(cfg), rank_major=np.int32(rank_major),
        weighted=np.int32(weighted), num_sms=ffi_attrs.num_sms(cfg, num_sms),
        chunk=ffi_attrs.chunk(cfg, "combine"),
        timeout_ns=ffi_attrs.timeout_ns(cfg.tuning.peer_timeout_s))
    return out


class InternodeBackend(intranode_native.NativeBackend):
    """Rows through the internode kernels; routing, weights and the layout as
    intranode."""

    _dispatch = staticmethod(dispatch_raw)
    _combine = staticmethod(combine_raw)

    def _weighted_combine_backward(self, g, y, w, handle: Handle, cfg: EpConfig):
        # No fused internode kernel: the internode dispatch of g, then the
        # reference's dy / dw in XLA ([C, W] f32 temporaries, as the reference).
        g_rows = dispatch_raw(g.astype(y.dtype), None, handle, cfg)[0].astype(jnp.float32)
        dy = (w[:, None] * g_rows).astype(y.dtype)
        dw = jnp.sum(g_rows * y.astype(jnp.float32), axis=1)
        return dy, dw


BACKEND = InternodeBackend()
