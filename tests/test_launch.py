"""The multi-process launcher (jax_ep.launch) on CPU.

This file is also the script the launcher runs (``python tests/test_launch.py
worker|fail|hang``), so the tests need no helper files.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.abspath(__file__)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("JAX_EP_NUM_PROCESSES", None)
    return env


def _launch(*args, timeout=120, **kw):
    cmd = [sys.executable, "-m", "jax_ep.launch", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout, **kw)


# ----------------------------------------------------------------------------- unit


def test_child_env_sets_contract_vars():
    from jax_ep.launch import child_env

    base = {"XLA_FLAGS": "--foo --xla_force_host_platform_device_count=8", "KEEP": "1"}
    gpu = child_env(base, local_rank=1, nproc=2, node_rank=0, nnodes=1,
                    coordinator="127.0.0.1:1234", platform="gpu")
    assert gpu["JAX_EP_COORDINATOR"] == "127.0.0.1:1234"
    assert gpu["JAX_EP_NUM_PROCESSES"] == "2"
    assert gpu["JAX_EP_PROCESS_ID"] == "1"
    assert gpu["JAX_EP_LOCAL_DEVICE_IDS"] == "1"
    assert gpu["NCCL_NVLS_ENABLE"] == "0" and gpu["NVSHMEM_DISABLE_NVLS"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in gpu and gpu["KEEP"] == "1"
    assert gpu["XLA_FLAGS"] == base["XLA_FLAGS"]  # untouched on GPU

    cpu = child_env(base, local_rank=1, nproc=4, node_rank=1, nnodes=2,
                    coordinator="h:1", platform="cpu")
    assert cpu["JAX_EP_NUM_PROCESSES"] == "8" and cpu["JAX_EP_PROCESS_ID"] == "5"
    assert cpu["JAX_EP_LOCAL_RANK"] == "1"
    assert cpu["JAX_PLATFORMS"] == "cpu"
    assert cpu["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=1"


def test_free_port_is_bindable():
    import socket

    from jax_ep.launch import free_port

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    # and on the wildcard address JAX's coordination service listens on
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))


def test_free_port_rejects_a_port_taken_on_the_wildcard():
    import socket

    from jax_ep.launch import _bindable

    with socket.socket() as busy:  # a listener on 0.0.0.0, as the coordinator's would be
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert not _bindable(socket.AF_INET, "0.0.0.0", taken)


def test_init_distributed_single_process_is_noop(monkeypatch):
    import jax_ep.launch as launch

    for k in ("JAX_EP_NUM_PROCESSES", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(launch, "_INFO", None)
    info = launch.init_distributed()
    assert info.num_processes == 1 and not info.distributed and not info.native
    assert launch.init_distributed() is info  # idempotent
    monkeypatch.setattr(launch, "_INFO", None)


def test_usage_error_without_script():
    r = _launch("-n", "2", timeout=30)
    assert r.returncode != 0 and "script" in r.stderr


# ----------------------------------------------------------------------------- processes


@pytest.mark.slow
def test_two_cpu_processes_dispatch_combine():
    r = _launch("-n", "2", "--platform", "cpu", THIS, "worker")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for rank in (0, 1):
        assert f"[rank {rank}] WORKER OK" in r.stdout, out


@pytest.mark.slow
def test_failing_rank_stops_all_quickly():
    t0 = time.monotonic()
    r = _launch("-n", "2", "--platform", "cpu", "--grace", "2", THIS, "fail", timeout=60)
    dt = time.monotonic() - t0
    assert r.returncode == 3, r.stdout + r.stderr
    assert "rank 1 exited with code 3" in r.stderr, r.stderr
    assert "[rank 0] sleeping" in r.stdout
    assert dt < 10, f"took {dt:.1f}s"
    time.sleep(0.2)
    assert not _alive(_read_pids(r.stdout)), "orphaned processes left behind"


@pytest.mark.slow
def test_sigint_propagates_to_all_ranks():
    p = subprocess.Popen([sys.executable, "-m", "jax_ep.launch", "-n", "2", "--platform", "cpu",
                          "--grace", "1", THIS, "hang"], cwd=ROOT, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    while sum("hanging" in ln for ln in lines) < 2:  # both ranks up
        ln = p.stdout.readline()
        assert ln, "launcher ended early"
        lines.append(ln)
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert p.returncode == 128 + signal.SIGINT, err
    assert "stopped by SIGINT" in err
    time.sleep(0.2)
    assert not _alive(_read_pids("".join(lines) + out))


def _read_pids(text):
    import re

    return [int(p) for p in re.findall(r"pid=(\d+)", text)]


def _alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        try:  # a zombie is not a running orphan
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        alive.append(pid)
    return alive

@pytest.mark.slow
def test_two_launchers_as_two_hosts():
    """The multi-host launch path on one machine (docs/multihost.md, "Rehearse
    on one machine"): two launchers with --nnodes 2 and their own --host-id;
    every process sees both hosts in jax_ep's exchange, the EP group of 4
    splits one node per host, and NVSHMEM's network transport stays off (one
    machine)."""
    from jax_ep.launch import free_port

    coord = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jax_ep.launch", "-n", "2", "--platform", "cpu", "--nnodes", "2",
         "--node-rank", str(r), "--host-id", f"node{r}", "--coordinator", coord, THIS, "hosts"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    for rank in range(4):
        line = f"HOSTS rank {rank} node0,node0,node1,node1 nodes 2 remote none"
        assert line in "".join(outs), "\n".join(outs)


# ----------------------------------------------------------------------------- child side


def _worker():
    """Rank side of test_two_cpu_processes_dispatch_combine: a reference-backend
    dispatch -> per-expert function -> combine across 2 processes, checked
    against numpy, plus the gradient wrt the routing weights."""
    from jax_ep.launch import init_distributed

    info = init_distributed()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_ep

    assert info.distributed and info.num_processes == 2 and jax.process_count() == 2
    R, T, H, E, K = jax.device_count(), 8, 16, 8, 3
    assert R == 2 and len(jax.local_devices()) == 1
    L = E // R
    rng = np.random.default_rng(0)  # same data on every process
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = np.argsort(rng.random((R * T, E)), axis=1)[:, :K].astype(np.int32)
    idx[3, 1] = -1  # an unused slot
    w = rng.random((R * T, K)).astype(np.float32)
    scale = np.arange(1, E + 1, dtype=np.float32)  # expert e multiplies by e + 1

    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                          axis_name="ep", backend="reference")
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))

    def per_rank(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, cfg)
        C = d.x.shape[0]
        ends = jnp.cumsum(d.group_sizes)
        local = jnp.searchsorted(ends, jnp.arange(C), side="right")
        e = jnp.minimum(local, L - 1) + jax.lax.axis_index("ep") * L
        y = d.x * (e + 1).astype(d.x.dtype)[:, None]
        return jax_ep.combine(y, d, cfg), d.num_dropped.reshape(1)

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3,
                      out_specs=(P("ep"), P("ep")), check_vma=True)
    sh = NamedSharding(mesh, P("ep"))
    put = lambda a: jax.make_array_from_callback(a.shape, sh, lambda i: a[i])
    xs, ids, ws = put(x), put(idx), put(w)
    out, dropped = jax.jit(f)(xs, ids, ws)
    gw = jax.jit(jax.grad(lambda x, i, w: jnp.sum(f(x, i, w)[0]), argnums=2))(xs, ids, ws)

    valid = idx >= 0
    sc = np.where(valid, scale[np.maximum(idx, 0)], 0.0)
    want = np.einsum("tk,tk,th->th", w, sc, x)
    want_gw = sc * x.sum(1, keepdims=True)
    for s in out.addressable_shards:
        np.testing.assert_allclose(np.asarray(s.data), want[s.index], rtol=1e-5, atol=1e-5)
    for s in gw.addressable_shards:
        np.testing.assert_allclose(np.asarray(s.data), want_gw[s.index], rtol=1e-5, atol=1e-4)
    for s in dropped.addressable_shards:
        assert int(np.asarray(s.data)[0]) == 0
    # jax_ep.initialize's host exchange (jax_ep/hosts.py) through the real
    # key-value store of a 2-process job (names made up: both run here)
    from jax._src import distributed

    from jax_ep import hosts
    me = jax.process_index()
    got = hosts.exchange(distributed.global_state.client, me, 2, 999, 30_000, f"node{me}")
    assert got == ["node0", "node1"], got
    print(f"WORKER OK process {jax.process_index()}", flush=True)


def _fail():
    rank = int(os.environ["JAX_EP_PROCESS_ID"])
    # a grandchild too: the launcher must not leave it behind
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(f"rank {rank} pid={os.getpid()} pid={g.pid}", flush=True)
    if rank == 1:
        time.sleep(0.5)
        sys.exit(3)
    print("sleeping", flush=True)
    time.sleep(60)


def _hang():
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    if os.environ["JAX_EP_PROCESS_ID"] == "0":  # a rank that ignores SIGINT/SIGTERM
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"hanging pid={os.getpid()} pid={g.pid}", flush=True)
    time.sleep(60)


def _hosts():
    """Rank side of test_two_launchers_as_two_hosts: jax_ep's host exchange
    (what initialize does before NVSHMEM starts) through JAX's key-value store."""
    from jax_ep.launch import init_distributed

    info = init_distributed()
    from jax._src import distributed

    from jax_ep import hosts

    values = hosts.exchange(distributed.global_state.client, info.process_id,
                            info.num_processes, 0, 60_000, hosts.local_value({}))
    names, net = hosts.job_network_env(values)
    print(f"HOSTS rank {info.process_id} {','.join(names)} nodes "
          f"{hosts.auto_nodes(names, info.num_processes)} remote "
          f"{net['NVSHMEM_REMOTE_TRANSPORT']}", flush=True)


if __name__ == "__main__":
    {"worker": _worker, "fail": _fail, "hang": _hang, "hosts": _hosts}[sys.argv[1]]()


def test_child_arguments_are_not_taken_by_the_launcher():
    from jax_ep.launch import _parse

    _, ns = _parse(["-n", "2", "-m", "pkg.mod", "--flag", "--grace", "3"])
    assert (ns.nproc, ns.module, ns.script, ns.args, ns.grace) == (2, "pkg.mod", None,
                                                                  ["--flag", "--grace", "3"], 5.0)
    _, ns = _parse(["--platform=cpu", "train.py", "-n", "5"])
    assert (ns.platform, ns.script, ns.args, ns.nproc) == ("cpu", "train.py", ["-n", "5"], None)
