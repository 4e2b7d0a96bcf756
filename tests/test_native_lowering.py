"""The Python side of every native FFI call matches its C++ binding, checked on CPU.

The native backend is lowered (never run) on 8 fake CPU devices for forward +
backward of both layouts, fp8 dispatch and the layout kernel; every
``stablehlo.custom_call @jax_ep_*`` in the module must carry exactly the
attributes, operand count and result count that ``XLA_FFI_DEFINE_HANDLER_SYMBOL``
binds in ``cc/ffi_*.cc`` / ``cc/testing/ffi_*.cc`` (found through ``cc/ffi_targets.h``). A mismatch would
otherwise only show as a runtime error on GPUs."""
import glob
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _ffi, abi, backend
from ep_testing import make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bindings():
    """target name -> (operands, results, attribute names) from the C++ sources;
    a binding with ``.RemainingArgs()`` (the low-latency sends' ``after``
    operands) gives its fixed operands as ``(n, None)``: n or more match."""
    header = open(os.path.join(ROOT, "cc", "ffi_targets.h")).read()
    targets = dict(re.findall(r'X\("(\w+)",\s*(\w+)\)', header[header.index("#define"):]))
    symbols = {}
    for path in glob.glob(os.path.join(ROOT, "cc", "**", "ffi_*.cc"), recursive=True):
        src = open(path).read()
        for m in re.finditer(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\((\w+),(.*?)\);", src, re.S):
            body = re.sub(r"//[^\n]*", "", m.group(2))
            n_args = len(re.findall(r"\.Arg<", body))
            symbols[m.group(1)] = ((n_args, None) if ".RemainingArgs()" in body else n_args,
                                   len(re.findall(r"\.Ret<", body)),
                                   frozenset(re.findall(r'\.Attr<[^>]*>+\("(\w+)"\)', body)))
    return {name: symbols[sym] for name, sym in targets.items()}


def test_production_targets_carry_no_test_hooks():
    """Test and bench hooks (output poisoning, the bench breakdown) live in the
    test build (cc/common/testing_hooks.h): no production target binds a
    ``debug_*`` attribute, and no production source reads the environment."""
    header = open(os.path.join(ROOT, "cc", "ffi_targets.h")).read()
    testing_block = header[header.index("#define JAX_EP_TESTING_TARGETS"):].split("\n\n")[0]
    testing = set(re.findall(r'X\("(\w+)"', testing_block))
    assert testing, "no testing targets found in cc/ffi_targets.h"
    production = {n: b for n, b in _bindings().items() if n not in testing}
    assert "jax_ep_dispatch" in production
    for name, (_, _, attrs) in production.items():
        assert not [a for a in attrs if a.startswith("debug")], (name, sorted(attrs))
    for path in glob.glob(os.path.join(ROOT, "cc", "**", "*.*"), recursive=True):
        if os.sep + "testing" + os.sep in path or not path.endswith((".cc", ".cu", ".h", ".cuh")):
            continue
        assert "getenv" not in open(path).read(), f"{path} reads the environment"


def _calls(text):
    """(target, operands, results, attribute names) of every jax_ep custom call."""
    out = []
    for m in re.finditer(r"stablehlo\.custom_call @(jax_ep_\w+)\(([^)]*)\)(.*)", text):
        ops = [o for o in m.group(2).split(",") if o.strip()]
        cfg = re.search(r"mhlo\.backend_config = \{(.*?)\}, operand_layouts", m.group(3))
        attrs = frozenset(re.findall(r"(\w+) = ", cfg.group(1))) if cfg else frozenset()
        sig = m.group(3).rsplit("->", 1)[1]
        n_res = sig.count("tensor<") if sig.strip().startswith("(") else 1
        out.append((m.group(1), len(ops), n_res, attrs))
    return out


def _assert_binds(target, n_ops, n_res, attrs, bound):
    b_ops, b_res, b_attrs = bound
    ops_ok = n_ops >= b_ops[0] if isinstance(b_ops, tuple) else n_ops == b_ops
    assert ops_ok and (n_res, attrs) == (b_res, b_attrs), (
        f"{target}: lowered with {n_ops} operands, {n_res} results, attributes "
        f"{sorted(attrs)}; cc binds {b_ops}, {b_res}, {sorted(b_attrs)}")


def _native_runs(monkeypatch, *families):
    """The native backends of ``families`` run here (as if the runtime were up);
    CPU devices act as one "process" each."""
    monkeypatch.setattr(_ffi, "pe_of_device", lambda d: d.id)
    for f in families:
        monkeypatch.setattr(type(f.native), "unavailable", lambda self, cfg: None)


@pytest.fixture
def native_everywhere(monkeypatch):
    _native_runs(monkeypatch, backend.INTRANODE, backend.INTERNODE)


REMAT = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 11)


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
@pytest.mark.parametrize("variant", ["bf16", "fp8", "fp8_ue8m0", "remat"])
def test_native_calls_match_cc_bindings(native_everywhere, layout, variant):
    if variant == "remat" and not REMAT:
        pytest.skip("jax 0.10 refuses remat of FFI calls with side effects")
    mesh = make_mesh((2, 4), ("data", "ep"))
    T, H, K, E = 4, 128, 2, 8
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, layout=layout,
                          backend="native", expert_alignment=2 if layout == "expert_major" else 1,
                          fp8_dispatch=variant.startswith("fp8"),
                          fp8_scale_format="ue8m0" if variant == "fp8_ue8m0" else "f32")

    def layer(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, cfg)
        y = d.x.astype(jnp.float32) * 2.0
        if layout == "rank_major":
            y = y * jnp.sum(d.topk_weights, axis=1, keepdims=True)
        return jax_ep.combine(y.astype(x.dtype), d, cfg), jax_ep.get_dispatch_layout(idx, cfg)[0]

    tok = P(("data", "ep"))
    body = jax.checkpoint(layer) if variant == "remat" else layer
    f = jax.shard_map(body, mesh=mesh, in_specs=(tok,) * 3, out_specs=(tok, tok))
    x = np.random.rand(32, H).astype(np.float32)
    idx = np.random.randint(0, E, (32, K)).astype(np.int32)
    w = np.random.rand(32, K).astype(np.float32)
    def loss(x, w):
        out, counts = f(x, idx, w)
        return jnp.sum(out) + jnp.sum(counts).astype(jnp.float32)

    # fp8 dispatch too: its gradient is straight-through (semantics §8)
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    if variant.startswith("fp8"):
        want_mode = abi.fp8_scale_mode("ue8m0" if variant == "fp8_ue8m0" else "xla_gpu")
        assert re.search(rf"fp8_scale_mode = {want_mode} : i32", text), "fp8_scale_mode"
    binds = _bindings()
    calls = _calls(text)
    names = {c[0] for c in calls}
    want = {"jax_ep_dispatch", "jax_ep_combine", "jax_ep_layout"}
    want.add("jax_ep_combine_bwd" if layout == "expert_major" else "jax_ep_dispatch")
    assert want <= names, names
    for target, n_ops, n_res, attrs in calls:
        assert target in binds, f"{target} is not in cc/ffi_targets.h"
        _assert_binds(target, n_ops, n_res, attrs, binds[target])


def _lower_round_trip(cfg_kw, grad):
    """StableHLO text of dispatch -> combine on a (data 2, ep 4) mesh of CPU
    devices (T 4, H 128, K 2, E 8; EpConfig fields ``cfg_kw``), with
    ``jax.grad`` through it when ``grad``."""
    mesh = make_mesh((2, 4), ("data", "ep"))
    T, H, K, E = 4, 128, 2, 8
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H, **cfg_kw)

    def layer(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, cfg)
        return jax_ep.combine((d.x.astype(jnp.float32) * 2.0).astype(x.dtype), d, cfg)

    tok = P(("data", "ep"))
    f = jax.shard_map(layer, mesh=mesh, in_specs=(tok,) * 3, out_specs=tok)
    x = np.random.rand(32, H).astype(np.float32)
    idx = np.random.randint(0, E, (32, K)).astype(np.int32)
    w = np.random.rand(32, K).astype(np.float32)
    if not grad:
        return jax.jit(f).lower(x, idx, w).as_text()
    return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, idx, w)), argnums=(0, 1))).lower(
        x, w).as_text()


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b", "c", "c", "d", "d"], ["h"] * 8])
def test_ep_group_across_hosts_takes_the_internode_kernels(native_everywhere, monkeypatch,
                                                           hosts):
    """EpConfig.num_nodes 1 (the default) and an EP group of 4 ranks on hosts of
    2 PEs: the internode targets with nodes = 2, chosen at trace time (the
    lowering's host check passes: each node is one host); on one host the
    intranode targets."""
    from jax_ep import runtime

    monkeypatch.setattr(runtime, "pe_hosts", lambda: hosts)
    text = _lower_round_trip(dict(backend="native"), grad=True)
    names = {c[0] for c in _calls(text)}
    if len(set(hosts)) > 1:
        assert {"jax_ep_internode_dispatch", "jax_ep_internode_combine"} <= names, names
        assert not names & {"jax_ep_dispatch", "jax_ep_combine", "jax_ep_combine_bwd"}, names
        assert re.search(r"nodes = 2 : i32", text)
    else:
        assert {"jax_ep_dispatch", "jax_ep_combine", "jax_ep_combine_bwd"} <= names, names
        assert not any(n.startswith("jax_ep_internode") for n in names), names


@pytest.mark.parametrize("net", ["auto", "p2p"])
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_internode_calls_match_cc_bindings(native_everywhere, layout, variant, net):
    """EpConfig.num_nodes > 1 lowers to the internode targets only (2 nodes x 2
    ranks on an EP axis of 4), with their bindings, each carrying
    EpConfig.net_transport as its abi code; the expert_major backward is the
    internode dispatch (no fused combine_bwd)."""
    text = _lower_round_trip(dict(layout=layout, backend="native", num_nodes=2, num_sms=7,
                                  fp8_dispatch=variant == "fp8", net_transport=net),
                             grad=variant != "fp8")
    binds = _bindings()
    calls = _calls(text)
    names = {c[0] for c in calls}
    assert {"jax_ep_internode_dispatch", "jax_ep_internode_combine"} <= names, names
    assert not names & {"jax_ep_dispatch", "jax_ep_combine", "jax_ep_combine_bwd"}, names
    if variant == "bf16":  # forward dispatch + combine's backward; combine + dispatch's backward
        assert sum(c[0] == "jax_ep_internode_dispatch" for c in calls) == 2
        assert sum(c[0] == "jax_ep_internode_combine" for c in calls) == 2
    assert re.search(r"nodes = 2 : i32", text) and re.search(r"num_sms = 7 : i32", text)
    for target, n_ops, n_res, attrs in calls:
        assert "net_transport" in binds[target][2], target
        _assert_binds(target, n_ops, n_res, attrs, binds[target])
    code = abi.net_transport(net)
    assert len(re.findall(rf"net_transport = {code} : i32", text)) == len(calls)


def test_internode_put_lowers_with_nvshmem_and_is_refused_without(native_everywhere,
                                                                  monkeypatch):
    """net_transport="put" lowers with its code under NVSHMEM and is refused at
    trace time under the peer-memory runtime (no PEs), naming the way out."""
    from jax_ep import runtime

    mesh = make_mesh((2, 4), ("data", "ep"))
    cfg = jax_ep.EpConfig(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=128,
                          backend="native", num_nodes=2, net_transport="put")
    x = np.ones((32, 128), np.float32)
    idx = np.zeros((32, 2), np.int32)
    w = np.ones((32, 2), np.float32)

    def lower():  # a new function each time: no trace cache between the two
        f = jax.shard_map(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg).x, mesh=mesh,
                          in_specs=(P(("data", "ep")),) * 3, out_specs=P(("data", "ep")))
        return jax.jit(f).lower(x, idx, w).as_text()

    monkeypatch.setattr(runtime, "symmetric_memory", lambda: "nvshmem")
    assert re.search(rf"net_transport = {abi.net_transport('put')} : i32", lower())
    monkeypatch.setattr(runtime, "symmetric_memory", lambda: "peer_memory")
    with pytest.raises(ValueError, match="net_transport='put' needs the NVSHMEM transport"):
        lower()


def _lower_low_latency(cfg_kw, fp8):
    """StableHLO text of low_latency_dispatch -> low_latency_combine on a
    (data 2, ep 4) mesh of CPU devices (T 4, H 128, K 2, E 8; EpConfig fields
    ``cfg_kw``, the native backend)."""
    mesh = make_mesh((2, 4), ("data", "ep"))
    T, H, K, E = 4, 128, 2, 8
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                          backend="native", **cfg_kw)

    def step(x, idx, w):
        d = jax_ep.low_latency_dispatch(x, idx, cfg, fp8=fp8)
        y = d.x.astype(jnp.bfloat16)
        return jax_ep.low_latency_combine(y, idx, w, d.handle, cfg)

    tok = P(("data", "ep"))
    f = jax.shard_map(step, mesh=mesh, in_specs=(tok,) * 3, out_specs=tok)
    x = np.random.rand(32, H).astype(jnp.bfloat16)
    idx = np.random.randint(0, E, (32, K)).astype(np.int32)
    w = np.random.rand(32, K).astype(np.float32)
    return jax.jit(f).lower(x, idx, w).as_text()


@pytest.mark.parametrize("transport", ["auto", "p2p", "put"])
@pytest.mark.parametrize("fp8", [True, False])
def test_low_latency_calls_match_cc_bindings(monkeypatch, transport, fp8):
    """The four low-latency targets (send and receive of dispatch and combine)
    lower with their bindings, and each carries EpConfig.ll_transport as its
    abi code in the ll_transport attribute."""
    _native_runs(monkeypatch, backend.LOW_LATENCY)
    text = _lower_low_latency(dict(ll_transport=transport), fp8)
    binds = _bindings()
    calls = _calls(text)
    ll_targets = {"jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send",
                  "jax_ep_ll_combine_recv"}
    assert {c[0] for c in calls} == ll_targets, calls
    for target, n_ops, n_res, attrs in calls:
        assert "ll_transport" in binds[target][2], target
        _assert_binds(target, n_ops, n_res, attrs, binds[target])
    code = abi.ll_transport(transport)
    assert len(re.findall(rf"ll_transport = {code} : i32", text)) == len(calls) == 4


def test_low_latency_after_is_an_operand_of_the_send(monkeypatch):
    """Two micro-batches of one op (examples/decode_overlap.py): the second
    send takes the first receive's outputs as operands (a buffer read), so a
    command buffer that orders its graph by buffer uses alone keeps the send
    after that receive. An optimization barrier there left the send free to
    run first: kErrLlOrder on a GPU ("a low-latency send ran before the
    previous receive of the same op")."""
    _native_runs(monkeypatch, backend.LOW_LATENCY)
    mesh = make_mesh((4,), ("ep",))
    T, H, K, E = 4, 128, 2, 8
    cfg = jax_ep.EpConfig(num_experts=E, topk=K, max_tokens_per_rank=T, hidden=H,
                          backend="native")

    def step(xa, xb, idx, w):
        sa = jax_ep.low_latency_dispatch_send(xa, idx, cfg)
        da = jax_ep.low_latency_dispatch_recv(sa)
        sb = jax_ep.low_latency_dispatch_send(xb, idx, cfg, after=da.count)
        db = jax_ep.low_latency_dispatch_recv(sb)
        ca = jax_ep.low_latency_combine_send(da.x.astype(jnp.bfloat16), idx, w, da.handle, cfg)
        oa = jax_ep.low_latency_combine_recv(ca)
        cb = jax_ep.low_latency_combine_send(db.x.astype(jnp.bfloat16), idx, w, db.handle, cfg,
                                             after=oa)
        return oa + jax_ep.low_latency_combine_recv(cb)

    tok = P("ep")
    f = jax.shard_map(step, mesh=mesh, in_specs=(tok,) * 4, out_specs=tok)
    x = np.random.rand(4 * T, H).astype(jnp.bfloat16)
    idx = np.random.randint(0, E, (4 * T, K)).astype(np.int32)
    w = np.random.rand(4 * T, K).astype(np.float32)
    text = jax.jit(f).lower(x, x, idx, w).as_text()
    lines = {}   # target -> [(operand names, result names)] in program order
    for m in re.finditer(r"^\s*(%[\w#:, %]+?) = stablehlo\.custom_call @(jax_ep_ll_\w+)\(([^)]*)\)",
                         text, re.M):
        res = {r.split("#")[0].split(":")[0].strip() for r in m.group(1).split(",")}
        ops = {o.strip().split("#")[0] for o in m.group(3).split(",") if o.strip()}
        lines.setdefault(m.group(2), []).append((ops, res))
    (_, recv_a), _ = lines["jax_ep_ll_dispatch_recv"]
    _, (send_b_ops, _) = lines["jax_ep_ll_dispatch_send"]
    assert send_b_ops & recv_a, ("the second dispatch send reads none of the first receive's "
                                 f"results {sorted(recv_a)}: {sorted(send_b_ops)}")
    (_, crecv_a), _ = lines["jax_ep_ll_combine_recv"]
    _, (csend_b_ops, _) = lines["jax_ep_ll_combine_send"]
    assert csend_b_ops & crecv_a, (sorted(crecv_a), sorted(csend_b_ops))


def test_low_latency_put_needs_nvshmem(monkeypatch):
    """ll_transport="put" under the peer-memory runtime (no PEs) is refused at
    trace time, with the way out in the message."""
    from jax_ep import runtime

    _native_runs(monkeypatch, backend.LOW_LATENCY)
    monkeypatch.setattr(runtime, "symmetric_memory", lambda: "peer_memory")
    mesh = make_mesh((4,), ("ep",))
    cfg = jax_ep.EpConfig(num_experts=8, topk=2, max_tokens_per_rank=4, hidden=128,
                          backend="native", ll_transport="put")
    f = jax.shard_map(lambda x, i: jax_ep.low_latency_dispatch(x, i, cfg).count, mesh=mesh,
                      in_specs=(P("ep"),) * 2, out_specs=P("ep"))
    x = np.ones((16, 128), jnp.bfloat16)
    idx = np.zeros((16, 2), np.int32)
    with pytest.raises(ValueError, match="ll_transport='put' needs the NVSHMEM transport"):
        jax.jit(f).lower(x, idx)


@pytest.mark.parametrize("groups", [None, ((0, 2), (1, 3))], ids=["axis", "groups"])
def test_ragged_calls_match_cc_binding(monkeypatch, groups):
    """jax_ep.ragged_all_to_all's forward and backward lower to
    jax_ep_ragged_all_to_all with its binding, ``output`` aliased to the
    result, RaggedConfig's transport / num_sms as attributes, and the EP group
    rows of the ("data", "ep") mesh narrowed to axis_index_groups."""
    _native_runs(monkeypatch, backend.RAGGED)
    R = 2 if groups else 4
    text = _lower_ragged(jax_ep.RaggedConfig(backend="native", transport="put", num_sms=5),
                         groups)
    calls = [c for c in _calls(text) if c[0] == "jax_ep_ragged_all_to_all"]
    assert len(calls) == 2, _calls(text)           # forward, and the backward's return
    for target, n_ops, n_res, attrs in calls:
        _assert_binds(target, n_ops, n_res, attrs, _bindings()[target])
    assert len(re.findall(r"operand_index = 1", text)) == 2
    assert len(re.findall(rf"transport = {abi.ll_transport('put')} : i32", text)) == 2
    assert len(re.findall(r"num_sms = 5 : i32", text)) == 2
    rows = [[0, 1, 2, 3], [4, 5, 6, 7]]             # device ids of the two "ep" rows
    want = [[row[i] for i in g] for row in rows for g in groups] if groups else rows
    flat = ", ".join(str(v) for r in want for v in r)
    assert f"ep_groups = dense<[{flat}]>" in text and f"num_ranks = {R} : i32" in text


# The targets whose kernels wait for a peer's signal: each binds the int64
# attribute timeout_ns (peer_timeout_s in ns). The low-latency sends never wait.
WAITING_TARGETS = {"jax_ep_dispatch", "jax_ep_combine", "jax_ep_combine_bwd",
                   "jax_ep_internode_dispatch", "jax_ep_internode_combine",
                   "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_recv",
                   "jax_ep_ragged_all_to_all"}


def test_waiting_targets_bind_timeout_ns():
    """Exactly the targets whose kernels wait for peers bind ``timeout_ns``, as
    an int64, and peer_timeout_s's default is the kernels' kDefaultTimeoutNs."""
    binds = _bindings()
    assert {n for n, (_, _, attrs) in binds.items() if "timeout_ns" in attrs} == WAITING_TARGETS
    types = []
    for path in glob.glob(os.path.join(ROOT, "cc", "**", "ffi_*.cc"), recursive=True):
        types += re.findall(r'\.Attr<([^>]*)>\("timeout_ns"\)', open(path).read())
    assert types == ["int64_t"] * len(WAITING_TARGETS), types
    header = open(os.path.join(ROOT, "cc", "common", "device_error.h")).read()
    factors = re.search(r"kDefaultTimeoutNs = ([\d\s*ul]+);", header).group(1)
    default_ns = int(np.prod([int(f.strip().rstrip("ul")) for f in factors.split("*")]))
    for cfg in (jax_ep.KernelTuning(), jax_ep.RaggedConfig()):
        assert cfg.peer_timeout_s * 1e9 == default_ns, (cfg, default_ns)


def _lower_ragged(cfg, groups=None):
    """StableHLO text of jax_ep.ragged_all_to_all's forward and backward over
    "ep" of a (data 2, ep 4) mesh of CPU devices (R = 4, or the
    ``axis_index_groups`` ``groups``), RaggedConfig ``cfg``."""
    mesh = make_mesh((2, 4), ("data", "ep"))
    R = len(groups[0]) if groups else 4
    tok = P(("data", "ep"))

    def body(op, out, io, ss, oo, rs):
        return jax_ep.ragged_all_to_all(op, out, io, ss, oo, rs, axis_name="ep",
                                        axis_index_groups=groups, config=cfg)

    f = jax.shard_map(body, mesh=mesh, in_specs=(tok,) * 6, out_specs=tok)
    ints = [np.zeros((8 * R,), np.int32) for _ in range(4)]
    loss = lambda op, out: jnp.sum(f(op, out, *ints))
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
        np.ones((8 * 3, 2), np.float32), np.ones((8 * 5, 2), np.float32)).as_text()


def _lower_family(monkeypatch, family, peer_timeout_s):
    """StableHLO text of ``family``'s native calls with peer_timeout_s (None:
    the default) in its config."""
    kw = {} if peer_timeout_s is None else dict(peer_timeout_s=peer_timeout_s)
    if family == "ragged":
        _native_runs(monkeypatch, backend.RAGGED)
        return _lower_ragged(jax_ep.RaggedConfig(backend="native", **kw))
    tuning = jax_ep.KernelTuning(**kw)
    if family == "low_latency":
        _native_runs(monkeypatch, backend.LOW_LATENCY)
        return _lower_low_latency(dict(tuning=tuning), fp8=False)
    _native_runs(monkeypatch, backend.INTRANODE, backend.INTERNODE)
    nodes = dict(num_nodes=2) if family == "internode" else {}
    return _lower_round_trip(dict(backend="native", tuning=tuning, **nodes), grad=True)


@pytest.mark.parametrize("peer_timeout_s,want_ns", [(None, 10_000_000_000),
                                                    (2.5, 2_500_000_000), (100, 10**11)])
@pytest.mark.parametrize("family", ["intranode", "internode", "low_latency", "ragged"])
def test_timeout_ns_follows_peer_timeout_s(monkeypatch, family, peer_timeout_s, want_ns):
    """Every call of a waiting target carries ``timeout_ns`` = the config's
    peer_timeout_s in ns (KernelTuning for the EpConfig families and low
    latency, RaggedConfig for ragged; 10 s by default), and no other call
    carries one."""
    text = _lower_family(monkeypatch, family, peer_timeout_s)
    calls = _calls(text)
    waiting = [c for c in calls if c[0] in WAITING_TARGETS]
    assert waiting, calls
    for target, _, _, attrs in calls:
        assert ("timeout_ns" in attrs) == (target in WAITING_TARGETS), (target, sorted(attrs))
    assert len(re.findall(r"timeout_ns = ", text)) == len(waiting)
    assert len(re.findall(rf"timeout_ns = {want_ns} : i64", text)) == len(waiting), (
        sorted(set(re.findall(r"timeout_ns = [^,}]*", text))))
