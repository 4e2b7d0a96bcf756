"""Process-level native runtime: NVSHMEM bootstrap and the symmetric buffer.

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
"""
from __future__ import annotations

import ctypes
import glob
import importlib
import logging
import os
from typing import Optional

from . import hosts as _hosts
from . import shared_gpu as _shared_gpu

DEFAULT_BUFFER_BYTES = 1 << 30  # symmetric buffer per process
DEFAULT_INTERNODE_BYTES = 1 << 30  # bound on the internode region (EpConfig.internode_bytes)
_HEAP_GRANULE = 512 << 20       # NVSHMEM grows its heap in 512 MiB granules
_HEAP_SLACK = 128 << 20         # NVSHMEM's own allocations from the heap
_UID_TIMEOUT_MS = 120_000

_state = {
    "initialized": False,
    "owns_nvshmem": False,   # we called nvshmem_init (and may finalize)
    "nvshmem_up": False,     # NVSHMEM is initialised in this process
    "generation": 0,         # initialize() calls, for unique KV-store keys
    "reason": "jax_ep.initialize() not called",
    "symmetric_memory": None,  # "nvshmem" | "peer_memory" while initialized
    "hosts": None,           # host name of every PE (NVSHMEM transport), see hosts.py
    "net_env_set": {},       # network variables initialize set (and their values)
}
SYMMETRIC_MEMORY = ("auto", "nvshmem", "peer_memory")
_ext = {"module": None, "error": None, "registered": False}


def _preload_nvshmem() -> None:
    """Load the wheel's libnvshmem_host.so.3 globally so ``_C`` resolves it.

    The extension's RPATH finds it in an installed tree; this also covers
    in-place/editable builds, where ``_C`` does not sit next to ``nvidia/``.
    """
    try:
        import nvidia.nvshmem as m
    except ImportError:
        return
    for d in m.__path__:
        for lib in sorted(glob.glob(os.path.join(d, "lib", "libnvshmem_host.so*"))):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                pass


def _extension():
    """The ``jax_ep._C`` module or None (the reason is kept in ``_ext``)."""
    if _ext["module"] is None and _ext["error"] is None:
        _preload_nvshmem()
        try:
            _ext["module"] = importlib.import_module(__package__ + "._C")
        except ImportError as e:
            hint = ""
            if "NVSHMEM" in str(e):
                try:
                    from importlib.metadata import version
                    installed = version("nvidia-nvshmem-cu13")
                except Exception:
                    installed = "unknown"
                hint = (f"; jax_ep._C must run with the nvidia-nvshmem-cu13 release it was "
                        f"built against (installed: {installed})")
            if getattr(e, "name", None) == __package__ + "._C":
                _ext["error"] = (
                    "jax_ep was installed without its CUDA extension (jax_ep._C): the reference "
                    "backend only. On a GPU host with nvcc: JAX_EP_NATIVE=1 python3 -m pip "
                    "install '.[cuda13]' (README, Install)")
            else:
                _ext["error"] = f"native extension not available ({e}{hint})"
    return _ext["module"]


def _register_targets() -> None:
    """Register every FFI target of ``_C`` with XLA for the CUDA platform, once."""
    C = _extension()
    if C is None or _ext["registered"]:
        return
    import jax

    from jaxlib import xla_client

    graph_ok = set(C.command_buffer_targets())
    for name, capsule in C.registrations().items():
        # Production targets may be captured into XLA command buffers (CUDA
        # graphs; cc/ffi_targets.h says why that is safe).
        traits = (xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
                  if name in graph_ok else xla_client.CustomCallTargetTraits.DEFAULT)
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA", traits=traits)
    _ext["registered"] = True


def extension_available() -> bool:
    return _extension() is not None


def unavailable_reason() -> str:
    """Why the native runtime is not up (empty string when it is)."""
    if _state["initialized"]:
        return ""
    if not extension_available():
        return _ext["error"] or "native extension not built (no CUDA toolkit at install time)"
    return _state["reason"]


def is_initialized() -> bool:
    return _state["initialized"]


def info() -> Optional[dict]:
    """``{my_pe, n_pes, sym_bytes, device, num_sms, ll_shape, ll_bytes,
    inter_shape, inter_bytes}`` of the live runtime, or None. ``ll_shape``:
    (E, Tmax, K, H) of the low-latency region (zeros when there is none),
    ``ll_bytes`` its size; ``inter_shape``: (nodes, ranks, T, H) of the
    internode region, ``inter_bytes`` its size."""
    C = _extension()
    return C.runtime_info() if C is not None else None


def pe_hosts() -> Optional[list]:
    """Host name of every NVSHMEM PE of the live runtime (index = PE), or None
    (no runtime, or the peer-memory transport: one process, one host)."""
    return _state["hosts"] if symmetric_memory() == "nvshmem" else None


def _kv_client():
    from jax._src import distributed

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


_USER_HEAP = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")  # as set before jax_ep came in


def _parse_size(v: Optional[str]) -> int:
    """NVSHMEM size syntax: bytes with an optional K/M/G/T suffix; 0 if unset/bad."""
    if not v:
        return 0
    v = v.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(v[-1:], 1)
    try:
        return int(float(v.rstrip("KMGT")) * mult)
    except ValueError:
        return 0


def _set_nvshmem_env(buffer_bytes: int) -> None:
    # Read by NVSHMEM at init only. Respect what the user set, except that the
    # heap must hold the buffer. (The network transports: _apply_network_env.)
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")          # no NVLink multicast
    need = -(-(buffer_bytes + _HEAP_SLACK) // _HEAP_GRANULE) * _HEAP_GRANULE
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(max(need, _parse_size(_USER_HEAP)))


_NET_VARS = ("NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA")


def _user_network_env() -> dict:
    """NVSHMEM's network variables as the user set them: a value still equal to
    what an earlier initialize set counts as unset."""
    mine = _state["net_env_set"]
    return {k: None if (k in mine and os.environ.get(k) == mine[k]) else os.environ.get(k)
            for k in _NET_VARS}


def _apply_network_env(env: dict, user: dict) -> None:
    """Set ``env`` (hosts.network_env; None: unset) where the user set nothing."""
    mine = _state["net_env_set"]
    for k, v in env.items():
        if user.get(k) is not None:
            continue
        mine.pop(k, None)
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = mine[k] = v


def _not_up(reason: str) -> bool:
    _state["reason"] = reason
    logging.getLogger("jax_ep").warning("jax_ep: native runtime not started: %s", reason)
    return False


def symmetric_memory() -> Optional[str]:
    """Where the live runtime's buffers live and how ranks reach each other's:
    ``"nvshmem"`` (the NVSHMEM symmetric heap, one GPU per process) or
    ``"peer_memory"`` (a buffer per GPU of one process, CUDA peer access); None
    when the runtime is down."""
    return _state["symmetric_memory"] if _state["initialized"] else None


def ll_shape_of(config) -> tuple:
    """(E, Tmax, K, H) of the low-latency region for an :class:`EpConfig` (or None: none)."""
    if config is None:
        return (0, 0, 0, 0)
    from .config import EpConfig

    if not isinstance(config, EpConfig):
        raise TypeError(f"jax_ep.initialize: low_latency must be an EpConfig or None, got "
                        f"{type(config).__name__}")
    return (config.num_experts, config.max_tokens_per_rank, config.topk, config.hidden)


def _config_list(config) -> list:
    """``initialize``'s ``config``: None, one EpConfig or a list / tuple of them."""
    if config is None:
        return []
    return list(config) if isinstance(config, (list, tuple)) else [config]


def _check_internode_region(config) -> None:
    """A later ``initialize(config=...)`` on a live runtime: its internode
    configs (``num_nodes > 1``, or one node per host where the job spans hosts:
    :func:`internode_shape_of`) must fit the region laid out at start (else
    their calls would fail with "pass this config to jax_ep.initialize"
    although the user did)."""
    have = tuple(int(v) for v in (info() or {}).get("inter_shape", (0, 0, 0, 0)))
    hosts = pe_hosts()
    wanted, inter = _internode_configs(_config_list(config), len(hosts or []), hosts)
    if not inter:
        return
    n, _, _, h = have
    # any T fits (calls run as windows of the region's T); nodes and hidden must
    bad = [c for c in inter if wanted != n or c.hidden > h]
    if bad:
        c = bad[0]
        raise ValueError(
            f"jax_ep.initialize(config=...): the runtime is already up with an internode region "
            f"for (nodes, ranks, T window, H) = {have} (zeros: none); this config needs "
            f"{wanted} nodes (num_nodes={c.num_nodes}"
            + (", one node per host" if c.num_nodes == 1 else "")
            + f") and hidden {c.hidden}. Call jax_ep.finalize() first")


def internode_window(region_bytes, nodes: int, ranks: int, tokens: int, hidden: int,
                     bound=None) -> int:
    """The largest W <= ``tokens`` whose internode region
    ``region_bytes(nodes, ranks, W, hidden)`` (the extension's
    ``internode_region_bytes``) fits ``bound`` (None: DEFAULT_INTERNODE_BYTES);
    a clear error when not even one token does."""
    bound = DEFAULT_INTERNODE_BYTES if bound is None else int(bound)
    if region_bytes(nodes, ranks, tokens, hidden) <= bound:
        return tokens
    if region_bytes(nodes, ranks, 1, hidden) > bound:
        raise ValueError(
            f"EpConfig.internode_bytes ({bound}) is below the internode region of one token "
            f"per window ({region_bytes(nodes, ranks, 1, hidden)} bytes at {nodes} nodes, "
            f"{ranks} ranks, hidden {hidden})")
    lo, hi = 1, tokens          # region(lo) fits, region(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if region_bytes(nodes, ranks, mid, hidden) <= bound else (lo, mid)
    return lo


def _internode_configs(configs, ranks: int, hosts) -> tuple:
    """``(N, the configs that need the internode region)``: those with
    ``num_nodes > 1`` (which must agree on N), or where none has, every config
    with one node per host when ``ranks`` cannot fit on one host
    (:func:`jax_ep.hosts.auto_nodes`); ``(0, [])`` when none needs it."""
    explicit = [c for c in configs if c.num_nodes > 1]
    if explicit:
        nodes = {c.num_nodes for c in explicit}
        if len(nodes) > 1:
            raise ValueError(f"jax_ep.initialize: configs with different num_nodes "
                             f"{sorted(nodes)}; the internode region is sized for one")
        return nodes.pop(), explicit
    auto = _hosts.auto_nodes(hosts, ranks)
    return (auto, list(configs)) if auto > 1 and configs else (0, [])


def internode_shape_of(configs, ranks: int, region_bytes=None, hosts=None) -> tuple:
    """(nodes, ranks, W, H) of the internode region for the configs given to
    :func:`initialize`, or zeros when none needs one. ``ranks``: the EP size
    initialize assumes (every process, or every GPU with peer memory; as for
    the normal buffer). Nodes: the configs' ``num_nodes`` (> 1, which must
    agree), or where none gives one, one node per host when ``ranks`` cannot
    fit on one host (``hosts``: host of each PE; :func:`_internode_configs`,
    as the native calls choose). H: the largest ``hidden``. W: the largest
    ``max_tokens_per_rank``, or fewer where the region would exceed the
    smallest ``internode_bytes`` (:func:`internode_window` with
    ``region_bytes``, the extension's ``internode_region_bytes``; None: no
    bound applied); calls of any T run on it, as windows of W tokens."""
    N, inter = _internode_configs(configs, ranks, hosts)
    if not inter:
        return (0, 0, 0, 0)
    if ranks % N != 0:
        raise ValueError(f"jax_ep.initialize: EpConfig.num_nodes ({N}) must divide the "
                         f"{ranks} EP ranks of this job")
    T, H = max(c.max_tokens_per_rank for c in inter), max(c.hidden for c in inter)
    if region_bytes is not None:
        bounds = [c.internode_bytes for c in inter if c.internode_bytes is not None]
        T = internode_window(region_bytes, N, ranks, T, H, min(bounds) if bounds else None)
    return (N, ranks, T, H)


def low_latency_region_bytes(config) -> int:
    """Bytes of the low-latency region ``initialize(low_latency=config)`` adds to
    each GPU's buffer: both call parities of ``8 * Tmax`` dispatch token rows
    (one per (source rank, token), up to 8 ranks; bf16 width, so fp8 and bf16
    rows fit; + f32 scales), an int32 info word per ``E * Tmax`` output row and
    ``Tmax * K`` combine rows (f32 width), whatever the EP size, plus one
    staging copy of what this rank may send by NVSHMEM puts
    (``EpConfig.ll_transport``): ``Tmax`` dispatch rows and ``min(E, 8 K) *
    Tmax`` combine rows. About 0.33 GB (0.30 GiB) at DeepSeek-V3 decode (E 256,
    Tmax 128, K 8, H 7168), 0.24 GB of it staging."""
    C = _extension()
    if C is None:
        raise RuntimeError("low_latency_region_bytes needs the native extension: "
                           + unavailable_reason())
    return int(C.ll_region_size(ll_shape_of(config)))


def check_device_error() -> None:
    """Raise if a jax_ep kernel has left an error (a peer timeout, a low-latency
    send out of order) since the last check; clears it.

    Every jax_ep custom call checks this word before it launches. Inside an
    XLA command buffer (CUDA graph: the low-latency ops may be captured) that
    check runs only when the graph is recorded, so a decode loop that runs
    captured steps should call this between steps (a host read of mapped
    memory, no synchronisation: call it after ``block_until_ready`` to cover
    the step just finished). No-op when the runtime is not up. With the
    peer-memory transport (one process, several GPUs, one shared word) the
    error is read and kept, as the FFI handlers keep it: every GPU's next call
    must fail, or the others would launch, spin and fall an epoch apart.
    """
    C = _extension()
    if C is None or not _state["initialized"]:
        return
    code = int(C.device_error() if _state["symmetric_memory"] == "peer_memory"
               else C.take_device_error())
    if code == 0:
        return
    what = {1: "a kernel timed out waiting for a peer rank (ranks called different ops, or a "
               "peer died)",
            2: "a low-latency send ran before the previous receive of the same op finished "
               "(sends and receives of one op must alternate on every rank)"}.get(
        code, f"kernel error {code}")
    raise RuntimeError(f"jax_ep: {what}; results since are invalid, restart the job")


def initialize(buffer_bytes: Optional[int] = None, config=None, symmetric_memory: str = "auto",
               low_latency=None) -> bool:
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
        for: the largest ``config.native_buffer_bytes(process_count)``. When
        any has ``num_nodes > 1``, an internode region is appended after the
        other regions (:func:`internode_shape_of`; added even when
        ``buffer_bytes`` is given, which sizes only the normal buffer).
      symmetric_memory: the memory every rank's kernels write into, and how
        they reach the other ranks': ``"auto"`` or ``"nvshmem"`` (the NVSHMEM
        symmetric heap, one GPU per process, any number of hosts) or
        ``"peer_memory"`` (a ``cudaMalloc`` buffer per GPU of one process and
        CUDA peer access between them; not yet validated on GPUs).
      low_latency: the decode :class:`EpConfig` (``num_experts``,
        ``max_tokens_per_rank`` = Tmax, ``topk``, ``hidden``) to lay out the
        low-latency region for (:func:`jax_ep.low_latency_dispatch` with the
        native backend needs it; calls must use that E, K, H and T <= Tmax).
        Adds :func:`low_latency_region_bytes` to each buffer. None: no region.

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
        if symmetric_memory not in ("auto", _state["symmetric_memory"]):
            raise ValueError(
                f"jax_ep.initialize(symmetric_memory={symmetric_memory!r}): the runtime is "
                f"already up with {_state['symmetric_memory']!r}; call jax_ep.finalize() first")
        want = ll_shape_of(low_latency)
        have = tuple(int(v) for v in (info() or {}).get("ll_shape", (0, 0, 0, 0)))
        if low_latency is not None and want != have:
            raise ValueError(
                f"jax_ep.initialize(low_latency=...): the runtime is already up with a "
                f"low-latency region for (E, Tmax, K, H) = {have} (zeros: none); this call asks "
                f"for {want}. Call jax_ep.finalize() first")
        _check_internode_region(config)
        return True
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
    # Every attempt, first thing: a process that returns early or raises below
    # stays in step with the others' key-value keys when it tries again.
    _state["generation"] += 1
    C = _extension()
    if C is None:
        return _not_up(unavailable_reason())
    cfgs = _config_list(config)
    ranks = 1
    if cfgs:
        import jax

        # EP ranks: the processes (one GPU each), or every GPU of this process
        ranks = max(1, (len([d for d in jax.local_devices() if d.platform == "gpu"])
                        if symmetric_memory == "peer_memory" else jax.process_count()))
    if buffer_bytes is None and cfgs:
        buffer_bytes = max(c.native_buffer_bytes(ranks) for c in cfgs)
    buffer_bytes = DEFAULT_BUFFER_BYTES if buffer_bytes is None else int(buffer_bytes)
    if buffer_bytes < 1:
        raise ValueError(f"jax_ep.initialize: buffer_bytes must be positive, got {buffer_bytes}")
    ll_shape = ll_shape_of(low_latency)
    ll_bytes = int(C.ll_region_size(ll_shape))

    import jax

    # JAX must create its GPU client (and CUDA primary context) before NVSHMEM.
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    if not gpus:
        return _not_up("no CUDA GPU visible to JAX in this process")
    if symmetric_memory == "peer_memory":   # one process: one host
        return _attach_peer_memory(C, gpus, buffer_bytes, ll_shape,
                                   internode_shape_of(cfgs, ranks, C.internode_region_bytes))
    if len(gpus) != 1:
        return _not_up(
            f"this process drives {len(gpus)} GPUs; the NVSHMEM transport needs one GPU per "
            "process (jax.distributed.initialize(..., local_device_ids=[i]) or jax-ep-launch), "
            "or opt in to the peer-memory transport (not yet validated on GPUs): "
            "jax_ep.initialize(symmetric_memory='peer_memory')")
    device = int(gpus[0].local_hardware_id)
    rank, nranks = jax.process_index(), jax.process_count()
    # Every process's host (and free GPU memory) first: the internode region's
    # node split follows the hosts (an EP group larger than a host: one node per
    # host, hosts.auto_nodes), and every process checks every process's memory.
    user_net = _user_network_env()
    values = _hosts.exchange(
        _kv_client() if nranks > 1 else None, rank, nranks, _state["generation"],
        _UID_TIMEOUT_MS, _hosts.local_value(
            user_net, 0 if _state["nvshmem_up"] else C.device_free_bytes(device), device))
    hosts, net_env = _hosts.job_network_env(values)
    inter_shape = internode_shape_of(cfgs, ranks, C.internode_region_bytes, hosts)
    inter_bytes = int(C.internode_region_bytes(*inter_shape))
    need_heap = buffer_bytes + ll_bytes + 256 + inter_bytes + 256   # regions start 256-aligned
    _register_targets()
    _set_nvshmem_env(need_heap)
    if _state["nvshmem_up"] and _state.get("heap_bytes") and need_heap > _state["heap_bytes"]:
        # NVSHMEM stayed up (JAX_EP_KEEP_NVSHMEM=1, or started by XLA): its heap
        # was sized when it started and does not grow.
        raise RuntimeError(
            f"jax_ep.initialize: buffer {buffer_bytes >> 20} MiB + low-latency region "
            f"{ll_bytes >> 20} MiB + internode region {inter_bytes >> 20} MiB exceed the NVSHMEM "
            f"symmetric heap NVSHMEM started with ({_state['heap_bytes'] >> 20} MiB); initialize "
            "the largest configuration first, or set NVSHMEM_SYMMETRIC_SIZE before the first "
            "initialize")

    if not _state["nvshmem_up"]:
        # Every process's free memory came with the hosts: the same answer on
        # every rank, so no rank is left waiting in NVSHMEM's start when this raises.
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
                f"buffer_bytes={buffer_bytes} + regions of {ll_bytes + inter_bytes} bytes) does not "
                f"fit in the {free >> 20} MiB of GPU memory process {worst} has "
                f"JAX left free{shared}; lower XLA_PYTHON_CLIENT_MEM_FRACTION (now "
                f"{os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', 'unset: 0.75')}) or set "
                "XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX starts, or pass a smaller "
                "buffer_bytes")
    if not _state["nvshmem_up"]:
        # One host: no network transport (no NIC needed). Several: NVSHMEM's
        # default plus IBGDA, unless the users chose (hosts.network_env).
        _apply_network_env(net_env, user_net)
        if C.nvshmem_status() >= 2:  # started by XLA: attach, never finalize it
            C.nvshmem_init(b"", rank, nranks, device)
            _state["owns_nvshmem"] = False
        else:
            uid = _share_unique_id(C, rank, nranks)
            _state["owns_nvshmem"] = C.nvshmem_init(uid, rank, nranks, device)
        _state["nvshmem_up"] = True
        _state["heap_bytes"] = int(os.environ["NVSHMEM_SYMMETRIC_SIZE"])
    # raises naming XLA_PYTHON_CLIENT_MEM_FRACTION
    C.runtime_attach(device, buffer_bytes, ll_shape, inter_shape)
    _state["initialized"] = True
    _state["symmetric_memory"] = "nvshmem"
    _state["hosts"] = hosts
    _state["reason"] = ""
    return True


def _attach_peer_memory(C, gpus, buffer_bytes: int, ll_shape: tuple, inter_shape: tuple) -> bool:
    """One process, several GPUs: a buffer per GPU, peer access between all."""
    import jax

    if jax.process_count() != 1:
        raise ValueError("jax_ep.initialize(symmetric_memory='peer_memory') drives the GPUs "
                         "of ONE "
                         f"process; this job has {jax.process_count()} processes (use the "
                         "NVSHMEM transport, one GPU per process)")
    _register_targets()
    # The lowering names each GPU by its CUDA ordinal (jax_ep._ffi.pe_of_device),
    # which is also XLA's device ordinal in the FFI call.
    C.peer_memory_attach([int(d.local_hardware_id) for d in gpus], buffer_bytes, ll_shape,
                         inter_shape)
    _state["initialized"] = True
    _state["symmetric_memory"] = "peer_memory"
    _state["hosts"] = None
    _state["reason"] = ""
    return True


def _keep_nvshmem() -> bool:
    # NVSHMEM_... re-init policy, see finalize().
    return os.environ.get("JAX_EP_KEEP_NVSHMEM", "0") == "1"


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
    C = _extension()
    _state["initialized"] = False
    _state["reason"] = "jax_ep.finalize() was called"
    peer = _state["symmetric_memory"] == "peer_memory"
    _state["symmetric_memory"] = None
    C.runtime_detach()
    if peer:
        return
    if _state["owns_nvshmem"] and not _keep_nvshmem():
        C.nvshmem_finalize()
        _state["nvshmem_up"] = False
        _state["owns_nvshmem"] = False


def not_initialized_message() -> str:
    C = _extension()
    if C is not None:
        return C.NOT_INITIALIZED_MESSAGE
    return ("jax_ep native runtime is not initialised in this process: call jax_ep.initialize() "
            "(after jax.distributed.initialize) before using backend='native'")


def native_backend():
    """The native backend; raises when the runtime is not up in this process."""
    if not _state["initialized"]:
        raise RuntimeError(f"{not_initialized_message()} ({unavailable_reason()})")
    from .native import BACKEND
    return BACKEND


# Targets are registered on import so that a jitted FFI call works (and fails
# with the kNotInitialized message) even before initialize().
try:
    _register_targets()
except Exception as e:  # keep `import jax_ep` working; the reason is reported later
    _ext["error"] = f"registering the FFI targets failed ({e})"
    _ext["module"] = None
