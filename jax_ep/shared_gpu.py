"""Several processes on fewer GPUs: the plan and each process's environment.

A multi-process jax_ep job normally runs one process per GPU. On a machine
with fewer GPUs than processes (one GPU, for development and tests), the
processes share the GPUs round robin. That runs every multi-process path
(NVSHMEM supports several PEs per GPU) and proves it correct; it says nothing
about speed (the processes time-slice the GPU).

What each process of such a job needs:
- its GPU through ``local_device_ids`` (``JAX_EP_LOCAL_DEVICE_IDS``);
- a host identity of its own for NCCL (``NCCL_HOSTID``): NCCL refuses two
  ranks on one GPU of one host ("Duplicate GPU detected") and, with distinct
  identities, talks over its socket transport instead (on loopback when the
  whole job is on this machine);
- a share of the GPU's memory for XLA's pool (``XLA_PYTHON_CLIENT_MEM_FRACTION``,
  :func:`fair_fraction`, unless the user set one), leaving room for each
  process's CUDA context, NVSHMEM heap and NCCL buffers outside the pool.

Used by ``jax_ep.launch`` (``--gpus``) and the GPU test harness.
"""
from __future__ import annotations

import dataclasses
import math
import subprocess
from typing import Optional

# Outside XLA's pool, per process: its CUDA context (~0.5 GiB), the NVSHMEM
# heap of the default 1 GiB buffer (1.5 GiB in 512 MiB granules) and NCCL's
# buffers. 14 processes with pools of 0.8 / 14 of a GPU left NCCL none
# ("Failed to CUDA calloc async 16 bytes").
OUTSIDE_POOL_BYTES = 3 << 30
# XLA's pools together take at most this share of a GPU, as one process alone
# would (JAX's default is 0.75), and the pools plus what lies outside them at
# most USABLE_SHARE of it.
POOL_SHARE = 0.8
USABLE_SHARE = 0.9
# Below this much pool a process cannot hold a test's arrays, let alone a model's.
MIN_POOL_BYTES = 1 << 30

SHARED_ENV = "JAX_EP_PROCS_PER_GPU"   # > 1: this process shares its GPU


class SharedGpuError(ValueError):
    """A shared-GPU plan that cannot work, with its cause and remedy."""


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """``nproc`` local processes on ``gpus`` GPUs, round robin."""
    nproc: int
    gpus: int
    mem_fraction: Optional[float] = None   # each process's pool share (None: JAX's default)

    @property
    def per_gpu(self) -> int:
        """The most processes on one GPU."""
        return math.ceil(self.nproc / self.gpus)

    @property
    def shared(self) -> bool:
        return self.per_gpu > 1

    def device_of(self, local_rank: int) -> int:
        return local_rank % self.gpus

    def notice(self) -> str:
        """The one line a shared plan prints."""
        return (f"{self.nproc} processes share {self.gpus} GPU(s) ({self.per_gpu} per GPU, "
                f"memory fraction {self.mem_fraction:.3g} each): results are checked, "
                "but timings mean nothing (the processes time-slice each GPU)")


def visible(total: int, environ) -> int:
    """Of a host's ``total`` GPUs, how many its processes see:
    ``CUDA_VISIBLE_DEVICES`` up to its first invalid entry, as CUDA reads it
    ("-1" hides the rest)."""
    shown = environ.get("CUDA_VISIBLE_DEVICES")
    if shown is None:
        return total
    n = 0
    for v in shown.split(","):
        v = v.strip()
        if not v or v.startswith("-"):
            break
        n += 1
    return min(total, n)


def gpu_memory_bytes() -> Optional[int]:
    """Total memory of the smallest visible NVIDIA GPU, from nvidia-smi (no
    CUDA context here), or None when it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        sizes = [int(float(v)) << 20 for v in out.split() if v.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) if sizes else None


def fair_fraction(per_gpu: int, gpu_bytes: Optional[int]) -> float:
    """Each process's pool share when ``per_gpu`` processes share a GPU of
    ``gpu_bytes`` (None: unknown, 0.8 / per_gpu): 0.8 / per_gpu, lowered so
    that every process's outside-pool memory fits in 0.9 of the GPU."""
    frac = POOL_SHARE / per_gpu
    if gpu_bytes:
        room = (USABLE_SHARE * gpu_bytes - per_gpu * OUTSIDE_POOL_BYTES) / (per_gpu * gpu_bytes)
        frac = min(frac, room)
    return math.floor(frac * 1000) / 1000


def plan(nproc: int, gpus: int, visible: int, *, gpu_bytes: Optional[int] = None,
         user_fraction: Optional[str] = None) -> GpuPlan:
    """The plan for ``nproc`` processes on ``gpus`` of the ``visible`` GPUs.

    ``gpu_bytes``: memory of one GPU (None: not checked). ``user_fraction``:
    ``$XLA_PYTHON_CLIENT_MEM_FRACTION`` as the user set it (kept). Raises
    :class:`SharedGpuError` for more GPUs than are visible, and for more
    processes on a GPU than its memory holds."""
    if gpus < 1:
        raise SharedGpuError(f"--gpus must be >= 1, got {gpus}")
    if gpus > visible:
        raise SharedGpuError(f"--gpus {gpus} but only {visible} GPU(s) are visible on this host "
                             "(nvidia-smi -L, CUDA_VISIBLE_DEVICES); give --gpus <= "
                             f"{visible}")
    gpus = min(gpus, nproc)
    p = GpuPlan(nproc, gpus)
    if not p.shared:
        return p
    frac = float(user_fraction) if user_fraction else fair_fraction(p.per_gpu, gpu_bytes)
    p = dataclasses.replace(p, mem_fraction=frac)
    if gpu_bytes:
        pool = frac * gpu_bytes
        need = p.per_gpu * (pool + OUTSIDE_POOL_BYTES)
        if need > USABLE_SHARE * gpu_bytes or pool < MIN_POOL_BYTES:
            raise SharedGpuError(
                f"{p.per_gpu} processes per GPU do not fit its {gpu_bytes / 2**30:.0f} GiB: each "
                f"needs its XLA pool (memory fraction {frac:.3g} = {pool / 2**30:.1f} GiB, at "
                f"least {MIN_POOL_BYTES >> 30} GiB) plus about {OUTSIDE_POOL_BYTES >> 30} GiB "
                f"outside it (CUDA context, NVSHMEM heap), {need / 2**30:.0f} GiB in all; run "
                "fewer processes per GPU (-n, --gpus)"
                + (" or a lower XLA_PYTHON_CLIENT_MEM_FRACTION" if user_fraction else ""))
    return p


def process_env(p: GpuPlan, local_rank: int, process_id: int, host: str,
                loopback: bool) -> dict:
    """The variables process ``process_id`` (``local_rank`` on this host)
    needs under plan ``p``. ``host``: this host's identity (NCCL's is made
    from it); ``loopback``: the whole job runs on this machine (NCCL's
    sockets on ``lo``). :func:`apply` merges them into an environment,
    keeping the user's NCCL interface / IB settings."""
    env = {"JAX_EP_LOCAL_DEVICE_IDS": str(p.device_of(local_rank))}
    if not p.shared:
        return env
    env.update({
        SHARED_ENV: str(p.per_gpu),
        "NCCL_HOSTID": f"{host}-jax_ep-p{process_id}",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{p.mem_fraction:.4g}",
    })
    if loopback:
        env.update({"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"})
    return env


def apply(env: dict, p: GpuPlan, local_rank: int, process_id: int, host: str,
          loopback: bool) -> dict:
    """``env`` with :func:`process_env` merged in; the user's own NCCL
    interface / IB settings are kept."""
    out = dict(env)
    for k, v in process_env(p, local_rank, process_id, host, loopback).items():
        if k in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE") and k in env:
            continue
        out[k] = v
    return out


def processes_per_gpu(environ) -> int:
    """How many processes share this process's GPU (1: none), from its environment."""
    try:
        return max(1, int(environ.get(SHARED_ENV, "1")))
    except ValueError:
        return 1
