"""The error words jax_ep's kernels leave in mapped host memory, as a Python error.

Codes are set by the kernels (a peer that never answered, a low-latency send
out of order), one word per op family, and read on the host without
synchronising. The extension hands one error as an int: its code in the low 8
bits, its op family above them (``cc/common/device_error.h``).
"""
from __future__ import annotations

_WHAT = {
    1: "timed out waiting for a peer rank (ranks called different ops, a peer died, or a "
       "peer reached the call later than peer_timeout_s: KernelTuning / RaggedConfig, 10 s by "
       "default; raise it when hosts reach their first call far apart)",
    2: "a low-latency send ran before the previous receive of the same op finished (sends and "
       "receives of one op must alternate on every rank)",
    3: "a ragged_all_to_all slice of this rank ran past its operand or its receiver's output, or "
       "had a negative offset or size (it was not sent); fix input_offsets, send_sizes and "
       "output_offsets",
    4: "a ragged_all_to_all slice this rank received has a size other than its recv_sizes entry "
       "(recv_sizes[s * S + k] must equal send_sizes[r * S + k] of sender s), or its sender's "
       "slice ran past a buffer (it was not written); fix the sizes",
}

# Codes after which the runtime stays usable (a bad argument, not a lost peer).
RECOVERABLE = frozenset({3, 4})


def describe(code: int, op: str = "") -> str:
    """What error ``code`` (the low 8 bits) of a kernel of family ``op`` means."""
    kernel = f"a previous {op} kernel" if op else "a previous kernel"
    if code == 1:
        return f"{kernel} {_WHAT[1]}"
    return _WHAT.get(code, f"{kernel} raised error {code}")


def check(C, keep: bool) -> None:
    """Raise if the extension ``C`` holds an error. ``keep``: read it and leave
    it set (peer memory: words shared by every GPU of the process, whose next
    calls must all fail); else take it (read, then clear every word)."""
    raised = int(C.device_error() if keep else C.take_device_error())
    code, op = raised & 0xFF, C.error_op_name(raised >> 8) if raised else ""
    if code in RECOVERABLE:
        if keep:
            C.take_device_error()
        raise ValueError(f"jax_ep: {describe(code, op)}; that call's result is incomplete")
    if code:
        raise RuntimeError(f"jax_ep: {describe(code, op)}; results since are invalid, restart the job")
