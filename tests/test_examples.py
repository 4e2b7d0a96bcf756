"""The examples: the DeepSeek-V3-style MoE block through jax_ep equals its dense
(no-EP) twin in value and gradient, and the training example learns."""
from __future__ import annotations

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import moe_layer as ml  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")


def _tree_close(a, b, rtol, atol):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for (path, x), y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        scale = max(1.0, float(np.abs(y).max()))
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol * scale,
                                   err_msg=jax.tree_util.keystr(path))


CASES = {
    # V3: sigmoid, group-limited (4 groups, best 2), bias, routed scale, shared expert
    "v3_sigmoid_groups": dict(cfg=dict(num_experts=8, topk=3, n_groups=4, topk_groups=2,
                                       score_func="sigmoid", route_scale=2.5, n_shared=1),
                              mesh=(2, 4), bias=True),
    # V2-like: softmax, no groups, no renormalisation, no shared expert, ep over all 8
    "softmax_no_shared": dict(cfg=dict(num_experts=16, topk=2, score_func="softmax",
                                       norm_topk_prob=False, n_shared=0),
                              mesh=(1, 8), bias=False),
    # the same V3 layer with the padded (batched einsum) expert implementation
    "v3_padded_experts": dict(cfg=dict(num_experts=8, topk=3, n_groups=4, topk_groups=2,
                                       score_func="sigmoid", route_scale=2.5, n_shared=1),
                              mesh=(2, 4), bias=True, impl="padded"),
    # ... and with XLA's jax.lax.ragged_dot
    "v3_ragged_dot_experts": dict(cfg=dict(num_experts=8, topk=3, n_groups=4, topk_groups=2,
                                           score_func="sigmoid", route_scale=2.5, n_shared=1),
                                  mesh=(2, 4), bias=True, impl="ragged_dot"),
    # Mixtral-like: softmax top-2 of 8, renormalised, no groups, no shared expert,
    # L = 2 experts per rank
    "mixtral_like": dict(cfg=dict(num_experts=8, topk=2, score_func="softmax", n_shared=0),
                         mesh=(2, 4), bias=False),
}


def _nan_tail_dispatch(orig):
    """jax_ep.dispatch whose rows past sum(group_sizes) are NaN (the native kernels
    leave that tail unwritten): the layer must never read them."""
    import dataclasses

    def dispatch(x, idx, w, cfg, *a, **k):
        d = orig(x, idx, w, cfg, *a, **k)
        tail = jnp.arange(d.x.shape[0]) >= jnp.sum(d.group_sizes)
        return dataclasses.replace(
            d, x=jnp.where(tail[:, None], jnp.array(jnp.nan, d.x.dtype), d.x))
    return dispatch


@pytest.mark.slow
@pytest.mark.parametrize("nan_tail", [False, True], ids=["clean", "nan_tail"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_block_matches_dense(case, nan_tail, monkeypatch):
    c = CASES[case]
    if nan_tail:
        if case not in ("v3_sigmoid_groups", "v3_padded_experts", "v3_ragged_dot_experts"):
            pytest.skip("one config per expert_impl")
        monkeypatch.setattr(ml.jax_ep, "dispatch", _nan_tail_dispatch(ml.jax_ep.dispatch))
    cfg = ml.MoEConfig(d_model=32, d_ff=16, **c["cfg"])
    mesh = ml.make_mesh(c["mesh"], ("data", "ep"))
    params = ml.init_moe_params(jax.random.key(0), cfg)
    bias = (0.1 * jax.random.normal(jax.random.key(2), (cfg.num_experts,))
            if c["bias"] else ml.init_routing_bias(cfg))
    x = jax.random.normal(jax.random.key(1), (4, 16, 32), jnp.float32)
    ct = jax.random.normal(jax.random.key(3), x.shape, jnp.float32)  # output cotangent

    def loss_ep(p, x):
        out, aux = ml.moe_block(p, bias, x, cfg, mesh, backend="reference",
                                expert_impl=c.get("impl", "grouped"))
        return jnp.sum(out * ct), (out, aux)

    def loss_dense(p, x):
        out, aux = ml.moe_block_dense(p, bias, x, cfg)
        return jnp.sum(out * ct), (out, aux)

    (_, (o1, a1)), g1 = jax.jit(jax.value_and_grad(loss_ep, (0, 1), has_aux=True))(
        ml.shard_params(params, mesh), x)
    (_, (o2, a2)), g2 = jax.jit(jax.value_and_grad(loss_dense, (0, 1), has_aux=True))(params, x)

    assert int(a1["num_dropped"]) == 0
    np.testing.assert_array_equal(np.asarray(a1["load"]), np.asarray(a2["load"]))
    assert int(a1["load"].sum()) == x.shape[0] * x.shape[1] * cfg.topk
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), rtol=1e-5, atol=1e-5)
    _tree_close(g1, g2, rtol=1e-5, atol=2e-6)
    # every parameter gets a gradient (router included, through the routing weights)
    for leaf in jax.tree.leaves(g1[0]):
        assert float(jnp.abs(leaf).max()) > 0


@pytest.mark.slow
def test_moe_block_fp8_near_dense():
    """expert_impl="grouped_fp8" (fp8 dispatch, fp8 grouped matmuls with the
    weights quantized in the step, bf16 combine) stays near the dense f32
    layer in value and gradient, and every parameter gets a gradient."""
    cfg = ml.MoEConfig(d_model=128, d_ff=128, num_experts=8, topk=3, n_groups=4, topk_groups=2,
                       score_func="sigmoid", route_scale=2.5, n_shared=1)
    mesh = ml.make_mesh((2, 4), ("data", "ep"))
    params = ml.init_moe_params(jax.random.key(0), cfg)
    bias = ml.init_routing_bias(cfg)
    x = jax.random.normal(jax.random.key(1), (4, 16, 128), jnp.float32)
    ct = jax.random.normal(jax.random.key(3), x.shape, jnp.float32)

    def loss(p, x, fp8):
        out, _ = (ml.moe_block(p, bias, x, cfg, mesh, backend="reference",
                               expert_impl="grouped_fp8") if fp8
                  else ml.moe_block_dense(p, bias, x, cfg))
        return jnp.sum(out * ct), out

    (_, o8), g8 = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, True), (0, 1),
                                             has_aux=True))(ml.shard_params(params, mesh), x)
    (_, o), g = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, False), (0, 1),
                                           has_aux=True))(params, x)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    # e4m3 keeps 3 mantissa bits (~2.5% RMS per cast) and the routed path casts
    # four times (x, gate_up, h, down): ~5% normwise measured, in value and gradient
    assert rel(o8, o) < 0.08, rel(o8, o)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g8), jax.tree.leaves(g)):
        assert float(jnp.abs(a).max()) > 0, jax.tree_util.keystr(path)
        assert rel(a, b) < 0.1, (jax.tree_util.keystr(path), rel(a, b))


def test_moe_block_fp8_with_experts_quantized_earlier():
    """moe_block(experts_fp8=quantize_experts(...)) on an (data, ep) mesh: the
    same value and gradients, bit for bit, as quantizing in the step."""
    cfg = ml.MoEConfig(d_model=128, d_ff=128, num_experts=8, topk=3, n_groups=4, topk_groups=2,
                       score_func="sigmoid", route_scale=2.5, n_shared=0)
    mesh = ml.make_mesh((2, 4), ("data", "ep"))
    params = ml.shard_params(ml.init_moe_params(jax.random.key(0), cfg), mesh)
    bias = ml.init_routing_bias(cfg)
    x = jax.random.normal(jax.random.key(1), (4, 16, 128), jnp.float32)

    def loss(p, fp8):
        out, _ = ml.moe_block(p, bias, x, cfg, mesh, backend="reference",
                              expert_impl="grouped_fp8", experts_fp8=fp8)
        return jnp.sum(out * out)

    grad = jax.jit(jax.value_and_grad(loss))
    here = grad(params, None)
    cache = jax.jit(ml.quantize_experts)(params["experts"])
    earlier = grad(params, cache)
    for a, b in zip(jax.tree.leaves(here), jax.tree.leaves(earlier)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="experts_fp8 .* is for expert_impl='grouped_fp8'"):
        ml.moe_block(params, bias, x, cfg, mesh, backend="reference", expert_impl="grouped",
                     experts_fp8=cache)


@pytest.mark.slow
def test_fused_gate_up(monkeypatch):
    """gate_up [E, H, 2F] holds gate | up; the grouped path runs ONE grouped matmul for both."""
    cfg = ml.MoEConfig(d_model=6, d_ff=4, num_experts=4, topk=2, n_shared=2)
    p = ml.init_moe_params(jax.random.key(0), cfg)
    assert jax.tree.map(jnp.shape, p["experts"]) == {"gate_up": (4, 6, 8), "down": (4, 4, 6)}
    assert jax.tree.map(jnp.shape, p["shared"]) == {"gate_up": (6, 16), "down": (8, 6)}
    x = jax.random.normal(jax.random.key(1), (12, 6))
    gs = jnp.array([3, 0, 5, 2], jnp.int32)  # 10 of 12 rows; the last 2 are tail
    gu, down = p["experts"]["gate_up"], p["experts"]["down"]
    starts = np.cumsum([0, 3, 0, 5])
    want = np.zeros((12, 6), np.float32)
    for e, (s0, n) in enumerate(zip(starts, np.asarray(gs))):
        xe = x[s0:s0 + n]
        want[s0:s0 + n] = (jax.nn.silu(xe @ gu[e, :, :4]) * (xe @ gu[e, :, 4:])) @ down[e]
    widths = []

    def counting(x, w, g, **k):
        widths.append(w.shape[-1])
        return jax.lax.ragged_dot(x, w, g)
    monkeypatch.setattr(ml, "grouped_matmul", counting)
    got = ml.routed_experts_grouped(ml.mask_tail_rows(x, gs), gu, down, gs)
    assert widths == [8, 6]  # gate_up (2F) then down (H)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    for impl in ("ragged_dot", "padded"):
        y, dropped = ml.routed_experts(x, gu, down, gs, impl)
        assert int(dropped) == 0
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_router_group_limit_and_bias():
    cfg = ml.MoEConfig(d_model=8, d_ff=4, num_experts=8, topk=2, n_groups=4, topk_groups=1)
    params = ml.init_moe_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (64, 8))
    route = jax.jit(lambda p, b, x: ml.route(p, b, x, cfg))
    idx, w, _ = route(params, ml.init_routing_bias(cfg), x)
    assert np.all(np.asarray(idx[:, 0]) // 2 == np.asarray(idx[:, 1]) // 2)  # one group
    np.testing.assert_allclose(np.asarray(w.sum(1)), 1.0, rtol=1e-6)
    # a large bias on expert 5 makes every token select it, the weight stays the raw score
    bias = jnp.zeros((8,)).at[5].set(100.0)
    idx_b, w_b, scores = route(params, bias, x)
    assert np.all(np.any(np.asarray(idx_b) == 5, axis=1))
    raw = jnp.take_along_axis(scores, idx_b, 1)
    np.testing.assert_allclose(np.asarray(w_b), np.asarray(raw / raw.sum(1, keepdims=True)),
                               rtol=1e-6)
    # the update rule lowers the bias of over-loaded experts and raises the others
    load = jnp.array([10, 0, 0, 0, 0, 30, 0, 0])
    nb = ml.update_routing_bias(jnp.zeros((8,)), load, 0.01)
    assert float(nb[5]) < 0 and float(nb[0]) < 0 and float(nb[1]) > 0


@pytest.mark.slow
def test_training_example_learns():
    import train_moe

    args = train_moe.parse_args(["--steps", "30", "--batch", "16", "--no-comm-timing"])
    res = train_moe.train(args, verbose=False)
    assert res["finite"]  # every gradient of every step
    assert all(np.isfinite(res["losses"]))
    end = float(np.mean(res["losses"][-5:]))
    assert end < res["first_loss"] - 0.5, (res["first_loss"], res["losses"][-5:])
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(res["params"]))


@pytest.mark.slow
def test_training_example_fp8_tracks_bf16():
    """--fp8 (fp8 dispatch -> fp8 grouped matmuls -> bf16 combine, the reference
    path on CPU) trains, its loss within 3% of the bf16 run's at each of the
    first 12 steps (the tolerance examples/train_moe.py states), with the
    weight gradients in bf16 and in fp8 (--fp8-dw)."""
    import train_moe

    base = ["--steps", "12", "--batch", "16", "--no-comm-timing", "--dtype", "bfloat16",
            "--d-model", "128", "--d-ff", "128"]
    bf16 = train_moe.train(train_moe.parse_args(base), verbose=False)
    a = np.asarray(bf16["losses"])
    for extra in ([], ["--fp8-dw"]):
        fp8 = train_moe.train(train_moe.parse_args(base + ["--fp8"] + extra), verbose=False)
        assert bf16["finite"] and fp8["finite"]
        b = np.asarray(fp8["losses"])
        assert np.all(np.abs(b - a) <= 0.03 * a), (extra, np.abs(b - a) / a)
        assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(fp8["params"]))


def test_training_example_fp8_arguments():
    import train_moe

    args = train_moe.parse_args(["--fp8"])
    assert (args.experts_impl, args.d_model, args.d_ff) == ("grouped_fp8", 128, 128)
    assert (train_moe.parse_args([]).d_model, train_moe.parse_args([]).d_ff) == (64, 64)
    for bad in (["--fp8", "--d-model", "64"], ["--fp8", "--experts-impl", "padded"],
                ["--fp8-dw"], ["--fp8-kernel", "cuda"]):
        with pytest.raises(SystemExit):
            train_moe.parse_args(bad)
    cfg = train_moe.gmm_config(train_moe.parse_args(["--fp8", "--fp8-dw", "--fp8-kernel", "cuda"]))
    assert (cfg.fp8_dw, cfg.fp8_kernel) == (True, "cuda")
    assert train_moe.gmm_config(train_moe.parse_args([])) is None


def _layer_bench(tmp_path, *args):
    """bench/moe_layer_step.py --smoke on CPU with tiny shapes and ``args``:
    its JSON result and the rows by impl."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_EP_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "moe_layer_step.py"), "--smoke",
           "--tokens", "16", *args, "--steps", "1,2", "--comm-steps", "1,2",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "moe_layer_step.json") as f:
        res = json.load(f)
    return res, {r["impl"]: r for r in res["results"]}


@pytest.mark.slow
def test_layer_bench_smoke(tmp_path):
    """bench/moe_layer_step.py on CPU with tiny shapes: one job per impl, one table."""
    res, rows = _layer_bench(tmp_path, "--impls", "jax_ep,xla_padded", "--expert-breakdown")
    assert set(rows) == {"jax_ep", "xla_padded"}
    for r in rows.values():
        assert not r.get("error") and not r.get("stage_error"), r
        assert all(k in r for k in ("layer_s", "comm_s", "experts_s", "rest_s")), r
        assert r["dropped"] == 0
    # the same layer on the same data: equal losses whatever the expert matmuls
    np.testing.assert_allclose([r["loss"] for r in rows.values()], rows["xla_padded"]["loss"],
                               rtol=2e-2)
    table = (tmp_path / "moe_layer_step.md").read_text()
    assert "| tiny | 16 | jax_ep |" in table and "**baseline**" in table
    assert res["summary"][0]["baseline"] == "xla_padded"
    # --expert-breakdown: the grouped-matmul job only, every piece timed, routing stats
    bd = rows["jax_ep"]["breakdown"]
    assert [(o["part"], o["op"]) for o in bd["ops"]][:6] == [
        (p, op) for op in ("fwd", "dx", "dw") for p in ("gate_up", "down")]
    assert len(bd["ops"]) == 9 and "parts_ms" in bd and "breakdown" not in rows["xla_padded"]
    # R * T * K routed rows plus the padding of groups aligned to 64 (grouped default)
    assert sum(g["valid_rows"] for g in bd["group_stats"]) >= 2 * 16 * 2
    assert "## Expert breakdown" in table


@pytest.mark.slow
def test_layer_bench_fp8_smoke(tmp_path):
    """bench/moe_layer_step.py's fp8 rows (weights quantized in the step, and
    once outside it) beside the bf16 jax_ep row: all run, the same layer's
    losses agree to fp8's precision (the two fp8 rows exactly), the summary
    compares both with bf16."""
    _, rows = _layer_bench(tmp_path, "--impls", "jax_ep,jax_ep_fp8,jax_ep_fp8_wq", "--hidden",
                           "128", "--d-ff", "128")
    assert set(rows) == {"jax_ep", "jax_ep_fp8", "jax_ep_fp8_wq"}
    for r in rows.values():
        assert not r.get("error") and not r.get("stage_error"), r
        assert all(k in r for k in ("layer_s", "comm_s", "experts_s")), r
    np.testing.assert_allclose(rows["jax_ep_fp8"]["loss"], rows["jax_ep"]["loss"], rtol=5e-2)
    assert rows["jax_ep_fp8_wq"]["loss"] == rows["jax_ep_fp8"]["loss"]
    table = (tmp_path / "moe_layer_step.md").read_text()
    assert "jax_ep_fp8 " in table and "jax_ep_fp8_wq " in table
    assert table.count("x** jax_ep's bf16 layer") == 2


def test_multinode_model_smoke(tmp_path):
    """bench/multinode_model.py runs and its routing model keeps DeepSeek-V3's
    group limit: at 8 nodes a group-limited token reaches at most 4 nodes."""
    import importlib.util
    import os

    import numpy as np

    path = os.path.join(os.path.dirname(__file__), "..", "bench", "multinode_model.py")
    spec = importlib.util.spec_from_file_location("multinode_model", path)
    mm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mm)
    idx = mm.route(np.random.default_rng(0), 256, limited=True)
    nodes = idx // (mm.E // (8 * mm.GPUS)) // mm.GPUS
    assert max(len(set(r)) for r in nodes.tolist()) <= mm.TOPK_GROUPS
    assert all(len(set(r)) == mm.K for r in idx.tolist())
    rn, rp, nvl = mm.traffic(np.random.default_rng(1), 2, 256, limited=False)
    assert 0.9 < rn <= 1.0 and 3.0 < rp < 5.0 and nvl > 0
    import sys
    old = sys.argv
    sys.argv = ["multinode_model.py", "--samples", "64", "--out", str(tmp_path)]
    try:
        assert mm.main() == 0
    finally:
        sys.argv = old
    assert "| 16 | 128 |" in (tmp_path / "multinode_model.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("procs", [1, 2])
def test_decode_overlap_example(procs):
    """examples/decode_overlap.py on CPU (reference backend): one process with
    4 fake devices, and two processes (jax_ep.launch, gloo; each holds only its
    shards, as on GPUs): the two-micro-batch hooked step equals the sequential one,
    and both the dense model within fp8's error (bf16 where H is no multiple of 128)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_EP_")}
    env.pop("XLA_FLAGS", None)   # the example sets its own device count
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    script = os.path.join(ROOT, "examples", "decode_overlap.py")
    cmd = ([sys.executable, script] if procs == 1 else
           [sys.executable, "-m", "jax_ep.launch", "-n", str(procs), "--platform", "cpu", script])
    for extra in ([], ["--hidden", "200"]):
        proc = subprocess.run(cmd + extra, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "overlapped == sequential up to bf16 rounding: True" in proc.stdout
        assert f"fp8={not extra}" in proc.stdout and "matches the dense model: True" in proc.stdout


def test_ragged_moe_matches_dense():
    """examples/ragged_moe.py (MaxText's sparse path on jax_ep.ragged_all_to_all,
    reference backend) equals the same layer without EP, value and gradient."""
    import ragged_moe

    assert ragged_moe.ragged_all_to_all is ragged_moe.jax_ep.ragged_all_to_all  # the one line
    mesh = ragged_moe.make_mesh(8)
    params = ragged_moe.init_params(jax.random.key(0), 16, 24, 16)
    x = jax.random.normal(jax.random.key(1), (8 * 12, 16), jnp.float32)
    ct = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    loss_ep = lambda p, x: jnp.sum(ragged_moe.moe_layer(p, x, mesh, 3) * ct)
    loss_dense = lambda p, x: jnp.sum(ragged_moe.moe_dense(p, x, 3) * ct)
    v1, g1 = jax.jit(jax.value_and_grad(loss_ep, (0, 1)))(params, x)
    v2, g2 = jax.jit(jax.value_and_grad(loss_dense, (0, 1)))(params, x)
    # the loss sums terms whose magnitudes add to ~700x its value: the two
    # paths' f32 summation orders differ by ~1e-5 of it (CPU-dependent), so
    # the tolerance is taken on the terms' magnitude
    terms = float(jnp.sum(jnp.abs(ragged_moe.moe_dense(params, x, 3) * ct)))
    np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5, atol=1e-6 * terms)
    _tree_close(g1, g2, rtol=1e-4, atol=1e-5)


def test_ragged_moe_trains_a_few_steps():
    import ragged_moe

    args = ragged_moe.parse_args(["--steps", "3", "--tokens", "16", "--backend", "reference"])
    losses = ragged_moe.train(args, verbose=False)["losses"]
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[-1] < losses[0]
