"""Multi-host awareness (jax_ep/hosts.py): the host exchange, NVSHMEM's
remote-transport choice, and the lowering-time check of EP groups that span
hosts. (The exchange through a real 2-process key-value store:
tests/test_launch.py::test_two_cpu_processes_dispatch_combine.)"""
import numpy as np
import pytest

from jax_ep import hosts


class FakeKV:
    def __init__(self, preset):
        self.store = dict(preset)

    def key_value_set(self, key, value):
        assert key not in self.store
        self.store[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        return self.store[key]


def test_exchange_reads_every_rank_in_order():
    kv = FakeKV({"jax_ep/host/3/0": "a", "jax_ep/host/3/2": "b"})
    assert hosts.exchange(kv, 1, 3, 3, 10, "z") == ["a", "z", "b"]
    assert kv.store["jax_ep/host/3/1"] == "z"
    assert hosts.exchange(None, 0, 1, 3, 10, "solo") == ["solo"]
    with pytest.raises(RuntimeError, match="jax.distributed"):
        hosts.exchange(None, 0, 2, 1, 10, "x")


def test_exchange_names_the_process_that_never_came():
    class Late(FakeKV):
        def blocking_key_value_get(self, key, timeout_ms):
            raise TimeoutError("DEADLINE_EXCEEDED")
    with pytest.raises(RuntimeError, match="process 0 did not reach .* within 2 s"):
        hosts.exchange(Late({}), 1, 2, 0, 2000, "x")


def test_host_id(monkeypatch):
    monkeypatch.setenv("JAX_EP_HOST_ID", "rack1-n3")
    assert hosts.host_id() == "rack1-n3"
    monkeypatch.delenv("JAX_EP_HOST_ID")
    hid = hosts.host_id()
    assert hid.startswith(hosts.socket.gethostname()) and hid == hosts.host_id()


def test_job_network_env_needs_agreeing_processes():
    R, G = "NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA"
    mk = lambda h, r=None, g=None: hosts.json.dumps({"host": h, "net": {R: r, G: g}})
    assert hosts.job_network_env([mk("a"), mk("a")]) == (["a", "a"], {R: "none", G: None})
    assert hosts.job_network_env([mk("a"), mk("b")]) == (["a", "b"], {R: None, G: "1"})
    with pytest.raises(RuntimeError, match="differ between processes"):
        hosts.job_network_env([mk("a", "none", "0"), mk("b")])


def test_network_env():
    R, G = "NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA"
    unset = {R: None, G: None}
    # one host: no NIC needed; the user's choices kept
    assert hosts.network_env(["h", "h"], unset) == {R: "none", G: None}
    assert hosts.network_env(["h"], {R: "ucx", G: "0"}) == {R: "ucx", G: "0"}
    # across hosts: NVSHMEM's default remote transport plus IBGDA
    assert hosts.network_env(["h0", "h1"], unset) == {R: None, G: "1"}
    assert hosts.network_env(["h0", "h1"], {R: "ibrc", G: "0"}) == {R: "ibrc", G: "0"}
    assert hosts.network_env(["h0", "h1"], {R: "none", G: None}) == {R: "none", G: "1"}
    with pytest.raises(RuntimeError, match=r"3 processes run on 2 hosts.*REMOTE_TRANSPORT=none"):
        hosts.network_env(["h0", "h1", "h1"], {R: " None ", G: "0"})


HOSTS = ["a", "a", "b", "b", "c", "c", "d", "d"]    # PE -> host: 4 hosts x 2 GPUs


def test_intranode_group_across_hosts_names_num_nodes():
    groups = np.array([[0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"spans 2 hosts \(a x2, b x2\).*num_nodes=2"):
        hosts.check_ep_groups("jax_ep_dispatch", groups, HOSTS, None, "ep")
    # interleaved hosts: no num_nodes fits as laid out
    with pytest.raises(ValueError, match="contiguous"):
        hosts.check_ep_groups("jax_ep_combine", np.array([[0, 2, 1, 3]]), HOSTS, None, "ep")
    # groups inside one host, one host only, low latency: fine
    hosts.check_ep_groups("jax_ep_dispatch", np.array([[0, 1], [2, 3]]), HOSTS, None, "ep")
    hosts.check_ep_groups("jax_ep_dispatch", groups, ["h"] * 8, None, "ep")
    hosts.check_ep_groups("jax_ep_dispatch", groups, None, None, "ep")
    hosts.check_ep_groups("jax_ep_ll_dispatch_send", groups, HOSTS, None, "ep")


def test_auto_nodes():
    """One node per host when the EP group has more ranks than a host has PEs
    (the hosts laid out as equal consecutive runs), else 1."""
    assert hosts.auto_nodes(HOSTS, 8) == 4
    assert hosts.auto_nodes(HOSTS, 4) == 2
    assert hosts.auto_nodes(HOSTS, 2) == 1          # fits a host: intranode
    assert hosts.auto_nodes(HOSTS, 6) == 3
    assert hosts.auto_nodes(HOSTS, 3) == 1          # not whole hosts: left to the check
    assert hosts.auto_nodes(["h"] * 8, 8) == 1
    assert hosts.auto_nodes(None, 8) == 1
    assert hosts.auto_nodes(["a", "b", "a", "b"], 4) == 1          # interleaved
    assert hosts.auto_nodes(["a", "a", "a", "b"], 4) == 1          # unequal


def test_internode_node_blocks_must_share_a_host():
    groups = np.arange(8).reshape(1, 8)
    hosts.check_ep_groups("jax_ep_internode_dispatch", groups, HOSTS, np.int32(4), "ep")
    # emulated nodes inside a host are fine (2 x 1 on host a)
    hosts.check_ep_groups("jax_ep_internode_combine", np.array([[0, 1]]), HOSTS, 2, "ep")
    with pytest.raises(ValueError, match=r"num_nodes=2\) makes ranks 0\.\.3 .* hosts a, b"):
        hosts.check_ep_groups("jax_ep_internode_dispatch", groups, HOSTS, 2, "ep")


def test_initialize_env_keeps_the_users_choice(monkeypatch):
    """initialize's network env (jax_ep.nvshmem_env): sets what the user left
    unset, keeps what they set, and a later initialize on other hosts replaces
    only its own values."""
    import os

    from jax_ep import nvshmem_env

    R, G = "NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA"
    monkeypatch.delenv(R, raising=False)
    monkeypatch.delenv(G, raising=False)
    monkeypatch.setattr(nvshmem_env, "_set_here", {})

    def init_on(job_hosts):
        user = nvshmem_env.user_network()
        nvshmem_env.apply_network(hosts.network_env(job_hosts, user), user)

    init_on(["h", "h"])
    assert os.environ.get(R) == "none" and G not in os.environ
    init_on(["h0", "h1"])                             # ours replaced: NVSHMEM's default + IBGDA
    assert R not in os.environ and os.environ.get(G) == "1"
    monkeypatch.setenv(R, "ucx")                      # the user's, set later: kept
    init_on(["h", "h"])
    assert os.environ.get(R) == "ucx" and G not in os.environ


def test_initialize_nvshmem_path_with_a_stand_in_extension(monkeypatch):
    """jax_ep.initialize's NVSHMEM path end to end on CPU, with a stand-in for
    the extension and one stand-in GPU: heap sizing, the host exchange, the
    network variables (one host: REMOTE_TRANSPORT=none), NVSHMEM init and
    attach in that order; then finalize. (The GPU path is otherwise only run
    on GPU machines.)"""
    import os
    import types

    import jax

    from jax_ep import extension, nvshmem_env, runtime

    calls = []

    class StandIn:
        def ll_region_size(self, shape):
            return 0

        def internode_region_bytes(self, *shape):
            return 0

        def device_free_bytes(self, device):
            return 1 << 40

        def nvshmem_status(self):
            return 0

        def nvshmem_unique_id(self):
            return b"uid"

        def nvshmem_init(self, uid, rank, nranks, device):
            calls.append(("init", uid, rank, nranks, device,
                          os.environ.get("NVSHMEM_REMOTE_TRANSPORT"),
                          os.environ.get("NVSHMEM_SYMMETRIC_SIZE")))
            return True

        def runtime_attach(self, device, buffer_bytes, ll_shape, inter_shape, ragged_shape):
            calls.append(("attach", device, buffer_bytes))

        def runtime_detach(self):
            calls.append(("detach",))

        def nvshmem_finalize(self):
            calls.append(("finalize",))

    for k in ("NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_SYMMETRIC_SIZE",
              "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(k, "")     # recorded, so what initialize sets is undone after
        monkeypatch.delenv(k)
    monkeypatch.setattr(extension, "load", lambda: StandIn())
    monkeypatch.setattr(extension, "register_targets", lambda: None)
    monkeypatch.setattr(nvshmem_env, "USER_HEAP", None)
    monkeypatch.setattr(nvshmem_env, "_set_here", {})
    gpu = types.SimpleNamespace(platform="gpu", local_hardware_id=3)
    monkeypatch.setattr(jax, "local_devices", lambda: [gpu])
    for k, v in (("initialized", False), ("nvshmem_up", False), ("owns_nvshmem", False),
                 ("symmetric_memory", None), ("hosts", None), ("regions", ()),
                 ("heap_bytes", None)):
        monkeypatch.setitem(runtime._state, k, v)

    assert runtime.initialize(buffer_bytes=1 << 20) is True
    heap = str(nvshmem_env.HEAP_GRANULE)   # 1 MiB + slack, rounded up to one granule
    assert calls == [("init", b"uid", 0, 1, 3, "none", heap), ("attach", 3, 1 << 20)]
    assert runtime.symmetric_memory() == "nvshmem" and runtime.pe_hosts() == [hosts.host_id()]
    assert [(r.family, r.nbytes) for r in runtime.regions()] == [
        ("intranode", 1 << 20), ("low_latency", 0), ("internode", 0), ("ragged", 0)]
    runtime.finalize()
    assert calls[-2:] == [("detach",), ("finalize",)] and not runtime.is_initialized()
