"""The error word jax_ep's kernels leave in mapped host memory, as a Python error.

Codes are set by the kernels (a peer that never answered, a low-latency send
out of order) and read on the host without synchronising.
"""
from __future__ import annotations

_WHAT = {
    1: "a kernel timed out waiting for a peer rank (ranks called different ops, or a peer died)",
    2: "a low-latency send ran before the previous receive of the same op finished (sends and "
       "receives of one op must alternate on every rank)",
}


def describe(code: int) -> str:
    return _WHAT.get(code, f"kernel error {code}")


def check(C, keep: bool) -> None:
    """Raise if the extension ``C`` holds an error code. ``keep``: read it and
    leave it set (peer memory: one word shared by every GPU of the process,
    whose next calls must all fail); else take it (read and clear)."""
    code = int(C.device_error() if keep else C.take_device_error())
    if code:
        raise RuntimeError(f"jax_ep: {describe(code)}; results since are invalid, restart the job")
