"""Native ragged all-to-all: the ``jax_ep_ragged_all_to_all`` custom call.

One kernel (cc/ragged/kernels.cu), no host synchronisation: every rank
stores (P2P) or puts (NVSHMEM) the rows of its slices into each receiver's
receive area of the ragged region at the rows where they land, writes each
slice's (start, size) word, and signals; then waits for every sender's
signal (a device-side timeout, never a hang) and copies the received rows
into its result, which is ``output`` itself (an XLA input/output alias: rows
no slice writes keep their values). A slice that runs past ``operand`` or the
receiver's ``output``, or whose size differs from the receiver's
``recv_sizes``, is not written and raises a device-side error (the next
jax_ep call, or ``jax_ep.check_device_error()``, reports it).

Attributes: ``transport`` (``RaggedConfig.transport`` as its
``abi.LL_TRANSPORTS`` code), ``num_sms`` and ``timeout_ns``
(``RaggedConfig.peer_timeout_s``); the EP group (``ep_groups``,
narrowed to ``axis_index_groups``) is added when the call is lowered
(jax_ep/_ffi.py).
"""
from __future__ import annotations

import numpy as np

from .. import _ffi, abi, extension, ffi_attrs, runtime
from . import region
from .config import RaggedCall

TARGET = "jax_ep_ragged_all_to_all"


def attrs(call: RaggedCall) -> dict:
    """The call's FFI attributes (besides the EP group)."""
    return dict(transport=np.int32(abi.ll_transport(call.config.transport)),
                num_sms=np.int32(call.config.num_sms or 0),
                timeout_ns=ffi_attrs.timeout_ns(call.config.peer_timeout_s))


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      call: RaggedCall):
    if call.in_rows == 0 or call.out_rows == 0 or call.row_bytes == 0:
        return output   # no row can move (the same shapes on every rank): no kernel
    out, = _ffi.call(TARGET, [(output.shape, output.dtype)], operand, output, input_offsets,
                     send_sizes, output_offsets, recv_sizes, ep_axis=call.axis_name,
                     ep_index_groups=call.groups, operand_output_aliases={1: 0},
                     has_side_effect=True, **attrs(call))
    return out


def _shape_error(call: RaggedCall, cap: int):
    """Why the call's shapes do not fit the kernel or the live region (None: they do)."""
    C = extension.load()
    if call.row_bytes is None:
        return TypeError("jax_ep.ragged_all_to_all (native): sub-byte dtypes (int4, fp4, ...) "
                         "are not supported; use the reference backend or a byte-sized dtype")
    if call.num_ranks > C.MAX_RANKS:
        return ValueError(f"jax_ep.ragged_all_to_all (native): groups of {call.num_ranks} ranks; "
                          f"the kernel handles at most {C.MAX_RANKS}")
    if call.slices > C.RAGGED_MAX_SLICES:
        return ValueError(
            f"jax_ep.ragged_all_to_all (native): {call.slices} slices per rank (offsets of length "
            f"{call.slices * call.num_ranks}); the kernel handles at most {C.RAGGED_MAX_SLICES}")
    need = max(call.in_bytes, call.out_bytes)
    if need > cap:
        return ValueError(
            f"jax_ep.ragged_all_to_all (native): operand ({call.in_bytes} bytes per rank) or "
            f"output ({call.out_bytes}) is larger than the ragged region's {cap} bytes; start the "
            f"runtime with jax_ep.initialize(ragged_bytes={need}) or more (jax_ep.finalize() "
            "first)")
    return None


class NativeBackend:
    """The ragged family's native backend (``jax_ep.backend.RAGGED``)."""

    name = "native"

    def unavailable(self, call: RaggedCall):
        """None when the live runtime has a ragged region that holds this call's
        operand and output and the kernel takes its shapes, else the error a
        ``backend="native"`` call raises."""
        if not runtime.is_initialized():
            return runtime.not_initialized_error()
        live = runtime.region("ragged")
        if live is None or not live.nbytes:
            return ValueError(
                "jax_ep.ragged_all_to_all (native): the runtime has no ragged region; call "
                "jax_ep.initialize(ragged_bytes=B) with B the bytes of the largest operand or "
                f"output per rank (this call: {max(call.in_bytes, call.out_bytes)})")
        if call.config.transport == "put" and runtime.symmetric_memory() == "peer_memory":
            return ValueError("jax_ep.ragged_all_to_all: RaggedConfig.transport='put' needs the "
                              "NVSHMEM transport; the runtime uses peer memory (no PEs to put "
                              "to). Use 'auto' or 'p2p'")
        return _shape_error(call, region.capacity(live.attach_arg))

    def ragged_all_to_all(self, operand, output, input_offsets, send_sizes, output_offsets,
                          recv_sizes, call: RaggedCall):
        return ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                 recv_sizes, call)


BACKEND = NativeBackend()
