"""Start the processes of a multi-process jax_ep job: one per GPU, several per
GPU when there are fewer GPUs than processes, or one per CPU.

An NVSHMEM PE is an OS process driving one GPU, so the native backend runs as
a multi-process JAX job (``jax.distributed``). This module is both the launcher
and the helper the launched script calls.

Launcher (one node)::

    python -m jax_ep.launch -n 2 examples/train_moe.py --backend native
    jax-ep-launch -n 2 examples/train_moe.py --backend native     # same
    python -m jax_ep.launch -n 2 --platform cpu my_script.py      # CPU + gloo
    python -m jax_ep.launch -n 2 -m my_package.my_module --flag   # a module

It starts N copies of ``python script.py args`` (or ``python -m module``),
prefixes every output line with ``[rank i]``, forwards SIGINT/SIGTERM to all of
them, and when one exits non-zero, terminates the others (SIGTERM, then SIGKILL
after ``--grace`` seconds) and exits non-zero naming that rank and its exit
code. Each child runs in its own process group, and the whole group is
signalled, so nothing is left behind.

Environment each child gets::

    JAX_EP_COORDINATOR      host:port of the jax.distributed coordinator
                            (process 0's host; a free local port on one node)
    JAX_EP_NUM_PROCESSES    total processes (all nodes)
    JAX_EP_PROCESS_ID       global process index (node_rank * n + local_rank)
    JAX_EP_LOCAL_RANK       index of the process on its node
    JAX_EP_LOCAL_DEVICE_IDS the device(s) this process drives ("1"); all GPUs
                            stay visible (no CUDA_VISIBLE_DEVICES), JAX is told
                            to use only this one via ``local_device_ids``
    JAX_EP_PROCS_PER_GPU, NCCL_HOSTID, XLA_PYTHON_CLIENT_MEM_FRACTION
                            only when processes share a GPU (see above)
    JAX_EP_HOST_ID          with --host-id
    JAX_EP_PLATFORM         "gpu" or "cpu"
    NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1   (never NVLink multicast)
    PYTHONUNBUFFERED=1
    CPU only: JAX_PLATFORMS=cpu and XLA_FLAGS with
              --xla_force_host_platform_device_count=<--cpu-devices, default 1>

Script side: call :func:`init_distributed` first, before anything touches a
JAX device::

    from jax_ep.launch import init_distributed
    info = init_distributed(native=True)   # jax.distributed + jax_ep.initialize()

Multi-host. Either run the launcher on every node with the same
``--coordinator`` (process 0's node, any free port), ``--nnodes`` and that
node's ``--node-rank``::

    node0$ python -m jax_ep.launch -n 8 --nnodes 2 --node-rank 0 --coordinator node0:29500 train.py
    node1$ python -m jax_ep.launch -n 8 --nnodes 2 --node-rank 1 --coordinator node0:29500 train.py

(``--coordinator`` defaults to ``$JAX_EP_COORDINATOR``, else
``$MASTER_ADDR:$MASTER_PORT``.) ``--host-id NAME`` gives a node's processes
that host identity (``JAX_EP_HOST_ID``, and NCCL's from it): two launchers on
one machine with ``--host-id node0`` / ``node1`` rehearse a two-host job
(jax_ep splits the EP group one node per host; NVSHMEM still maps every PE,
they share one machine).

Fewer GPUs than processes (``--gpus G``, default every visible GPU; one GPU
for development and tests): the N processes share the G GPUs round robin
(``jax_ep.shared_gpu``): each gets its GPU (``local_rank % G``), a host
identity of its own for NCCL (``NCCL_HOSTID``: NCCL then uses its socket
transport) and a fair share of the GPU's memory
(``XLA_PYTHON_CLIENT_MEM_FRACTION``, ``shared_gpu.fair_fraction``, unless
set), and the launcher prints one line saying so: every path runs and is
checked, timings mean nothing. It refuses a G above the visible GPUs and more
processes per GPU than its memory holds::

    python -m jax_ep.launch -n 8 examples/train_moe.py --backend native   # 1 GPU: 8 share it

Or skip the launcher under SLURM (``srun --ntasks-per-node=<gpus> python train.py``): :func:`init_distributed`
then reads, in this order of precedence:

* ``JAX_EP_NUM_PROCESSES`` / ``JAX_EP_PROCESS_ID`` / ``JAX_EP_LOCAL_RANK`` /
  ``JAX_EP_LOCAL_DEVICE_IDS`` / ``JAX_EP_COORDINATOR`` (set by this launcher), else
* inside an ``srun`` step (``SLURM_STEP_ID`` set): ``SLURM_STEP_NUM_TASKS``
  (processes), ``SLURM_PROCID`` (process id),
  ``SLURM_LOCALID`` (local rank = the GPU it drives), and the coordinator from
  ``JAX_EP_COORDINATOR`` or ``MASTER_ADDR`` + ``MASTER_PORT``; when neither is
  set, JAX's own SLURM detection picks the first node of the job.

With none of these set (a plain ``python script.py``) it does nothing to
``jax.distributed`` (single process, JAX's default device layout).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence

import jax

from . import hosts, runtime, shared_gpu

__all__ = ["main", "init_distributed", "DistributedInfo", "free_port", "child_env"]

_PREFIX = "jax_ep.launch"


# --------------------------------------------------------------------------- helpers


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` and on the wildcard
    addresses (JAX's coordination service listens on ``[::]`` and ``0.0.0.0``:
    a port free on 127.0.0.1 alone can still be taken there)."""
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            port = s.getsockname()[1]
        if _bindable(socket.AF_INET, "0.0.0.0", port) and _bindable(socket.AF_INET6, "::", port):
            return port
    return port


def _bindable(family, host: str, port: int) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return True
    except OSError as e:
        # no IPv6 on this host: nothing can hold the port there
        return family == socket.AF_INET6 and e.errno in (97, 99)  # EAFNOSUPPORT, EADDRNOTAVAIL


def _detect_gpus() -> int:
    """Number of NVIDIA GPUs on this host, without importing jax."""
    return len([p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)])


def _visible_gpus() -> int:
    """GPUs this host shows its processes (``CUDA_VISIBLE_DEVICES`` honoured)."""
    return shared_gpu.visible(_detect_gpus(), os.environ)


def _cpu_xla_flags(flags: str, devices: int) -> str:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", flags or "")
    return (" ".join(flags.split()) + f" --xla_force_host_platform_device_count={devices}").strip()


def _loopback(coordinator: str) -> bool:
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def child_env(base: dict, *, local_rank: int, nproc: int, node_rank: int, nnodes: int,
              coordinator: str, platform: str, cpu_devices: int = 1,
              gpu_plan: Optional[shared_gpu.GpuPlan] = None,
              host_id: Optional[str] = None) -> dict:
    """The environment of local process ``local_rank`` (see the module docstring).
    ``gpu_plan``: how the node's processes use its GPUs (None: one each)."""
    env = dict(base)
    if host_id:
        env["JAX_EP_HOST_ID"] = host_id
    env.update({
        "JAX_EP_COORDINATOR": coordinator,
        "JAX_EP_NUM_PROCESSES": str(nproc * nnodes),
        "JAX_EP_PROCESS_ID": str(node_rank * nproc + local_rank),
        "JAX_EP_LOCAL_RANK": str(local_rank),
        "JAX_EP_PLATFORM": platform,
        "NCCL_NVLS_ENABLE": "0",
        "NVSHMEM_DISABLE_NVLS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    if platform == "cpu":
        env["JAX_EP_LOCAL_DEVICE_IDS"] = ",".join(str(j) for j in range(cpu_devices))
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = _cpu_xla_flags(env.get("XLA_FLAGS", ""), cpu_devices)
    else:
        env = shared_gpu.apply(env, gpu_plan or shared_gpu.GpuPlan(nproc, nproc), local_rank,
                               node_rank * nproc + local_rank, host_id or hosts.host_id(),
                               loopback=_loopback(coordinator))
    return env


class _Child:
    def __init__(self, rank: int, cmd: List[str], env: dict, out_lock: threading.Lock):
        self.rank = rank
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        self.threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout, out_lock),
                             daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr, out_lock),
                             daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _pump(self, src, dst, lock):
        prefix = f"[rank {self.rank}] "
        for raw in iter(src.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            if not line.endswith("\n"):
                line += "\n"
            with lock:
                try:
                    dst.write(prefix + line)
                    dst.flush()
                except (BrokenPipeError, ValueError):
                    pass
        src.close()

    def signal_group(self, sig: int) -> None:
        if self.proc.poll() is not None and sig != signal.SIGKILL:
            return
        try:
            os.killpg(self.proc.pid, sig)  # its own session: pid == pgid
        except (ProcessLookupError, PermissionError):
            pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _log(msg: str) -> None:
    sys.stderr.write(f"{_PREFIX}: {msg}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- launcher


def _parse(argv: Optional[Sequence[str]]):
    p = argparse.ArgumentParser(
        prog="python -m jax_ep.launch",
        description="Run N local processes of a jax_ep script (one GPU each, or sharing the "
                    "GPUs when there are fewer). The script must call "
                    "jax_ep.launch.init_distributed() (native=True for the native backend) "
                    "before anything touches a JAX device: it reads the JAX_EP_* variables "
                    "this launcher sets.",
        epilog="Everything after the script (or -m module) is passed to it unchanged.")
    p.add_argument("-n", "--nproc", type=int, default=None,
                   help="processes on this node (default: number of GPUs, or 2 on CPU)")
    p.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto",
                   help="gpu: one GPU per process via local_device_ids; cpu: JAX_PLATFORMS=cpu, "
                        "gloo collectives (default auto: gpu when /dev/nvidia* exist)")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs to use on this node (default: every visible one); fewer than -n: "
                        "the processes share them round robin (correctness only, not speed)")
    p.add_argument("--host-id", default=None,
                   help="this node's host identity (JAX_EP_HOST_ID, NCCL's from it): "
                        "launchers on one machine with distinct ids rehearse a multi-host job")
    p.add_argument("--cpu-devices", type=int, default=1,
                   help="CPU devices per process with --platform cpu (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--coordinator", default=None,
                   help="host:port of the coordinator (process 0). Default: $JAX_EP_COORDINATOR, "
                        "else $MASTER_ADDR:$MASTER_PORT, else a free local port (one node)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("-m", dest="module", default=None, help="run a module (like python -m)")
    p.add_argument("script", nargs="?", help="the Python script to run")
    p.add_argument("args", nargs="*", help="its arguments")
    # Like python itself: everything after the script or `-m module` belongs to
    # the child, even options that look like the launcher's own.
    argv = list(sys.argv[1:] if argv is None else argv)
    valued = {a for act in p._actions if act.nargs is None and act.option_strings
              for a in act.option_strings if a != "-m"}
    own, module, script, rest, i = [], None, None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            if i + 1 >= len(argv):
                p.error("-m needs a module name")
            module, rest = argv[i + 1], argv[i + 2:]
            break
        if a.startswith("-") and a != "-":
            take = 2 if (a in valued and "=" not in a) else 1
            own += argv[i:i + take]
            i += take
            continue
        script, rest = a, argv[i + 1:]
        break
    ns = p.parse_args(own)
    ns.module, ns.script, ns.args = module, script, rest
    if ns.module is None and ns.script is None:
        p.error("give a script (or -m module) to run")
    return p, ns


def _resolve(parser, ns):
    """-> (platform, processes on this node, coordinator address, child command)."""
    platform = ns.platform
    if platform == "auto":
        platform = "gpu" if _detect_gpus() > 0 else "cpu"
    nproc = ns.nproc
    if nproc is None:
        nproc = _detect_gpus() if platform == "gpu" else 2
    if nproc < 1:
        parser.error("-n must be >= 1")
    gpu_plan = None
    if platform == "gpu":
        visible = _visible_gpus()
        if visible == 0:
            parser.error("--platform gpu but no NVIDIA GPU is visible on this host")
        try:
            gpu_plan = shared_gpu.plan(
                nproc, ns.gpus if ns.gpus is not None else visible, visible,
                gpu_bytes=shared_gpu.gpu_memory_bytes() if nproc > visible or ns.gpus else None,
                user_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))
        except shared_gpu.SharedGpuError as e:
            parser.error(str(e))
    elif ns.gpus is not None:
        parser.error("--gpus needs --platform gpu")
    if ns.nnodes < 1 or not 0 <= ns.node_rank < ns.nnodes:
        parser.error("need nnodes >= 1 and 0 <= node-rank < nnodes")

    coordinator = ns.coordinator or os.environ.get("JAX_EP_COORDINATOR")
    if not coordinator and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        coordinator = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if not coordinator:
        if ns.nnodes > 1:
            parser.error("--nnodes > 1 needs --coordinator host:port (process 0's node)")
        coordinator = f"127.0.0.1:{free_port()}"

    if ns.module is not None:
        cmd = [sys.executable, "-u", "-m", ns.module] + list(ns.args)
    else:
        cmd = [sys.executable, "-u", ns.script] + list(ns.args)
    return platform, nproc, coordinator, cmd, gpu_plan


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m jax_ep.launch`` and ``jax-ep-launch``; returns the exit code."""
    parser, ns = _parse(argv)
    platform, nproc, coordinator, cmd, gpu_plan = _resolve(parser, ns)

    out_lock = threading.Lock()
    children: List[_Child] = []
    stop = {"sig": None}

    def on_signal(sig, _frame):
        if stop["sig"] is None:
            stop["sig"] = sig
            for c in children:
                c.signal_group(sig)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    failure = None  # (rank, code)
    deadline = None
    try:
        _log(f"{nproc} process(es) on {platform}, coordinator {coordinator}: "
             f"{' '.join(shlex.quote(c) for c in cmd)}")
        if gpu_plan is not None and gpu_plan.shared:
            _log(gpu_plan.notice())
        base = dict(os.environ)
        for i in range(nproc):
            env = child_env(base, local_rank=i, nproc=nproc, node_rank=ns.node_rank,
                            nnodes=ns.nnodes, coordinator=coordinator, platform=platform,
                            cpu_devices=ns.cpu_devices, gpu_plan=gpu_plan,
                            host_id=ns.host_id)
            children.append(_Child(ns.node_rank * nproc + i, cmd, env, out_lock))

        while True:
            codes = [c.proc.poll() for c in children]
            if failure is None and stop["sig"] is None:
                for c, code in zip(children, codes):
                    if code is not None and code != 0:
                        failure = (c.rank, code)
                        if not all(k is not None for k in codes):
                            _log(f"rank {c.rank} {_describe(code)}; terminating the other ranks")
                            for o in children:
                                o.signal_group(signal.SIGTERM)
                            deadline = time.monotonic() + ns.grace
                        break
            if all(code is not None for code in codes):
                break
            if stop["sig"] is not None and deadline is None:
                deadline = time.monotonic() + ns.grace
            if deadline is not None and time.monotonic() > deadline:
                for c in children:
                    if c.proc.poll() is None:
                        _log(f"rank {c.rank} still running after {ns.grace:g}s; killing it")
                    c.signal_group(signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.02)
    finally:
        for c in children:  # no orphans: kill anything left in the children's groups
            c.signal_group(signal.SIGKILL)
        for c in children:
            try:
                c.proc.wait(timeout=ns.grace + 5)
            except subprocess.TimeoutExpired:
                pass
            for t in c.threads:
                t.join(timeout=2)
        for s, h in old.items():
            signal.signal(s, h)

    if stop["sig"] is not None:
        name = signal.Signals(stop["sig"]).name
        _log(f"stopped by {name}")
        return 128 + int(stop["sig"])
    if failure is not None:
        rank, code = failure
        _log(f"FAILED: rank {rank} {_describe(code)}")
        return code if 0 < code < 256 else 1
    return 0


# --------------------------------------------------------------------------- script side


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    """What :func:`init_distributed` found and did."""
    process_id: int = 0
    num_processes: int = 1
    local_rank: int = 0
    coordinator: Optional[str] = None
    platform: Optional[str] = None
    local_device_ids: Optional[tuple] = None
    distributed: bool = False   # jax.distributed.initialize was called
    native: bool = False        # the jax_ep native runtime is up
    procs_per_gpu: int = 1      # > 1: processes share this GPU (timings mean nothing)


_INFO: Optional[DistributedInfo] = None


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def init_distributed(native: bool = False, platform: Optional[str] = None,
                     initialization_timeout: int = 300, **native_kwargs) -> DistributedInfo:
    """Join the multi-process job described by the environment, once.

    Reads the launcher's ``JAX_EP_*`` variables, else SLURM's (see the module
    docstring); calls ``jax.distributed.initialize`` with
    ``local_device_ids`` from ``$JAX_EP_LOCAL_DEVICE_IDS`` on GPUs (the
    launcher's round robin when processes share GPUs; on CPU it first selects the gloo
    collectives), and then ``jax_ep.initialize()`` when ``native``. A plain
    single process is left alone (``jax_ep.initialize()`` is still called when
    ``native``). Call it before anything creates JAX devices. Idempotent.

    Args:
      native: also initialise the jax_ep native runtime (NVSHMEM);
        ``info.native`` says whether it came up (``jax_ep.initialize`` prints
        why not). ``native_kwargs`` (e.g. ``buffer_bytes``) go to it.
      platform: "gpu" or "cpu"; default ``$JAX_EP_PLATFORM``, else cpu when
        ``$JAX_PLATFORMS`` is "cpu", else gpu.
    """
    global _INFO
    if _INFO is not None:
        if native and not _INFO.native:
            _INFO = dataclasses.replace(_INFO, native=_start_native(native_kwargs))
        return _INFO

    num = _env_int("JAX_EP_NUM_PROCESSES")
    if num is not None:
        pid = _env_int("JAX_EP_PROCESS_ID") or 0
        local = _env_int("JAX_EP_LOCAL_RANK")
        coord = os.environ.get("JAX_EP_COORDINATOR")
        ids = os.environ.get("JAX_EP_LOCAL_DEVICE_IDS")
        if local is None:
            local = int(ids.split(",")[0]) if ids else 0
        ids = tuple(int(i) for i in ids.split(",")) if ids else (local,)
    elif _env_int("SLURM_STEP_ID") is not None and _env_int("SLURM_STEP_NUM_TASKS") is not None:
        # inside an srun step (a bare `python x.py` in an sbatch script is one process)
        num = _env_int("SLURM_STEP_NUM_TASKS")
        pid = _env_int("SLURM_PROCID") or 0
        local = _env_int("SLURM_LOCALID") or 0
        coord = os.environ.get("JAX_EP_COORDINATOR")
        if not coord and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            coord = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        ids = (local,)
    else:
        num, pid, local, coord, ids = 1, 0, 0, None, None

    if platform is None:
        platform = os.environ.get("JAX_EP_PLATFORM")
    if platform is None:
        platform = "cpu" if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu" else "gpu"

    distributed = False
    if num > 1:
        kwargs = dict(num_processes=num, process_id=pid,
                      initialization_timeout=initialization_timeout)
        if coord:
            kwargs["coordinator_address"] = coord
        if platform == "cpu":
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        else:
            kwargs["local_device_ids"] = list(ids)
        jax.distributed.initialize(**kwargs)
        distributed = True

    native = _start_native(native_kwargs) if native else False

    _INFO = DistributedInfo(process_id=pid, num_processes=num, local_rank=local,
                            coordinator=coord, platform=platform,
                            local_device_ids=tuple(ids) if ids else None,
                            distributed=distributed, native=native,
                            procs_per_gpu=shared_gpu.processes_per_gpu(os.environ))
    return _INFO


def _start_native(kwargs) -> bool:
    ok = runtime.initialize(**kwargs)
    return bool(ok) if ok is not None else bool(runtime.is_initialized())


if __name__ == "__main__":
    sys.exit(main())
