"""Facts about the devices the kernels run on, by ``device_kind``.

The kernels size their grids by the SM count and their pipelines by the
shared memory a block may use; both come from here. A kind missing from the
table gets Hopper SXM facts (what the kernels assumed for every device before
there was a table), so tracing or interpreting on a CPU sizes things as on an
H200.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    kind: str                 # jax.devices()[0].device_kind
    platform: str             # "gpu" for CUDA devices
    compute_capability: str   # "9.0"; "" where unknown
    sm_count: int
    smem_per_block: int       # bytes of shared memory one block may use (opt-in maximum)


_HOPPER_SMEM = 227 * 1024   # sm_90: 228 KB per SM, 227 KB of it per block

DEVICES = {
    "NVIDIA H200": DeviceInfo("NVIDIA H200", "gpu", "9.0", 132, _HOPPER_SMEM),
    "NVIDIA H100 80GB HBM3": DeviceInfo("NVIDIA H100 80GB HBM3", "gpu", "9.0", 132, _HOPPER_SMEM),
}

# Unknown kinds: the runtime's platform and compute capability, Hopper SXM sizes.
_FALLBACK_SMS = 132
_FALLBACK_SMEM = _HOPPER_SMEM


def device_info(device=None) -> DeviceInfo:
    """The facts of ``device`` (default ``jax.devices()[0]``). The runtime's
    SM count, where it reports one, wins over the table's: it is what the
    device actually has (a kind name can cover several SKUs)."""
    if device is None:
        device = _first_device()
    if device is None:
        return DeviceInfo("", "", "", _FALLBACK_SMS, _FALLBACK_SMEM)
    kind = str(getattr(device, "device_kind", ""))
    known = DEVICES.get(kind)
    if known is None:
        known = DeviceInfo(kind, str(getattr(device, "platform", "")),
                           str(getattr(device, "compute_capability", "") or ""),
                           _FALLBACK_SMS, _FALLBACK_SMEM)
    sms = _runtime_sm_count(device)
    return dataclasses.replace(known, sm_count=sms) if sms else known


def _first_device():
    try:
        return jax.devices()[0]
    except Exception:  # pragma: no cover -- no backend at all
        return None


def _runtime_sm_count(device) -> Optional[int]:
    try:
        n = int(getattr(device, "core_count", 0) or 0)
    except Exception:  # pragma: no cover
        return None
    return n if n > 0 else None
