"""EpConfig.num_nodes (the hierarchical kernels' node split) on CPU: the
config and trace-time checks, the reference backend ignoring it, and the
internode region's sizing (through the extension: skipped without it)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import extension, runtime
from jax_ep.internode import region as inter_region
from ep_testing import make_mesh, random_routing

R, T, H, K, E = 8, 4, 256, 2, 16


def _cfg(**kw):
    base = dict(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, backend="reference")
    base.update(kw)
    return jax_ep.EpConfig(**base)


def test_default_is_one_node():
    assert _cfg().num_nodes == 1
    assert _cfg() == _cfg(num_nodes=1) and hash(_cfg()) == hash(_cfg(num_nodes=1))


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2", None])
def test_num_nodes_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="EpConfig.num_nodes must be a positive int"):
        _cfg(num_nodes=bad)


def test_num_nodes_numpy_int_is_plain():
    c = _cfg(num_nodes=np.int64(2))
    assert c.num_nodes == 2 and type(c.num_nodes) is int


def test_ranks_per_node():
    assert _cfg(num_nodes=2).ranks_per_node(8) == 4
    assert _cfg(num_nodes=8).ranks_per_node(8) == 1
    with pytest.raises(ValueError, match=r"num_nodes \(3\) must divide the size of axis 'ep' \(8\)"):
        _cfg(num_nodes=3).ranks_per_node(8)


def test_net_transport_config():
    """EpConfig.net_transport: "auto" by default, the abi's names only (a clear
    ValueError at construction), part of the config's identity."""
    from jax_ep import abi
    from jax_ep.config import NET_TRANSPORTS

    assert NET_TRANSPORTS == ("auto", "p2p", "put") == tuple(abi.NET_TRANSPORTS)
    assert _cfg().net_transport == "auto"
    assert sorted(abi.net_transport(t) for t in NET_TRANSPORTS) == [0, 1, 2]
    for bad in ("P2P", "ibgda", "", None, 2):
        with pytest.raises(ValueError,
                           match=r"EpConfig.net_transport must be one of \('auto', 'p2p', 'put'\)"):
            _cfg(net_transport=bad)
    assert _cfg(net_transport="put") != _cfg()
    assert hash(_cfg(net_transport="put")) == hash(_cfg(net_transport="put"))


def test_net_transport_is_in_the_generated_header():
    from jax_ep import abi

    h = abi.render_header()
    assert "enum NetTransport : int {" in h
    for cpp, code, _ in abi.NET_TRANSPORTS.values():
        assert f"{cpp} = {code}," in h


def _run(cfg, x, idx, w, grad=False):
    mesh = make_mesh((R,), ("ep",))
    spec = P("ep")

    def layer(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, cfg)
        return jax_ep.combine(d.x * 2, d, cfg)

    f = jax.shard_map(layer, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    if grad:
        return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, idx, w) ** 2), argnums=(0, 1)))(x, w)
    return jax.jit(f)(x, idx, w)


@pytest.mark.parametrize("nodes", [3, 16])
def test_trace_time_error_when_nodes_do_not_split_the_axis(nodes):
    x = jnp.zeros((R * T, H), jnp.bfloat16)
    idx = jnp.zeros((R * T, K), jnp.int32)
    w = jnp.ones((R * T, K), jnp.float32)
    with pytest.raises(ValueError, match=f"num_nodes \\({nodes}\\) must divide"):
        _run(_cfg(num_nodes=nodes), x, idx, w)


@pytest.mark.slow
@pytest.mark.parametrize("net", ["auto", "put"])
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_reference_backend_ignores_num_nodes(layout, net):
    rng = np.random.default_rng(0)
    idx = jnp.asarray(random_routing(rng, R, T, K, E).reshape(R * T, K))
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    flat, hier = _cfg(layout=layout), _cfg(layout=layout, num_nodes=2, net_transport=net)
    np.testing.assert_array_equal(np.asarray(_run(flat, x, idx, w)),
                                  np.asarray(_run(hier, x, idx, w)))
    for a, b in zip(_run(flat, x, idx, w, grad=True), _run(hier, x, idx, w, grad=True)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_internode_shape_of():
    one, two = _cfg(), _cfg(num_nodes=2)
    assert inter_region.shape_of([], 8) == (0, 0, 0, 0)
    assert inter_region.shape_of([one], 8) == (0, 0, 0, 0)
    big = _cfg(num_nodes=2, max_tokens_per_rank=64, hidden=512)
    # largest T and H of the internode configs; single-node configs do not count
    assert inter_region.shape_of([one, two, big], 8) == (2, 8, 64, 512)
    with pytest.raises(ValueError, match="different num_nodes"):
        inter_region.shape_of([two, _cfg(num_nodes=4)], 8)
    with pytest.raises(ValueError, match="must divide the 6 EP ranks"):
        inter_region.shape_of([_cfg(num_nodes=4)], 6)


def test_internode_shape_follows_the_hosts():
    """num_nodes 1 on a job that spans hosts with more EP ranks than a host
    has PEs: the region gets one node per host (what the native calls pick,
    hosts.auto_nodes); an explicit num_nodes must agree with it."""
    hosts = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert inter_region.shape_of([_cfg()], 8, hosts=hosts) == (4, 8, T, H)
    assert inter_region.shape_of([_cfg()], 8, hosts=["h"] * 8) == (0, 0, 0, 0)
    assert inter_region.shape_of([_cfg(num_nodes=4)], 8, hosts=hosts) == (4, 8, T, H)
    # an explicit num_nodes decides over one node per host
    assert inter_region.shape_of([_cfg(), _cfg(num_nodes=2)], 8, hosts=hosts) == (2, 8, T, H)


def test_internode_window():
    """The window: the largest T whose region fits the bound (the smallest
    internode_bytes of the configs), every T when it fits, an error when not
    even one token does; a region linear in T here (bytes = 100 + 10 T)."""
    fake = lambda n, r, t, h: 100 + 10 * t
    assert inter_region.window_for(fake, 2, 8, 64, 512, 10_000) == 64
    assert inter_region.window_for(fake, 2, 8, 4096, 512, 10_000) == 990
    assert inter_region.window_for(fake, 2, 8, 4096, 512, 110) == 1
    assert inter_region.window_for(fake, 2, 8, 4096, 512, None) == 4096   # 1 GiB
    with pytest.raises(ValueError, match="below the internode region of one token"):
        inter_region.window_for(fake, 2, 8, 4096, 512, 109)
    a = _cfg(num_nodes=2, max_tokens_per_rank=4096, internode_bytes=10_000)
    b = _cfg(num_nodes=2, max_tokens_per_rank=64, hidden=512, internode_bytes=5_000)
    assert inter_region.shape_of([a, b], 8, fake) == (2, 8, 490, 512)
    assert inter_region.shape_of([a, b], 8) == (2, 8, 4096, 512)   # no bound applied
    with pytest.raises(ValueError, match="internode_bytes"):
        _cfg(num_nodes=2, internode_bytes=0)


def test_second_initialize_checks_the_internode_region(monkeypatch):
    """A later initialize(config=...) on a live runtime: an internode config
    that does not fit the region laid out at start is an error, not ignored."""
    from jax_ep.region import Region

    def check(live, config):   # initialize on a runtime that is up with region `live`
        monkeypatch.setitem(runtime._state, "initialized", True)
        monkeypatch.setitem(runtime._state, "regions", (Region("internode", live, 1),))
        runtime._check_live(config, None, None)

    live = (2, 8, 64, 512)
    check(live, None)
    check(live, _cfg())                     # one node: no region needed
    check(live, [_cfg(num_nodes=2, max_tokens_per_rank=64, hidden=512),
                 _cfg(num_nodes=2)])        # fits
    # more tokens than the region's window: windows of it, no error
    check(live, _cfg(num_nodes=2, max_tokens_per_rank=65))
    for bad in (_cfg(num_nodes=2, hidden=1024), _cfg(num_nodes=4)):
        with pytest.raises(ValueError, match="already up with an internode region"):
            check(live, bad)
    live = inter_region.NONE
    with pytest.raises(ValueError, match="Call jax_ep.finalize"):
        check(live, _cfg(num_nodes=2))
    # num_nodes 1 on a job that spans hosts (8 PEs, 2 per host): one node per
    # host needs a region the live runtime does not have
    monkeypatch.setattr(runtime, "pe_hosts", lambda: ["a", "a", "b", "b", "c", "c", "d", "d"])
    with pytest.raises(ValueError, match=r"needs 4 nodes \(num_nodes=1, one node per host"):
        check(live, _cfg())
    monkeypatch.setattr(runtime, "pe_hosts", lambda: ["h"] * 8)
    check(live, _cfg())


C = extension.load()
V3_WINDOW = 780   # tokens of the 1 GiB default at V3-train, 2 x 4 ranks (H 7168)
needs_ext = pytest.mark.skipif(C is None, reason="needs the jax_ep._C extension")


@needs_ext
def test_region_bytes_zero_for_one_node():
    assert inter_region.region_bytes(_cfg(), 8) == 0
    assert C.internode_region_bytes(1, 8, 4096, 7168) == 0


@needs_ext
@pytest.mark.parametrize("N,Rk", [(2, 2), (2, 8), (4, 8), (8, 8)])
def test_region_holds_both_ops_at_f32_rows(N, Rk):
    """The data of each op and parity with its put staging, dispatch (N + R + 1)
    * T and combine (G + 2) * N * T rows of f32 (+ scales and per-slot words),
    fits a quarter of the region; the region grows with T and H, and is
    internode.region.region_bytes's number."""
    Tk, Hk = 512, 1024
    got = C.internode_region_bytes(N, Rk, Tk, Hk)
    G = Rk // N
    rows = max(N + Rk + 1, (G + 2) * N) * Tk * 4 * Hk
    assert 4 * rows < got < 4 * rows * 1.1 + (1 << 20)
    assert C.internode_region_bytes(N, Rk, 2 * Tk, Hk) > got
    assert C.internode_region_bytes(N, Rk, Tk, 2 * Hk) > got
    cfg = _cfg(num_nodes=N, max_tokens_per_rank=Tk, hidden=Hk)
    assert inter_region.region_bytes(cfg, Rk) == got     # under 1 GiB: no window cut


@needs_ext
def test_region_at_v3_train_2x4():
    """f32-wide rows and the put staging (combine: (4 + 2) * 2 * T rows per
    parity): 5.6 GB for one window of all 4096 tokens; the default bound (1 GiB)
    cuts it to windows of V3_WINDOW tokens (docs/internode.md, EpConfig)."""
    got = C.internode_region_bytes(2, 8, 4096, 7168)
    assert 5.5e9 < got < 5.8e9
    cfg = _cfg(num_nodes=2, max_tokens_per_rank=4096, hidden=7168)
    W = inter_region.window(cfg, 8)
    assert W == V3_WINDOW
    assert inter_region.region_bytes(cfg, 8) <= 1 << 30 < C.internode_region_bytes(2, 8, W + 1, 7168)
    big = _cfg(num_nodes=2, max_tokens_per_rank=4096, hidden=7168, internode_bytes=got)
    assert inter_region.window(big, 8) == 4096 and inter_region.region_bytes(big, 8) == got
