"""Which host each NVSHMEM PE runs on, and what follows from it.

- ``initialize`` learns every process's host (:func:`host_id`) and network
  variables through JAX's key-value store (:func:`exchange`) before NVSHMEM
  starts, and sets NVSHMEM's network
  transports from it (:func:`network_env`): ``none`` on one host (no NIC
  needed); across hosts NVSHMEM's default remote transport plus IBGDA
  (GPU-initiated RDMA). A setting that leaves no network transport across
  hosts is a clear error there.
- When a native call is traced with ``EpConfig.num_nodes == 1``, an EP group
  with more ranks than a host has PEs takes the hierarchical kernels with one
  node per host (:func:`auto_nodes`; ``jax_ep.initialize(config=...)`` lays
  out their region the same way).
- When a native call is lowered, :func:`check_ep_groups` refuses an EP group
  the kernels cannot reach: the intranode kernels need NVLink (CUDA P2P)
  between every pair of ranks, so a group spanning hosts needs
  ``EpConfig(num_nodes=...)`` (the hierarchical kernels), and each of their
  node blocks must sit on one host. The low-latency kernels put to PEs they
  cannot map, so any group works for them.

Multi-host setup (launch, NVSHMEM's IBGDA environment): ``docs/multihost.md``.
"""
from __future__ import annotations

import json
import os
import socket
from typing import Mapping, Optional, Sequence

import numpy as np

_INTERNODE_PREFIX = "jax_ep_internode_"
_ANY_PEER_PREFIX = "jax_ep_ll_"     # puts to unmapped PEs: no host constraint


def machine_id() -> str:
    """The machine this process runs on: the host name and the kernel's boot
    id (as NCCL's host hash: two machines that share a host name differ)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = ""
    return socket.gethostname() + (f"/{boot}" if boot else "")


def host_id() -> str:
    """This process's host: ``$JAX_EP_HOST_ID`` if set, else :func:`machine_id`.
    Containers of one machine with their own host names can name one host
    with ``JAX_EP_HOST_ID`` (as ``NCCL_HOSTID``); launchers on one machine
    with distinct ids (``jax-ep-launch --host-id``) rehearse a multi-host job:
    the EP group splits one node per host, while NVSHMEM's transports follow
    the machines (:func:`job_network_env`)."""
    return os.environ.get("JAX_EP_HOST_ID") or machine_id()


def require_client(client):
    """JAX's distributed key-value client, or a clear error where there is none
    (several processes need ``jax.distributed.initialize()`` first)."""
    if client is None:
        raise RuntimeError("jax_ep.initialize: several processes but no jax.distributed client; "
                           "call jax.distributed.initialize() first")
    return client


def exchange(client, rank: int, nranks: int, generation: int, timeout_ms: int,
             value: str) -> list:
    """Every process's ``value`` (list index = process index = NVSHMEM PE).

    Collective over the job's processes; ``client`` is JAX's distributed
    key-value client (unused when ``nranks == 1``). A process that never
    arrives (it failed, or returned early from ``initialize``) ends in a clear
    error after ``timeout_ms``, not a bare key-value timeout."""
    if nranks == 1:
        return [value]
    require_client(client)
    prefix = f"jax_ep/host/{generation}/"
    client.key_value_set(prefix + str(rank), value)
    out = []
    for r in range(nranks):
        if r == rank:
            out.append(value)
            continue
        try:
            out.append(str(client.blocking_key_value_get(prefix + str(r), timeout_ms)))
        except Exception as e:  # noqa: BLE001 -- the client's timeout error type varies
            raise RuntimeError(
                f"jax_ep.initialize: process {r} did not reach jax_ep.initialize's host exchange "
                f"within {timeout_ms / 1000:.0f} s (it failed or returned early from "
                f"jax_ep.initialize: see its log; every process must call it)") from e
    return out


def job_network_env(values: Sequence[str]) -> tuple:
    """``(hosts, network settings)`` from every process's exchanged ``value``
    (:func:`local_value`); the users' network variables must agree between
    processes, or every process raises alike."""
    rows = [json.loads(v) for v in values]
    hosts = [r["host"] for r in rows]
    machines = [r.get("machine", r["host"]) for r in rows]
    nets = [r["net"] for r in rows]
    if any(n != nets[0] for n in nets):
        diff = sorted({json.dumps(n, sort_keys=True) for n in nets})
        raise RuntimeError("jax_ep.initialize: NVSHMEM's network variables differ between "
                           f"processes ({'; '.join(diff[:3])}); set them alike on every process")
    return hosts, network_env(machines, nets[0])


def local_value(user_net: Mapping[str, Optional[str]], free_bytes: int = 0,
                device: int = 0) -> str:
    """What this process contributes to :func:`exchange`: its host and
    machine, the network variables its user set, its GPU and that GPU's free bytes."""
    return json.dumps({"host": host_id(), "machine": machine_id(), "net": dict(user_net),
                       "free": int(free_bytes), "device": int(device)}, sort_keys=True)


def gpu_sharing(values: Sequence[str]) -> list:
    """``[(free bytes, processes on that GPU)]`` per process from the exchanged
    ``values``: processes of one machine on one device share its free memory,
    the least any of them saw (each read it at its own time)."""
    rows = [json.loads(v) for v in values]
    keys = [(r.get("machine", r["host"]), r.get("device", 0)) for r in rows]
    least = {}
    for r, k in zip(rows, keys):
        least[k] = min(least.get(k, int(r.get("free", 0))), int(r.get("free", 0)))
    return [(least[k], keys.count(k)) for k in keys]


def network_env(hosts: Sequence[str], user: Mapping[str, Optional[str]]) -> dict:
    """NVSHMEM's network settings for a job on ``hosts``: ``{variable: value}``
    to set before NVSHMEM starts (None: unset). ``user``: what the user set
    before jax_ep came in (``NVSHMEM_REMOTE_TRANSPORT``,
    ``NVSHMEM_IB_ENABLE_IBGDA``; None when unset), always kept.

    One host: ``NVSHMEM_REMOTE_TRANSPORT=none`` (no NIC needed). Several:
    NVSHMEM's default remote transport plus IBGDA (``NVSHMEM_IB_ENABLE_IBGDA=1``:
    the kernels' puts are GPU-initiated; with ``none`` IBGDA alone reaches the
    other hosts). ``none`` without IBGDA across hosts leaves no network
    transport: a clear error, raised on every process alike."""
    remote = user.get("NVSHMEM_REMOTE_TRANSPORT")
    ibgda = user.get("NVSHMEM_IB_ENABLE_IBGDA")
    distinct = sorted(set(hosts))
    if len(distinct) <= 1:
        return {"NVSHMEM_REMOTE_TRANSPORT": "none" if remote is None else remote,
                "NVSHMEM_IB_ENABLE_IBGDA": ibgda}
    ibgda = "1" if ibgda is None else ibgda
    if (remote is not None and remote.strip().lower() == "none"
            and ibgda.strip().lower() not in ("1", "true", "yes", "y", "t", "on")):
        raise RuntimeError(
            f"jax_ep.initialize: the job's {len(hosts)} processes run on {len(distinct)} hosts "
            f"({_names(distinct)}) but NVSHMEM_REMOTE_TRANSPORT=none with IBGDA off "
            f"(NVSHMEM_IB_ENABLE_IBGDA={ibgda}) gives NVSHMEM no network transport; unset "
            "NVSHMEM_REMOTE_TRANSPORT or enable IBGDA (docs/multihost.md)")
    return {"NVSHMEM_REMOTE_TRANSPORT": remote, "NVSHMEM_IB_ENABLE_IBGDA": ibgda}


def check_ep_groups(target: str, groups: np.ndarray, hosts: Optional[Sequence[str]],
                    nodes: Optional[int], axis_name: str) -> None:
    """Raise a clear error when an EP group (``groups [G, R]`` of PEs) of
    ``target`` spans hosts in a way its kernels cannot reach (see the module
    docstring). ``hosts``: host of each PE (None or one host: nothing to check)."""
    if not hosts or len(set(hosts)) <= 1 or target.startswith(_ANY_PEER_PREFIX):
        return
    for row in np.asarray(groups):
        hs = [hosts[int(p)] for p in row]
        if target.startswith(_INTERNODE_PREFIX):
            n = int(nodes or 1)
            per = len(hs) // max(n, 1)
            for b in range(n):
                block = hs[b * per:(b + 1) * per]
                if len(set(block)) > 1:
                    raise ValueError(
                        f"jax_ep: EpConfig(num_nodes={n}) makes ranks {b * per}..{(b + 1) * per - 1} "
                        f"of the EP group along {axis_name!r} one node, but they run on hosts "
                        f"{_names(sorted(set(block)))}: a node's ranks must share a host (NVLink "
                        f"leg). The group's ranks by host: {_layout(hs)}")
        elif len(set(hs)) > 1:
            per_host = _runs(hs)
            hint = (f"EpConfig(num_nodes={len(per_host)})" if len(per_host) == len(set(hs))
                    and len({c for _, c in per_host}) == 1 else
                    "EpConfig(num_nodes=...) with the ranks of each host contiguous and equal "
                    "in number along the axis")
            raise ValueError(
                f"jax_ep: the EP group along {axis_name!r} spans {len(set(hs))} hosts "
                f"({_layout(hs)}), and the intranode kernels need NVLink between every pair of "
                f"ranks; use the hierarchical kernels: {hint} (docs/multihost.md)")


def auto_nodes(hosts: Optional[Sequence[str]], num_ranks: int) -> int:
    """Nodes for the hierarchical kernels when ``EpConfig.num_nodes`` is 1:
    one per host when an EP group of ``num_ranks`` ranks cannot fit on one
    host (more ranks than a host has PEs), else 1. ``hosts``: host of each
    PE (None or one host: 1). Needs the job's PEs laid out as hosts of equally
    many consecutive PEs (what the launcher and SLURM give), else 1 and the
    lowering's check names what does not fit."""
    if not hosts or len(set(hosts)) <= 1:
        return 1
    runs = _runs(list(hosts))
    per = runs[0][1]
    if len(runs) != len(set(hosts)) or any(c != per for _, c in runs):
        return 1
    if num_ranks > per and num_ranks % per == 0:
        return num_ranks // per
    return 1


def _runs(hs):
    """[(host, count)] of consecutive equal entries."""
    out = []
    for h in hs:
        if out and out[-1][0] == h:
            out[-1] = (h, out[-1][1] + 1)
        else:
            out.append((h, 1))
    return out


def _layout(hs) -> str:
    return ", ".join(f"{h} x{c}" for h, c in _runs(hs))


def _names(distinct) -> str:
    return ", ".join(distinct[:4]) + (", ..." if len(distinct) > 4 else "")
