"""Run a worker function as an N-process JAX job on this machine's GPUs.

    from harness import run, nprocs
    results = run("test_runtime:_layout_worker", n=nprocs(), kwargs={...})

With at least N GPUs each process drives one; with fewer, the N processes
share them round robin (jax_ep.shared_gpu, as ``jax-ep-launch --gpus``):
every multi-process test runs on one GPU, correctness only. Each child
process (``python harness.py ...``) does
``jax.distributed.initialize("127.0.0.1:<port>", num_processes=n,
process_id=i, local_device_ids=[its GPU])`` (skipped for ``distributed=False``, a
plain single process), then, per request, ``jax_ep.initialize()`` when the
runtime is down (unless ``init_native=False``) and ``worker(rank, n, **kwargs)``, and writes its
JSON-serialisable return value back. ``run`` returns the list of results in
rank order, or fails the test with every rank's output when a rank exits
non-zero, times out or returns nothing. The parent itself only runs the
single-GPU grouped-matmul tests, without preallocating (conftest.py).

Each job's ranks serve requests (worker calls) until told to quit: one per
job, or with ``$JAX_EP_TEST_WARM=1`` as many as the tests of one shape send
(:func:`warm_jobs`; ``run(..., fresh=True)`` for a worker that leaves the
runtime unusable). Number of processes: ``nprocs()`` = ``$JAX_EP_TEST_NPROCS``
(default 2).
Memory: one GPU each, ``XLA_PYTHON_CLIENT_MEM_FRACTION`` 0.6; shared,
``shared_gpu.fair_fraction``, or ``$XLA_PYTHON_CLIENT_MEM_FRACTION`` when set
(several test sessions on one GPU at once give each its share).
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def nprocs() -> int:
    return int(os.environ.get("JAX_EP_TEST_NPROCS", "2"))


def gpu_count() -> int:
    """CUDA GPUs this process may use (``CUDA_VISIBLE_DEVICES`` honoured),
    counted without creating a CUDA context here."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    from jax_ep import shared_gpu

    return shared_gpu.visible(sum(1 for line in out.stdout.splitlines()
                                  if line.startswith("GPU ")), os.environ)


def skip_reason(gpus_in_one_process: int = 1) -> Optional[str]:
    """Why a GPU job cannot run here (None when it can). Processes share GPUs
    when there are fewer than they, so only a test whose one process drives
    several GPUs (``gpus_in_one_process``) needs more than one."""
    g = gpu_count()
    if g == 0:
        return "no CUDA GPU here (the GPU suite: scripts/gpu_check.sh on a GPU machine)"
    if g < gpus_in_one_process:
        return (f"one process driving {gpus_in_one_process} GPUs needs as many CUDA GPUs, "
                f"found {g}")
    from jax_ep import runtime

    if not runtime.extension_available():
        return runtime.unavailable_reason()
    return None


def testing_skip_reason() -> Optional[str]:
    """Why the test build's helpers (cc/testing: loopback, ping, output
    poisoning) are missing (None when built, or when there is no extension:
    :func:`skip_reason` says that)."""
    from jax_ep import extension

    C = extension.load()
    if C is not None and not getattr(C, "TESTING", False):
        return ("needs the test build of jax_ep (cc/testing): JAX_EP_TESTING=1 python3 -m pip "
                "install . (as scripts/gpu_check.sh builds it)")
    return None


def _free_port() -> int:
    from jax_ep.launch import free_port

    return free_port()


def gpu_plan(n: int):
    """How a job of ``n`` processes uses this machine's GPUs (jax_ep.shared_gpu)."""
    from jax_ep import shared_gpu

    g = max(1, gpu_count())
    return shared_gpu.plan(n, min(n, g), g, gpu_bytes=shared_gpu.gpu_memory_bytes(),
                           user_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))


def launch_env(paths=(ROOT,)) -> dict:
    """The environment of a GPU process started from a test (a job's rank, or
    ``jax-ep-launch``): ``paths`` (default this tree) importable, the CPU
    suite's settings (``JAX_PLATFORMS=cpu``, fake host devices) and the
    parent's allocator (conftest.py) removed, never NVLink multicast."""
    env = dict(os.environ)
    env.update(NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")
    for k in ("JAX_PLATFORMS", "XLA_FLAGS"):
        env.pop(k, None)
    if env.pop("_JAX_EP_PARENT_ALLOCATOR", None):
        env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
        env.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
    env["PYTHONPATH"] = os.pathsep.join(
        list(paths) + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _child_env(extra: Optional[dict], plan, rank: int) -> dict:
    from jax_ep import shared_gpu

    env = launch_env((HERE, ROOT))
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    env = shared_gpu.apply(env, plan, rank, rank, "jax_ep_test", loopback=True)
    env.update(extra or {})
    return env


def warm_jobs() -> bool:
    """``$JAX_EP_TEST_WARM=1``: keep a job's processes between tests that
    share its shape (processes, environment, start-up), so each test pays
    its own compilation but not the job's start-up (JAX, jax.distributed,
    NVSHMEM). One warm job at a time (their GPU memory would add up)."""
    return os.environ.get("JAX_EP_TEST_WARM", "0") == "1"


class _Job:
    """The n rank processes of one job; they run requests (worker calls) one
    at a time until told to quit (tests/gpu/harness.py serve loop)."""

    def __init__(self, n: int, env: Optional[dict], init_native: bool, distributed: bool):
        self.n, self.seq = n, 0
        self.dir = tempfile.mkdtemp(prefix="jax_ep_job_")
        plan, port = gpu_plan(n), _free_port()
        self.procs, self.logs = [], []
        for rank in range(n):
            spec = dict(rank=rank, n=n, port=port, dir=self.dir, init_native=init_native,
                        distributed=distributed)
            log = open(os.path.join(self.dir, f"rank{rank}.log"), "w+")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), json.dumps(spec)], cwd=ROOT,
                env=_child_env(env, plan, rank), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def request(self, worker: str, kwargs: dict, timeout: float) -> tuple:
        """-> (per-rank results, None) or (None, why it failed, every rank's log tail)."""
        seq, self.seq = self.seq, self.seq + 1
        marks = [os.path.getsize(log.name) for log in self.logs]
        _write_json(os.path.join(self.dir, f"req{seq}.json"), dict(worker=worker, kwargs=kwargs))
        paths = [os.path.join(self.dir, f"result{r}_{seq}.json") for r in range(self.n)]
        deadline = time.monotonic() + timeout
        failed = None
        while not all(os.path.exists(q) for q in paths):
            bad = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if bad:
                failed = f"rank {bad[0]} exited with code {self.procs[bad[0]].returncode}"
                break
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout:.0f} s"
                break
            time.sleep(0.05)
        if failed is None:
            results = []
            for q in paths:
                with open(q) as f:
                    results.append(json.load(f))
            return results, None
        return None, (failed, "\n".join(
            f"----- rank {r} output (tail) -----\n{self._output(r, marks[r])}"
            for r in range(self.n)))

    def output(self, rank: int) -> str:
        return self._output(rank, 0)

    def _output(self, rank: int, since: int) -> str:
        log = self.logs[rank]
        log.flush()
        log.seek(since)
        return log.read()[-6000:]

    def close(self) -> None:
        """Ask the ranks to quit, then stop whatever still runs (_stop)."""
        if self.alive():
            _write_json(os.path.join(self.dir, f"req{self.seq}.json"), dict(quit=True))
            end = time.monotonic() + 20
            while time.monotonic() < end and not all(p.poll() is not None for p in self.procs):
                time.sleep(0.05)
        _stop(self.procs)


_warm = {"key": None, "job": None}


def close_warm_job() -> None:
    """End the warm job, if any: its processes hold GPU memory and NVSHMEM
    heaps that a job started outside :func:`run` (an example) needs."""
    if _warm["job"] is not None:
        _warm["job"].close()
    _warm.update(key=None, job=None)


atexit.register(close_warm_job)


def run(worker: str, n: Optional[int] = None, *, kwargs: Optional[dict] = None,
        timeout: float = 300.0, env: Optional[dict] = None, init_native: bool = True,
        distributed: bool = True, fresh: bool = False) -> list:
    """Run ``worker`` ("module:function", module importable from tests/gpu) on n ranks.

    ``fresh``: in a job of its own even with warm jobs (:func:`warm_jobs`),
    for a worker that leaves the runtime unusable (a peer timeout, an order
    error) or tests start-up itself."""
    import pytest

    n = nprocs() if n is None else n
    if not distributed and n != 1:
        raise ValueError("distributed=False needs n == 1")
    key = (n, tuple(sorted((env or {}).items())), init_native, distributed)
    warm = warm_jobs() and not fresh
    if warm and _warm["key"] == key and _warm["job"].alive():
        job = _warm["job"]
    else:
        close_warm_job()
        job = _Job(n, env, init_native, distributed)
        if warm:
            _warm.update(key=key, job=job)
    try:
        results, failure = job.request(worker, kwargs or {}, timeout)
    except BaseException:
        # Also when pytest itself is stopped (Ctrl-C, or SIGTERM: conftest.py
        # turns it into KeyboardInterrupt): the ranks run in sessions of their
        # own and would outlive us holding GPU memory and NVSHMEM heaps.
        if warm:
            close_warm_job()
        else:
            job.close()
        raise
    if not warm:
        job.close()
    if failure is not None:
        if warm:
            close_warm_job()
        failed, detail = failure
        pytest.fail(f"GPU job {worker} on {n} process(es): {failed}\n{detail}", pytrace=False)
    if os.environ.get("JAX_EP_TEST_SHOW_OUTPUT"):
        for r in range(n):
            print(f"----- rank {r} -----\n{job.output(r)}")
    return results


def _write_json(path: str, obj) -> None:
    """Whole or not at all: the reader polls for the name."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _stop(procs) -> None:
    """SIGTERM every rank still running (its whole process group), SIGKILL after 10 s."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _child(spec: dict) -> None:
    """A rank: start up once, then run each request of the job in turn."""
    rank, n = spec["rank"], spec["n"]
    import jax

    if spec["distributed"]:
        device = int(os.environ.get("JAX_EP_LOCAL_DEVICE_IDS", rank))
        jax.distributed.initialize(f"127.0.0.1:{spec['port']}", num_processes=n,
                                   process_id=rank, local_device_ids=[device])
    jax.devices()  # create the GPU client before NVSHMEM starts
    parent = os.getppid()
    seq = 0
    while True:
        path = os.path.join(spec["dir"], f"req{seq}.json")
        while not os.path.exists(path):
            if os.getppid() != parent:   # the test process is gone
                return
            time.sleep(0.02)
        with open(path) as f:
            req = json.load(f)
        if req.get("quit"):
            break
        if spec["init_native"]:
            import jax_ep

            if not jax_ep.is_initialized() and not jax_ep.initialize():
                from jax_ep import runtime
                raise SystemExit(f"jax_ep.initialize() failed: {runtime.unavailable_reason()}")
        os.environ["JAX_EP_TEST_REQUEST"] = str(seq)   # gpu_helpers.sync_ranks's barrier names
        mod_name, fn_name = req["worker"].split(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        result: Any = fn(rank, n, **req["kwargs"])
        _write_json(os.path.join(spec["dir"], f"result{rank}_{seq}.json"), result)
        print(f"[harness] rank {rank}: {req['worker']} done", flush=True)
        # a later request may build the same functions on a new runtime buffer
        jax.clear_caches()
        seq += 1
    if spec["distributed"]:
        jax.distributed.shutdown()


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
