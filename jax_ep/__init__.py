"""jax_ep: expert-parallel dispatch and combine for JAX.

Per-rank functions, called inside ``jax.shard_map`` over ``EpConfig.axis_name``:
:func:`dispatch`, :func:`combine`, :func:`get_dispatch_layout`, and the
low-latency (decode) pair :func:`low_latency_dispatch` / :func:`low_latency_combine`
and their send / receive halves, the hook (configured by a
:class:`LowLatencyConfig` or an :class:`EpConfig`), and
:func:`ragged_all_to_all`, a drop-in for ``jax.lax.ragged_all_to_all``. The native
backend (CUDA kernels over NVSHMEM, one GPU per process) is used after
:func:`initialize`; otherwise the pure-JAX reference backend runs anywhere.
The experts' grouped matmul: :func:`grouped_matmul` (bf16, or fp8 with
:func:`quantize_activations` / :func:`quantize_weights` scales).
"""
from .api import combine, dispatch, get_dispatch_layout
from .config import EpConfig, KernelTuning
from .fp8 import fp8_cast, quantize_activations, quantize_weights
from .gmm import GroupedMatmulConfig, grouped_matmul, quantize_swiglu, quantize_weights_pair
from .low_latency.api import (low_latency_combine, low_latency_combine_recv,
                              low_latency_combine_send, low_latency_dispatch,
                              low_latency_dispatch_recv, low_latency_dispatch_send)
from .low_latency.config import LowLatencyConfig
from .low_latency.region import region_bytes as low_latency_region_bytes
from .low_latency.types import LowLatencyDispatched, LowLatencyHandle, LowLatencyPending
from .ragged.api import ragged_all_to_all
from .ragged.config import RaggedConfig
from .ragged.region import region_bytes as ragged_region_bytes
from .runtime import check_device_error, finalize, initialize, is_initialized
from .types import Dispatched, Handle

__all__ = [
    "EpConfig", "KernelTuning", "Dispatched", "Handle", "dispatch", "combine", "get_dispatch_layout",
    "grouped_matmul", "GroupedMatmulConfig",
    "low_latency_dispatch", "low_latency_combine", "LowLatencyConfig", "LowLatencyDispatched",
    "LowLatencyHandle",
    "low_latency_dispatch_send", "low_latency_dispatch_recv", "low_latency_combine_send",
    "low_latency_combine_recv", "LowLatencyPending", "low_latency_region_bytes",
    "ragged_all_to_all", "RaggedConfig", "ragged_region_bytes",
    "check_device_error",
    "initialize", "finalize", "is_initialized", "fp8_cast", "quantize_activations",
    "quantize_weights",
    "quantize_weights_pair", "quantize_swiglu",
]
__version__ = "0.1.0"

