"""The low-latency kernels' region, laid out for one decode shape (E, Tmax, K, H).

Its size comes from the extension (``ll_region_size``), the one source of it.
"""
from __future__ import annotations

from .. import extension
from ..config import EpConfig
from ..region import Region, check_live_shape
from . import config as ll_config
from .config import LowLatencyConfig

NONE = (0, 0, 0, 0)   # (E, Tmax, K, H) of no region


def shape_of(config) -> tuple:
    """(E, Tmax, K, H) of the region for a :class:`LowLatencyConfig` or an
    :class:`EpConfig` (None: no region)."""
    if config is None:
        return NONE
    if not isinstance(config, (LowLatencyConfig, EpConfig)):
        raise TypeError(f"jax_ep.initialize: low_latency must be a LowLatencyConfig, an EpConfig "
                        f"or None, got {type(config).__name__}")
    return ll_config.of(config).shape


def region_bytes(config) -> int:
    """Bytes of the low-latency region ``initialize(low_latency=config)`` adds to
    each GPU's buffer: both call parities of ``8 * Tmax`` dispatch token rows
    (one per (source rank, token), up to 8 ranks; bf16 width, so fp8 and bf16
    rows fit; + f32 scales), an int32 info word per ``E * Tmax`` output row and
    ``Tmax * K`` combine rows (f32 width), whatever the EP size, plus one
    staging copy of what this rank may send by NVSHMEM puts
    (``ll_transport``): ``Tmax`` dispatch rows and ``min(E, 8 K) *
    Tmax`` combine rows. About 0.33 GB (0.30 GiB) at DeepSeek-V3 decode (E 256,
    Tmax 128, K 8, H 7168), 0.24 GB of it staging."""
    C = extension.require("low_latency_region_bytes")
    return int(C.ll_region_size(shape_of(config)))


def plan(C, config) -> Region:
    """The region for ``initialize(low_latency=config)`` (extension ``C``)."""
    shape = shape_of(config)
    return Region("low_latency", shape, int(C.ll_region_size(shape)))


def check_live(live_shape: tuple, config) -> None:
    """A later ``initialize(low_latency=config)`` on a live runtime must ask for
    the region it has (or None)."""
    check_live_shape("low_latency=...", config, shape_of(config), live_shape,
                     f"a low-latency region for (E, Tmax, K, H) = {tuple(live_shape)} "
                     "(zeros: none)")
