"""Native low-latency (decode) ops against the reference backend, on the GPUs.

Each test runs one worker below as an N-process job (harness.run, N =
``$JAX_EP_TEST_NPROCS``, default 2; N = 1 runs every kernel with R = 1 on one
GPU). The worker lays out the low-latency region for each shape
(``jax_ep.initialize(low_latency=cfg)``; NVSHMEM kept up between shapes),
runs native and reference (``backend="reference"``, XLA's all_to_all on the
same GPUs) on the same inputs, and compares:

* dispatch: the valid rows (``valid_rows()``; the rest is unspecified) and
  their scales bit for bit, ``count``, ``src_count``; outputs poisoned first
  (``JAX_EP_DEBUG_POISON=1``);
* combine: y holds NaN on every row that is not a valid row, so a kernel that
  reads one shows; the result equal to the reference's bits (k ascending,
  semantics §12) and bitwise stable over repeated calls;
* consecutive calls with different T and data (epochs, both parities), the
  hook (send, independent matmuls, receive) equal to the one-shot op, a
  ``fori_loop`` of decode steps in one executable;
* command buffers (``_graphs_worker``, run with XLA command buffers on for
  custom calls): every jax_ep handler runs while XLA records a CUDA graph
  (the extension counts them), replays are stable and equal the reference's
  bits;
* the order check: two sends of one op without a receive raise a clear error,
  also when a receive then times out (the first error is the one reported).

The ops, hook and command-buffer workers also run with
``EpConfig.ll_transport="put"``: every row and signal goes by NVSHMEM puts
(from the region's staging areas), to the own PE too, so the put path is
checked against the same reference bits on one GPU (R = 1) as on two.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import harness
from gpu_helpers import Checks, assert_checks, bits, from_process_local, local, per_rank_jit

_REASON = harness.skip_reason() or harness.testing_skip_reason()  # output poisoning
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

_TIMEOUT = float(os.environ.get("JAX_EP_GPU_TEST_TIMEOUT", "420"))
_SEED = 4321
_ENV = {"JAX_EP_DEBUG_POISON": "1", "JAX_EP_KEEP_NVSHMEM": "1"}
# Command buffers for fusions and custom calls, even for a one-op graph.
GRAPH_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


def _run(worker: str, env=None, fresh=False, expect=1, **kwargs):
    """``expect``: the checks the worker reports at least (its case count)."""
    results = harness.run(f"test_native_low_latency:{worker}", timeout=_TIMEOUT, kwargs=kwargs,
                          env=dict(_ENV, **(env or {})), init_native=False, fresh=fresh)
    assert_checks(results, f"{worker}{kwargs or ''}", expect)


# "auto": P2P stores to every (mapped) rank; "put": NVSHMEM puts to every rank
TRANSPORTS = ["auto", "put"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_native_ll_ops(transport):
    _run("_ops_worker", expect=2 * len(SHAPES) * len(OPS_CASES), transport=transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_native_ll_hook_and_loop(transport):
    _run("_hook_worker", expect=3, transport=transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_native_ll_command_buffers(transport):
    _run("_graphs_worker", env={"XLA_FLAGS": GRAPH_FLAGS}, expect=4, transport=transport)


def test_native_ll_order_error():
    _run("_order_worker", fresh=True, expect=2)   # leaves the order error behind


# ----------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------
# (name, E, Tmax, K, H): one region each
SHAPES = [
    ("v3_decode", 256, 128, 8, 7168),
    ("small", 16, 33, 4, 256),
]


def _cfg(shape, backend, n, transport="auto"):
    from jax_ep.config import EpConfig

    _, E, Tm, K, H = shape
    E = max(E, n)   # E % R == 0 holds for every N used (1, 2, 4, 8)
    return EpConfig(num_experts=E, topk=K, max_tokens_per_rank=Tm, hidden=H, backend=backend,
                    ll_transport=transport)


def _init(shape, n):
    import jax_ep

    jax_ep.finalize()
    if not jax_ep.initialize(low_latency=_cfg(shape, "native", n)):
        from jax_ep import runtime
        raise SystemExit(f"jax_ep.initialize() failed: {runtime.unavailable_reason()}")


def _routing(rng, n, T, K, E, skew):
    from ep_testing import random_routing

    idx = random_routing(rng, n, T, K, E, minus_one=0.15, skew=skew)
    if T > 1 and K > 1:
        idx[0, 1, :2] = [idx[0, 1, 0], idx[0, 1, 0]]   # a repeated id
        idx[-1, 0, 0] = E + 3                           # an id outside [-1, E)
    return idx


def _dispatch(x, idx, cfg, fp8, fmt):
    import jax_ep

    d = jax_ep.low_latency_dispatch(x, idx, cfg, fp8=fp8, scale_format=fmt)
    return d


def _dispatch_fields(d):
    """Valid rows (others zeroed here, after the comparison mask) and counts."""
    import jax.numpy as jnp

    v = d.valid_rows()
    x = jnp.where(v[..., None], d.x.view(jnp.uint8) if d.x.dtype.itemsize == 1 else d.x,
                  jnp.zeros((), d.x.dtype if d.x.dtype.itemsize > 1 else jnp.uint8))
    s = (jnp.where(v[..., None], d.x_scales, 0.0) if d.x_scales is not None
         else jnp.zeros((1,), jnp.float32))
    return x, s, d.count, d.src_count


def _combine_case_y(mesh, n, L, Tm, H, dt):
    """This rank's expert outputs ``[L, n*Tm, H]`` as a global array of every
    rank's, drawn here alone (seeded by rank): stacked on every process they
    are O(n^2) host memory (7.5 GB per process at V3-decode, n = 8)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng((_SEED, jax.process_index()))
    y = rng.standard_normal((1, L, n * Tm, H), dtype=np.float32)
    return from_process_local(mesh, P("ep"), y.astype(jnp.bfloat16) if dt == "bfloat16" else y)


def _nan_outside(y, d):
    """y with NaN on every row that holds no token (a kernel reading one shows)."""
    import jax.numpy as jnp

    return jnp.where(d.valid_rows()[..., None], y, jnp.asarray(np.nan, y.dtype))


def _ops_case(checks, rng, mesh, n, shape, transport, T, fp8, fmt, xdt, ydt, skew):
    import jax
    import jax.numpy as jnp

    import jax_ep

    name = (f"{transport}_{shape[0]}_T{T}_{'fp8_' + fmt if fp8 else 'bf16'}_x{xdt}_y{ydt}"
            f"{'_skew' if skew else ''}")
    cfg_n, cfg_r = _cfg(shape, "native", n, transport), _cfg(shape, "reference", n)
    E, Tm, K, H = cfg_n.num_experts, cfg_n.max_tokens_per_rank, cfg_n.topk, cfg_n.hidden
    L = E // n
    idx = _routing(rng, n, T, K, E, skew)
    x = rng.standard_normal((n, T, H)).astype(np.float32) * 3
    x = x.astype(jnp.bfloat16) if xdt == "bfloat16" else x
    w = rng.random((n, T, K)).astype(np.float32)
    y = _combine_case_y(mesh, n, L, Tm, H, ydt)
    outs = {}
    for tag, cfg in (("native", cfg_n), ("reference", cfg_r)):
        def step(x, i, w, y, cfg=cfg):
            d = _dispatch(x, i, cfg, fp8, fmt)
            out = jax_ep.low_latency_combine(_nan_outside(y[0], d), i, w, d.handle, cfg)
            return _dispatch_fields(d) + (out,)
        f, ins = per_rank_jit(step, mesh, ("ep",), x, idx, w, y)
        outs[tag] = [local(o) for o in f(*ins)]
        if tag == "native":
            again = [local(o) for o in f(*ins)]
    a, b = outs["native"], outs["reference"]
    names = ("rows", "scales", "count", "src_count")
    bad = [nm for nm, u, v in zip(names, a[:4], b[:4]) if not np.array_equal(bits(u), bits(v))]
    checks.report(name + "_dispatch", not bad, f"mismatch in {bad}" if bad else
                  f"valid rows {int(b[2].sum())}")
    co, cr = a[4].astype(np.float32), b[4].astype(np.float32)
    same = bool(np.array_equal(bits(a[4]), bits(b[4])))
    stable = all(np.array_equal(bits(u), bits(v)) for u, v in zip(a, again))
    checks.report(name + "_combine", same and stable and bool(np.all(np.isfinite(co))),
                  bitwise_equal_reference=same,
                  max_abs_diff=float(np.max(np.abs(co - cr))) if co.size else 0.0,
                  stable=stable, finite=bool(np.all(np.isfinite(co))))


OPS_CASES = [  # T (<= 0: Tmax + T), fp8, fmt, x dtype, y dtype, skew
    (0, True, "f32", "bfloat16", "bfloat16", False),
    (-5, True, "ue8m0", "bfloat16", "bfloat16", True),
    (0, False, "f32", "bfloat16", "float32", False),
    (7, True, "f32", "float32", "bfloat16", True),
    (1, True, "ue8m0", "float32", "float32", False),
]


def _ops_worker(rank, n, transport="auto"):
    from ep_testing import make_mesh

    checks, rng, mesh = Checks(), np.random.default_rng(_SEED), make_mesh((n,), ("ep",))
    for shape in SHAPES:
        _init(shape, n)
        Tm = shape[2]
        for case in OPS_CASES:
            case = (Tm + case[0] if case[0] <= 0 else case[0],) + case[1:]
            with checks.guard(f"{transport}_{shape[0]}_{case}"):
                _ops_case(checks, rng, mesh, n, shape, transport, *case)
    import jax_ep
    jax_ep.finalize()
    return checks.results


def _v3_decode_case(n, seed, skew, transport):
    """A region for V3-decode, its native (over `transport`) and reference
    configs, and one routing:
    -> (checks, rng, mesh, cfg_n, cfg_r, (x bf16, idx, w) stacked per rank)."""
    import jax.numpy as jnp

    from ep_testing import make_mesh

    checks, rng, mesh = Checks(), np.random.default_rng(seed), make_mesh((n,), ("ep",))
    shape = SHAPES[0]
    _init(shape, n)
    cfg_n, cfg_r = _cfg(shape, "native", n, transport), _cfg(shape, "reference", n)
    E, Tm, K, H = cfg_n.num_experts, cfg_n.max_tokens_per_rank, cfg_n.topk, cfg_n.hidden
    idx = _routing(rng, n, Tm, K, E, skew)
    x = rng.standard_normal((n, Tm, H)).astype(jnp.bfloat16)
    w = rng.random((n, Tm, K)).astype(np.float32)
    return checks, rng, mesh, cfg_n, cfg_r, (x, idx, w)


def _hook_worker(rank, n, transport="auto"):
    """send -> matmuls -> recv equals the one-shot op; a fori_loop of steps."""
    import jax
    import jax.numpy as jnp

    import jax_ep

    checks, rng, mesh, cfg_n, cfg_r, (x, idx, w) = _v3_decode_case(n, _SEED + 1, False, transport)
    H = cfg_n.hidden
    m = (rng.standard_normal((n, H, H)) / np.sqrt(H)).astype(jnp.bfloat16)

    def expert(d):   # a stand-in expert: dequantise, scale
        xs = d.x.astype(jnp.float32) * jnp.repeat(d.x_scales, 128, axis=-1)
        return (xs * 0.5).astype(jnp.bfloat16)

    def hooked(x, i, w, m, cfg):
        p = jax_ep.low_latency_dispatch_send(x, i, cfg)
        z = x
        for _ in range(4):   # independent work between the halves
            z = (z @ m).astype(jnp.bfloat16)
        d = jax_ep.low_latency_dispatch_recv(p)
        q = jax_ep.low_latency_combine_send(expert(d), i, w, d.handle, cfg)
        for _ in range(4):
            z = (z @ m).astype(jnp.bfloat16)
        return jax_ep.low_latency_combine_recv(q), z

    def plain(x, i, w, m, cfg):
        d = jax_ep.low_latency_dispatch(x, i, cfg)
        return jax_ep.low_latency_combine(expert(d), i, w, d.handle, cfg)

    res = {}
    for tag, fn, cfg in (("hook", hooked, cfg_n), ("plain", plain, cfg_n), ("ref", plain, cfg_r)):
        f, ins = per_rank_jit(lambda *a, fn=fn, cfg=cfg: fn(*a, cfg), mesh, ("ep",), x, idx, w, m)
        res[tag] = jax.tree_util.tree_map(local, f(*ins))
    checks.report("hook_equals_plain", np.array_equal(bits(res["hook"][0]), bits(res["plain"])))
    d = np.abs(res["plain"].astype(np.float32) - res["ref"].astype(np.float32))
    checks.report("plain_equals_reference", np.array_equal(bits(res["plain"]), bits(res["ref"])),
                  max_abs_diff=float(d.max()))

    # a loop of decode steps in one executable (epochs advance inside it)
    steps = 5

    def loop(x, i, w, m, cfg):
        def body(_, h):
            d = jax_ep.low_latency_dispatch(h, i, cfg)
            return jax_ep.low_latency_combine(expert(d), i, w, d.handle, cfg)
        return jax.lax.fori_loop(0, steps, body, x)

    out = {}
    for tag, cfg in (("native", cfg_n), ("reference", cfg_r)):
        f, ins = per_rank_jit(lambda *a, cfg=cfg: loop(*a, cfg), mesh, ("ep",), x, idx, w, m)
        out[tag] = local(f(*ins)).astype(np.float32)
    d = np.abs(out["native"] - out["reference"])
    checks.report("fori_loop_5_steps", bool(np.all(np.isfinite(out["native"]))
                                            and np.array_equal(bits(out["native"]), bits(out["reference"]))),
                  max_abs_diff=float(d.max()))
    jax_ep.finalize()
    return checks.results


def _graphs_worker(rank, n, transport="auto"):
    """With command buffers on: the custom calls are captured, results right."""
    import jax.numpy as jnp

    import jax_ep

    checks, rng, mesh, cfg_n, cfg_r, (x, idx, w) = _v3_decode_case(n, _SEED + 2, True, transport)

    def step(x, i, w, cfg):
        d = jax_ep.low_latency_dispatch(x, i, cfg)
        y = (d.x.astype(jnp.float32) * jnp.repeat(d.x_scales, 128, axis=-1)).astype(jnp.bfloat16)
        return jax_ep.low_latency_combine(y, i, w, d.handle, cfg)

    out = {}
    for tag, cfg in (("native", cfg_n), ("reference", cfg_r)):
        f, ins = per_rank_jit(lambda *a, cfg=cfg: step(*a, cfg), mesh, ("ep",), x, idx, w)
        if tag == "native":
            hlo = f.lower(*ins).compile().as_text()
            # XLA outlines each captured sequence into a computation that the
            # entry calls (named command_buffer*); the jax_ep calls must be in one.
            comps = _computations(hlo)
            cb = {n: body for n, body in comps.items() if "command_buffer" in n}
            in_cb = sum(body.count("jax_ep_ll") for body in cb.values())
            total = hlo.count('custom_call_target="jax_ep_ll')
            # XLA may form command buffers after HLO (from thunks), so the
            # HLO names are informational; the capture count below is the proof.
            checks.report("hlo_has_the_four_ll_calls", total == 4,
                          command_buffers=len(cb), ll_calls=total, ll_calls_captured=in_cb,
                          names=sorted(comps)[:12],
                          flags=os.environ.get("XLA_FLAGS", ""))
            from jax_ep import extension
            before = extension.load().graph_capture_count()
            runs = [local(f(*ins)) for _ in range(3)]
            captured = extension.load().graph_capture_count() - before
            # each of the 4 calls once while XLA records the graph, not per replay
            checks.report("custom_calls_captured_in_cuda_graph", captured >= 4,   # all 4
                          handler_calls_while_capturing=int(captured))
            checks.report("graph_replays_stable",
                          all(np.array_equal(bits(runs[0]), bits(r)) for r in runs[1:]))
            out[tag] = runs[-1]
        else:
            out[tag] = local(f(*ins))
    d = np.abs(out["native"].astype(np.float32) - out["reference"].astype(np.float32))
    checks.report("graph_equals_reference",
                  np.array_equal(bits(out["native"]), bits(out["reference"])),
                  max_abs_diff=float(d.max()))
    jax_ep.finalize()
    return checks.results


def _computations(hlo: str) -> dict:
    """{computation name: its text} of an HLO module's text."""
    out, name, lines = {}, None, []
    for ln in hlo.splitlines():
        head = ln.split("(")[0].split()
        if ln and not ln.startswith(" ") and ln.rstrip().endswith("{") and head:
            name = head[-1].lstrip("%")
            lines = []
            out[name] = ""
        elif name is not None:
            lines.append(ln)
            out[name] = "\n".join(lines)
    return out


def _order_worker(rank, n):
    """Two dispatch sends without a receive: the second sends nothing and the
    next call raises the order error (every rank: each one's own second send)."""
    import jax
    import jax.numpy as jnp

    import jax_ep
    from ep_testing import make_mesh

    checks, rng, mesh = Checks(), np.random.default_rng(_SEED + 3), make_mesh((n,), ("ep",))
    shape = SHAPES[1]
    _init(shape, n)
    cfg = _cfg(shape, "native", n)
    E, Tm, K, H = cfg.num_experts, cfg.max_tokens_per_rank, cfg.topk, cfg.hidden
    idx = _routing(rng, n, Tm, K, E, False)
    x = rng.standard_normal((n, Tm, H)).astype(jnp.bfloat16)

    def twice(x, i):
        a = jax_ep.low_latency_dispatch_send(x, i, cfg)
        b = jax_ep.low_latency_dispatch_send(x, i, cfg)
        return a.token, b.token

    f, ins = per_rank_jit(twice, mesh, ("ep",), x, idx)
    jax.block_until_ready(f(*ins))
    g, ins2 = per_rank_jit(lambda x, i: jax_ep.low_latency_dispatch(x, i, cfg).count,
                           mesh, ("ep",), x, idx)
    try:
        jax.block_until_ready(g(*ins2))
        checks.report("order_error_raised", False, "the next call did not raise")
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        checks.report("order_error_raised", "before the previous receive" in msg, msg[-300:])

    # send, send, recv, recv in one executable: the second receive times out
    # (its signals never come), and the order error, raised first, must be
    # the one reported (first error wins).
    _init(shape, n)   # a fresh region (zeroed epochs)

    def misordered(x, i):
        a = jax_ep.low_latency_dispatch_send(x, i, cfg)
        b = jax_ep.low_latency_dispatch_send(x, i, cfg)
        return (jax_ep.low_latency_dispatch_recv(a).count,
                jax_ep.low_latency_dispatch_recv(b).count)

    f, ins = per_rank_jit(misordered, mesh, ("ep",), x, idx)
    try:
        # The order error reaches the host at the first jax_ep handler that
        # runs after the second send's kernel wrote it: recv(a)'s in this
        # executable when the GPU got there first (then the run raises), else
        # the check below. Either way it must be the error reported.
        jax.block_until_ready(f(*ins))
        jax_ep.check_device_error()
        checks.report("order_error_survives_timeout", False, "no error left")
    except Exception as e:  # noqa: BLE001 - the run's XLA error or check_device_error's
        checks.report("order_error_survives_timeout", "previous receive" in str(e), str(e)[-300:])
    return checks.results
