"""Several processes on fewer GPUs (jax_ep.shared_gpu, jax-ep-launch --gpus): the
plan, each process's environment and the launcher's errors, on CPU."""
import pytest

from jax_ep import launch, shared_gpu

GIB = 1 << 30


def test_one_gpu_each_is_not_shared():
    p = shared_gpu.plan(4, 4, 8, gpu_bytes=141 * GIB)
    assert (p.gpus, p.per_gpu, p.shared, p.mem_fraction) == (4, 1, False, None)
    assert shared_gpu.process_env(p, 3, 3, "h", True) == {"JAX_EP_LOCAL_DEVICE_IDS": "3"}


@pytest.mark.parametrize("n,g,per", [(2, 1, 2), (8, 1, 8), (8, 3, 3), (5, 2, 3)])
def test_round_robin_with_a_fair_fraction(n, g, per):
    p = shared_gpu.plan(n, g, g, gpu_bytes=141 * GIB)
    assert p.per_gpu == per and p.shared
    assert p.mem_fraction == shared_gpu.fair_fraction(per, 141 * GIB) <= 0.8 / per
    # every process's pool and outside-pool memory fit in 0.9 of the GPU
    assert per * (p.mem_fraction * 141 * GIB + shared_gpu.OUTSIDE_POOL_BYTES) <= 0.9 * 141 * GIB
    envs = [shared_gpu.process_env(p, r, 10 + r, "box", True) for r in range(n)]
    assert [e["JAX_EP_LOCAL_DEVICE_IDS"] for e in envs] == [str(r % g) for r in range(n)]
    assert len({e["NCCL_HOSTID"] for e in envs}) == n          # one NCCL host each
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" and e[shared_gpu.SHARED_ENV] == str(per)
               for e in envs)
    assert "NCCL_SOCKET_IFNAME" not in shared_gpu.process_env(p, 0, 0, "box", False)


def test_user_fraction_and_nccl_interface_are_kept():
    p = shared_gpu.plan(4, 1, 1, gpu_bytes=141 * GIB, user_fraction="0.1")
    assert p.mem_fraction == 0.1
    env = shared_gpu.apply({"NCCL_SOCKET_IFNAME": "eth0"}, p, 1, 1, "h", loopback=True)
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.1"


def test_too_many_processes_for_the_memory():
    with pytest.raises(shared_gpu.SharedGpuError, match=r"64 processes per GPU do not fit .*"
                       r"memory fraction -"):
        shared_gpu.plan(64, 1, 1, gpu_bytes=141 * GIB)
    with pytest.raises(shared_gpu.SharedGpuError, match=r"32 processes per GPU do not fit .*"
                       r"memory fraction 0\.0"):
        shared_gpu.plan(32, 1, 1, gpu_bytes=141 * GIB)
    with pytest.raises(shared_gpu.SharedGpuError, match="lower XLA_PYTHON_CLIENT_MEM_FRACTION"):
        shared_gpu.plan(4, 1, 1, gpu_bytes=141 * GIB, user_fraction="0.3")


def test_more_gpus_than_visible():
    with pytest.raises(shared_gpu.SharedGpuError, match="--gpus 4 but only 1 GPU"):
        shared_gpu.plan(8, 4, 1)


def test_launcher_plans_and_refuses(monkeypatch, capsys):
    monkeypatch.setattr(launch, "_visible_gpus", lambda: 1)
    monkeypatch.setattr(shared_gpu, "gpu_memory_bytes", lambda: 141 * GIB)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    parser, ns = launch._parse(["-n", "4", "--platform", "gpu", "x.py"])
    _, nproc, coord, _, plan = launch._resolve(parser, ns)
    assert (nproc, plan.gpus, plan.per_gpu) == (4, 1, 4)
    env = launch.child_env({}, local_rank=3, nproc=4, node_rank=1, nnodes=2, coordinator=coord,
                           platform="gpu", gpu_plan=plan, host_id="node1")
    assert env["JAX_EP_LOCAL_DEVICE_IDS"] == "0" and env["JAX_EP_HOST_ID"] == "node1"
    assert env["NCCL_HOSTID"] == "node1-jax_ep-p7" and env["NCCL_SOCKET_IFNAME"] == "lo"
    for argv, msg in ((["-n", "2", "--gpus", "2", "--platform", "gpu", "x.py"], "--gpus 2 but only 1"),
                      (["-n", "64", "--platform", "gpu", "x.py"], "do not fit"),
                      (["-n", "2", "--gpus", "1", "--platform", "cpu", "x.py"], "--gpus needs")):
        parser, ns = launch._parse(argv)
        with pytest.raises(SystemExit):
            launch._resolve(parser, ns)
        assert msg in capsys.readouterr().err


def test_peer_memory_refused_when_sharing_a_gpu(monkeypatch):
    from jax_ep import runtime

    monkeypatch.setenv(shared_gpu.SHARED_ENV, "4")
    with pytest.raises(ValueError, match="shares its GPU with 3 other.*NVSHMEM symmetric heap"):
        runtime.initialize(symmetric_memory="peer_memory")


def test_heap_room_is_split_between_processes_of_one_gpu():
    from jax_ep import hosts

    def v(machine, device, free):
        return f'{{"host": "{machine}", "machine": "{machine}", "net": {{}}, "free": {free}, ' \
               f'"device": {device}}}'

    vals = [v("a", 0, 100), v("a", 0, 90), v("a", 1, 50), v("b", 0, 80)]
    assert hosts.gpu_sharing(vals) == [(90, 2), (90, 2), (50, 1), (80, 1)]


def test_emulated_hosts_on_one_machine_need_no_network(monkeypatch):
    from jax_ep import hosts

    def v(host):
        return f'{{"host": "{host}", "machine": "box", "net": {{}}, "free": 0, "device": 0}}'

    names, env = hosts.job_network_env([v("node0"), v("node0"), v("node1"), v("node1")])
    assert names == ["node0", "node0", "node1", "node1"]
    assert env["NVSHMEM_REMOTE_TRANSPORT"] == "none"
    assert hosts.auto_nodes(names, 4) == 2
