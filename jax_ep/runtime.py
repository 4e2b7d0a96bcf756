"""Process-level native runtime: NVSHMEM bootstrap and each GPU's buffer regions.

One GPU per process: each JAX process is one NVSHMEM PE (PE = ``jax.process_index()``).
Typical use::

    jax.distributed.initialize(coordinator, num_processes=N, process_id=i,
                               local_device_ids=[i])
    jax_ep.initialize()            # collective over all processes
    ...                            # backend="auto"/"native" now uses the kernels
    jax_ep.finalize()              # collective

Without the compiled extension, without a CUDA GPU, or with several GPUs in one
process, ``initialize`` leaves the runtime down (``unavailable_reason()`` says
why) and ``backend="auto"`` falls back to the pure-JAX reference backend.

Each GPU's buffer is a list of regions, one per kernel family, each sized by
its family (``jax_ep/<family>/region.py``); :func:`region` gives the live one.
The NVSHMEM environment is ``jax_ep.nvshmem_env``, the hosts ``jax_ep.hosts``,
the device error words ``jax_ep.device_errors``.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import jax
from jax._src import distributed

from . import device_errors, extension, nvshmem_env
from . import hosts as _hosts
from . import shared_gpu as _shared_gpu
from .internode import region as internode_region
from .intranode import region as intranode_region
from .low_latency import region as low_latency_region
from .ragged import region as ragged_region
from .region import Region, heap_bytes

_UID_TIMEOUT_MS = 120_000

_state = {
    "initialized": False,
    "owns_nvshmem": False,   # we called nvshmem_init (and may finalize)
    "nvshmem_up": False,     # NVSHMEM is initialised in this process
    "heap_bytes": None,      # NVSHMEM's symmetric heap, as it started
    "generation": 0,         # initialize() calls, for unique KV-store keys
    "reason": "jax_ep.initialize() not called",
    "symmetric_memory": None,  # "nvshmem" | "peer_memory" while initialized
    "hosts": None,           # host name of every PE (NVSHMEM), see hosts.py
    "regions": (),           # the live Regions, in the extension's attach order
}
SYMMETRIC_MEMORY = ("auto", "nvshmem", "peer_memory")

extension_available = extension.available


def unavailable_reason() -> str:
    """Why the native runtime is not up (empty string when it is)."""
    if _state["initialized"]:
        return ""
    if not extension.available():
        return extension.error()
    return _state["reason"]


def is_initialized() -> bool:
    return _state["initialized"]


def info() -> Optional[dict]:
    """``{my_pe, n_pes, sym_bytes, device, num_sms, ll_shape, ll_bytes,
    inter_shape, inter_bytes}`` of the live runtime as the extension reports
    it, or None. ``ll_shape``: (E, Tmax, K, H) of the low-latency region
    (zeros when there is none), ``ll_bytes`` its size; ``inter_shape``:
    (nodes, ranks, T, H) of the internode region, ``inter_bytes`` its size."""
    C = extension.load()
    return C.runtime_info() if C is not None else None


def regions() -> tuple:
    """The live runtime's :class:`jax_ep.region.Region` list (empty when down)."""
    return _state["regions"] if _state["initialized"] else ()


def region(family: str) -> Optional[Region]:
    """The live region of kernel family ``family`` (its ``nbytes`` 0 when
    initialize laid none out), or None when the runtime is down."""
    return next((r for r in regions() if r.family == family), None)


def symmetric_memory() -> Optional[str]:
    """Where the live runtime's buffers live and how ranks reach each other's:
    ``"nvshmem"`` (the NVSHMEM symmetric heap, one GPU per process) or
    ``"peer_memory"`` (a buffer per GPU of one process, CUDA peer access); None
    when the runtime is down."""
    return _state["symmetric_memory"] if _state["initialized"] else None


def pe_hosts() -> Optional[list]:
    """Host name of every NVSHMEM PE of the live runtime (index = PE), or None
    (no runtime, or peer memory: one process, one host)."""
    return _state["hosts"] if symmetric_memory() == "nvshmem" else None


def not_initialized_message() -> str:
    C = extension.load()
    if C is not None:
        return C.NOT_INITIALIZED_MESSAGE
    return ("jax_ep native runtime is not initialised in this process: call jax_ep.initialize() "
            "(after jax.distributed.initialize) before using backend='native'")


def not_initialized_error() -> RuntimeError:
    """The error of a native call while the runtime is down, naming why."""
    return RuntimeError(f"{not_initialized_message()} ({unavailable_reason()})")


def check_device_error() -> None:
    """Raise if a jax_ep kernel has left an error (a peer timeout, a low-latency
    send out of order) since the last check, naming the op family whose kernel
    raised it; clears it.

    Every jax_ep custom call checks these words before it launches. Inside an
    XLA command buffer (CUDA graph: the low-latency ops may be captured) that
    check runs only when the graph is recorded, so a decode loop that runs
    captured steps should call this between steps (a host read of mapped
    memory, no synchronisation: call it after ``block_until_ready`` to cover
    the step just finished). No-op when the runtime is not up. With peer
    memory (one process, several GPUs, words they share) the error is read and
    kept, as the FFI handlers keep it: every GPU's next call must fail, or the
    others would launch, spin and fall an epoch apart.
    """
    C = extension.load()
    if C is None or not _state["initialized"]:
        return
    device_errors.check(C, keep=_state["symmetric_memory"] == "peer_memory")


def _kv_client():
    return distributed.global_state.client


def _share_unique_id(C, rank: int, nranks: int) -> bytes:
    """Rank 0 creates the NVSHMEM unique id; everyone reads it from JAX's KV store."""
    if nranks == 1:
        return C.nvshmem_unique_id()
    client = _hosts.require_client(_kv_client())
    key = f"jax_ep/nvshmem_uid/{_state['generation']}"
    if rank == 0:
        uid = C.nvshmem_unique_id()
        client.key_value_set_bytes(key, uid)
        return uid
    return bytes(client.blocking_key_value_get_bytes(key, _UID_TIMEOUT_MS))


def _not_up(reason: str) -> bool:
    _state["reason"] = reason
    logging.getLogger("jax_ep").warning("jax_ep: native runtime not started: %s", reason)
    return False


def _config_list(config) -> list:
    """``initialize``'s ``config``: None, one EpConfig or a list / tuple of them."""
    if config is None:
        return []
    return list(config) if isinstance(config, (list, tuple)) else [config]


def _check_live(config, low_latency, ragged_bytes) -> None:
    """A later ``initialize`` on a live runtime: its configs must fit the regions
    laid out at start."""
    live = {r.family: r.attach_arg for r in regions()}
    low_latency_region.check_live(live.get("low_latency", low_latency_region.NONE), low_latency)
    ragged_region.check_live(live.get("ragged", ragged_region.NONE), ragged_bytes)
    hosts = pe_hosts()
    internode_region.check_live(live.get("internode", internode_region.NONE),
                                _config_list(config), hosts)


def _up(memory: str, regions_: tuple, hosts) -> bool:
    _state.update(initialized=True, symmetric_memory=memory, regions=regions_, hosts=hosts,
                  reason="")
    return True


def initialize(buffer_bytes: Optional[int] = None, config=None, symmetric_memory: str = "auto",
               low_latency=None, ragged_bytes: Optional[int] = None) -> bool:
    """Start the native runtime in this process. Collective over all processes.

    Call after ``jax.distributed.initialize`` (when there are several processes).
    Bootstraps NVSHMEM (rank 0's unique id travels through JAX's distributed
    key-value store; an NVSHMEM that XLA already started is reused) and
    allocates the symmetric buffer with ``nvshmem_malloc``. With
    ``symmetric_memory="peer_memory"`` in a single process that drives several GPUs it
    instead allocates one buffer per GPU and enables peer access between them
    (no NVSHMEM; docs/transports.md). That mode has not run on GPUs yet, so
    ``"auto"`` does not pick it: in such a process ``"auto"`` returns False
    (reference backend) and says how to opt in.

    Args:
      buffer_bytes: symmetric buffer per process (default: from ``config``,
        else 1 GiB). It comes out of the GPU memory JAX did not preallocate;
        lower ``XLA_PYTHON_CLIENT_MEM_FRACTION`` if it does not fit.
      config: an :class:`EpConfig` (or a list of them) to size the buffer
        for: the largest ``jax_ep.intranode.region.buffer_bytes(config,
        process_count)``. When any has ``num_nodes > 1``, an internode region
        is appended after the other regions
        (``jax_ep.internode.region.shape_of``; added even when
        ``buffer_bytes`` is given, which sizes only the normal buffer).
      symmetric_memory: the memory every rank's kernels write into, and how
        they reach the other ranks': ``"auto"`` or ``"nvshmem"`` (the NVSHMEM
        symmetric heap, one GPU per process, any number of hosts) or
        ``"peer_memory"`` (a ``cudaMalloc`` buffer per GPU of one process and
        CUDA peer access between them; not yet validated on GPUs).
      low_latency: the decode config (a :class:`jax_ep.LowLatencyConfig` or an
        :class:`EpConfig`: ``num_experts``, ``max_tokens_per_rank`` = Tmax,
        ``topk``, ``hidden``) to lay out the low-latency region for (:func:`jax_ep.low_latency_dispatch` with the
        native backend needs it; calls must use that E, K, H and T <= Tmax).
        Adds :func:`jax_ep.low_latency_region_bytes` to each buffer. None: no
        region.
      ragged_bytes: lay out the region of the native
        :func:`jax_ep.ragged_all_to_all` for operands and outputs of up to
        this many bytes per rank (:func:`jax_ep.ragged_region_bytes`: about 3x
        that). None: no region (``ragged_all_to_all`` uses the reference).

    Returns:
      True when the runtime is up; False (with a one-line notice, see
      ``unavailable_reason()``) when this process cannot run it: no extension,
      no CUDA GPU, or more than one GPU per process.

    Environment: every process's host is exchanged through JAX's key-value
    store (``jax_ep/hosts.py``); on one host it sets
    ``NVSHMEM_REMOTE_TRANSPORT=none``, across hosts ``NVSHMEM_IB_ENABLE_IBGDA=1``
    (NVSHMEM's default remote transport stays), each unless the user set it
    (``none`` with IBGDA off across hosts raises, on every process); it sets
    ``NVSHMEM_DISABLE_NVLS=1`` unless already set, and raises
    ``NVSHMEM_SYMMETRIC_SIZE`` to fit the buffer. Multi-host: ``docs/multihost.md``.
    """
    if _state["initialized"]:
        return _initialize_live(config, symmetric_memory, low_latency, ragged_bytes)
    _check_symmetric_memory(symmetric_memory)
    # Every attempt, first thing: a process that returns early or raises below
    # stays in step with the others' key-value keys when it tries again.
    _state["generation"] += 1
    C = extension.load()
    if C is None:
        return _not_up(unavailable_reason())
    cfgs = _config_list(config)
    ranks = _ep_ranks(cfgs, symmetric_memory)
    sized = (intranode_region.plan(cfgs, ranks, buffer_bytes),
             low_latency_region.plan(C, low_latency), ragged_region.plan(C, ragged_bytes))
    return _attach(C, symmetric_memory, cfgs, ranks, sized)


def _attach(C, symmetric_memory: str, cfgs: list, ranks: int, sized: tuple) -> bool:
    """``initialize`` once the regions that need no hosts are sized (``sized``:
    normal, low-latency, ragged): attach them on this process's GPU(s)."""
    normal, ll, ragged = sized
    # JAX must create its GPU client (and CUDA primary context) before NVSHMEM.
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    if not gpus:
        return _not_up("no CUDA GPU visible to JAX in this process")
    if symmetric_memory == "peer_memory":   # one process: one host
        return _attach_peer_memory(C, gpus, (normal, ll, internode_region.plan(C, cfgs, ranks),
                                             ragged))
    if len(gpus) != 1:
        return _not_up(
            f"this process drives {len(gpus)} GPUs; the NVSHMEM transport needs one GPU per "
            "process (jax.distributed.initialize(..., local_device_ids=[i]) or jax-ep-launch), "
            "or opt in to the peer-memory transport (not yet validated on GPUs): "
            "jax_ep.initialize(symmetric_memory='peer_memory')")
    return _attach_nvshmem(C, int(gpus[0].local_hardware_id), cfgs, ranks, normal, ll, ragged)


def _initialize_live(config, symmetric_memory: str, low_latency, ragged_bytes) -> bool:
    """``initialize`` on a live runtime: same memory, configs that fit its regions."""
    if symmetric_memory not in ("auto", _state["symmetric_memory"]):
        raise ValueError(
            f"jax_ep.initialize(symmetric_memory={symmetric_memory!r}): the runtime is "
            f"already up with {_state['symmetric_memory']!r}; call jax_ep.finalize() first")
    _check_live(config, low_latency, ragged_bytes)
    return True


def _check_symmetric_memory(symmetric_memory: str) -> None:
    if symmetric_memory not in SYMMETRIC_MEMORY:
        raise ValueError(f"jax_ep.initialize: symmetric_memory must be one of "
                         f"{SYMMETRIC_MEMORY}, got {symmetric_memory!r}")
    sharing = _shared_gpu.processes_per_gpu(os.environ)
    if symmetric_memory == "peer_memory" and sharing > 1:
        raise ValueError(
            f"jax_ep.initialize(symmetric_memory='peer_memory'): this process shares its GPU "
            f"with {sharing - 1} other(s) (jax-ep-launch with fewer GPUs than processes), and "
            "peer memory drives several GPUs from one process; use the NVSHMEM symmetric heap "
            "(symmetric_memory='auto'), which runs several processes on one GPU")


def _ep_ranks(cfgs: list, symmetric_memory: str) -> int:
    """EP ranks the configs' regions are sized for: the processes (one GPU
    each), or every GPU of this process; 1 without configs."""
    if not cfgs:
        return 1
    return max(1, (len([d for d in jax.local_devices() if d.platform == "gpu"])
                   if symmetric_memory == "peer_memory" else jax.process_count()))


def _attach_nvshmem(C, device: int, cfgs: list, ranks: int, normal: Region,
                    ll: Region, ragged: Region) -> bool:
    """One GPU per process: regions on the NVSHMEM symmetric heap (started here
    unless it is already up)."""
    rank, nranks = jax.process_index(), jax.process_count()
    # Every process's host (and free GPU memory) first: the internode region's
    # node split follows the hosts (an EP group larger than a host: one node per
    # host, hosts.auto_nodes), and every process checks every process's memory.
    user_net = nvshmem_env.user_network()
    values = _hosts.exchange(
        _kv_client() if nranks > 1 else None, rank, nranks, _state["generation"],
        _UID_TIMEOUT_MS, _hosts.local_value(
            user_net, 0 if _state["nvshmem_up"] else C.device_free_bytes(device), device))
    hosts, net_env = _hosts.job_network_env(values)
    inter = internode_region.plan(C, cfgs, ranks, hosts)
    regions_ = (normal, ll, inter, ragged)     # the extension's attach order
    need_heap = heap_bytes(regions_)
    extension.register_targets()
    nvshmem_env.set_heap(need_heap)
    if _state["nvshmem_up"] and _state["heap_bytes"] and need_heap > _state["heap_bytes"]:
        # NVSHMEM stayed up (JAX_EP_KEEP_NVSHMEM=1, or started by XLA): its heap
        # was sized when it started and does not grow.
        raise RuntimeError(
            f"jax_ep.initialize: buffer {normal.nbytes >> 20} MiB + low-latency region "
            f"{ll.nbytes >> 20} MiB + internode region {inter.nbytes >> 20} MiB + ragged region "
            f"{ragged.nbytes >> 20} MiB exceed the NVSHMEM "
            f"symmetric heap NVSHMEM started with ({_state['heap_bytes'] >> 20} MiB); initialize "
            "the largest configuration first, or set NVSHMEM_SYMMETRIC_SIZE before the first "
            "initialize")
    if not _state["nvshmem_up"]:
        _check_heap_fits(values, nranks, normal.nbytes, ll.nbytes + inter.nbytes + ragged.nbytes)
        _start_nvshmem(C, net_env, user_net, rank, nranks, device)
    # raises naming XLA_PYTHON_CLIENT_MEM_FRACTION
    C.runtime_attach(device, *(r.attach_arg for r in regions_))
    return _up("nvshmem", regions_, hosts)


def _check_heap_fits(values, nranks: int, buffer_bytes: int, region_bytes: int) -> None:
    """Raise unless the heap fits every process's free GPU memory.

    Every process's free memory came with the hosts: the same answer on every
    rank, so no rank is left waiting in NVSHMEM's start when this raises.
    """
    heap = int(os.environ["NVSHMEM_SYMMETRIC_SIZE"])
    # processes sharing a GPU (jax_ep.shared_gpu) share its free memory
    room = [(free // on_gpu, on_gpu) for free, on_gpu in _hosts.gpu_sharing(values)]
    worst = min(range(nranks), key=lambda r: room[r][0])
    free, on_gpu = room[worst]
    if heap > free:
        shared = (f" ({on_gpu} processes share that GPU: a heap each)" if on_gpu > 1
                  else "")
        raise RuntimeError(
            f"jax_ep.initialize: the NVSHMEM symmetric heap ({heap >> 20} MiB for "
            f"buffer_bytes={buffer_bytes} + regions of {region_bytes} bytes) does not "
            f"fit in the {free >> 20} MiB of GPU memory process {worst} has "
            f"JAX left free{shared}; lower XLA_PYTHON_CLIENT_MEM_FRACTION (now "
            f"{os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', 'unset: 0.75')}) or set "
            "XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX starts, or pass a smaller "
            "buffer_bytes")


def _start_nvshmem(C, net_env, user_net, rank: int, nranks: int, device: int) -> None:
    """Start NVSHMEM, or attach to the one XLA started (never finalised here)."""
    # One host: no network transport (no NIC needed). Several: NVSHMEM's
    # default plus IBGDA, unless the users chose (hosts.network_env).
    nvshmem_env.apply_network(net_env, user_net)
    if C.nvshmem_status() >= 2:  # started by XLA: attach, never finalize it
        C.nvshmem_init(b"", rank, nranks, device)
        _state["owns_nvshmem"] = False
    else:
        uid = _share_unique_id(C, rank, nranks)
        _state["owns_nvshmem"] = C.nvshmem_init(uid, rank, nranks, device)
    _state["nvshmem_up"] = True
    _state["heap_bytes"] = int(os.environ["NVSHMEM_SYMMETRIC_SIZE"])


def _attach_peer_memory(C, gpus, regions_: tuple) -> bool:
    """One process, several GPUs: a buffer per GPU, peer access between all."""
    if jax.process_count() != 1:
        raise ValueError("jax_ep.initialize(symmetric_memory='peer_memory') drives the GPUs "
                         f"of ONE process; this job has {jax.process_count()} processes (use "
                         "the NVSHMEM symmetric heap, one GPU per process)")
    extension.register_targets()
    # The lowering names each GPU by its CUDA ordinal (jax_ep._ffi.pe_of_device),
    # which is also XLA's device ordinal in the FFI call.
    C.peer_memory_attach([int(d.local_hardware_id) for d in gpus],
                         *(r.attach_arg for r in regions_))
    return _up("peer_memory", regions_, None)


def finalize() -> None:
    """Free the symmetric buffer and shut NVSHMEM down. Collective.

    ``initialize()`` may be called again afterwards. With
    ``JAX_EP_KEEP_NVSHMEM=1`` NVSHMEM itself stays up (only the buffer is
    freed) and a later ``initialize()`` reuses it. An NVSHMEM started by XLA is
    never finalised here. Steps that XLA captured into command buffers (CUDA
    graphs: the low-latency ops) hold the old buffer's addresses: after
    ``finalize()`` and a new ``initialize()``, call ``jax.clear_caches()``
    before running such a jitted function again.
    """
    if not _state["initialized"]:
        return
    C = extension.load()
    peer = _state["symmetric_memory"] == "peer_memory"
    _state.update(initialized=False, reason="jax_ep.finalize() was called",
                  symmetric_memory=None, regions=())
    C.runtime_detach()
    if peer:
        return
    if _state["owns_nvshmem"] and not nvshmem_env.keep_nvshmem():
        C.nvshmem_finalize()
        _state["nvshmem_up"] = False
        _state["owns_nvshmem"] = False
