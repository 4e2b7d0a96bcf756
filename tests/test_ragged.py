"""jax_ep.ragged_all_to_all against a NumPy model of lax's semantics (tests/ragged_model.py).

The reference backend runs on 8 fake CPU devices: random ragged cases (empty
sends, self sends, everything to one rank, zero-row operands and outputs,
1-D to 3-D operands, several dtypes, several slices per rank,
axis_index_groups), gradients against the model's transpose, the error
paths, and JAX's own ragged_all_to_all test cases (its
tests/ragged_collective_test.py) written again here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
import ragged_model
from ep_testing import make_mesh, run_per_rank


def _run(case, R, groups=None, axis="x", config=None):
    mesh = make_mesh((R,), (axis,))
    return run_per_rank(lambda *a: jax_ep.ragged_all_to_all(
        *a, axis_name=axis, axis_index_groups=groups, config=config), mesh, axis, *case)


def _same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    assert np.array_equal(got.view(f"u{got.dtype.itemsize}") if got.dtype.itemsize > 1 else got,
                          want.view(f"u{want.dtype.itemsize}") if want.dtype.itemsize > 1
                          else want)


# ---------------------------------------------------------------- lax's examples
def test_lax_docstring_example():
    """The example of lax.ragged_all_to_all's docstring, axis of 2."""
    operand = np.array([[1, 2, 2], [3, 4, 0]], np.float32)
    output = np.zeros((2, 4), np.float32)
    io = np.array([[0, 1], [0, 1]], np.int32)
    ss = np.array([[1, 2], [1, 1]], np.int32)
    oo = np.array([[0, 0], [1, 2]], np.int32)
    rs = np.array([[1, 1], [2, 1]], np.int32)
    got = _run((operand, output, io, ss, oo, rs), 2)
    _same(got, np.array([[1, 3, 0, 0], [2, 2, 4, 0]], np.float32))


def test_jax_case_axis_index_groups():
    """JAX's axis_index_groups case: an axis of 4 as two groups of 2."""
    operand = np.array([[1, 2, 2], [3, 4, 0], [10, 20, 20], [30, 40, 0]], np.int32)
    io = np.array([[0, 1]] * 4, np.int32)
    ss = np.array([[1, 2], [1, 1], [1, 2], [1, 1]], np.int32)
    oo = np.array([[0, 0], [1, 2], [0, 0], [1, 2]], np.int32)
    rs = np.array([[1, 1], [2, 1], [1, 1], [2, 1]], np.int32)
    got = _run((operand, np.zeros((4, 4), np.int32), io, ss, oo, rs), 4,
               groups=((0, 1), (2, 3)))
    _same(got, np.array([[1, 3, 0, 0], [2, 2, 4, 0], [10, 30, 0, 0], [20, 20, 40, 0]],
                        np.int32))


def test_jax_case_degenerate_groups():
    """JAX's singleton groups: every rank sends to itself only."""
    operand = np.array([[1, 0, 0, 0], [2, 3, 4, 0]], np.int32)
    case = (operand, np.zeros((2, 4), np.int32), np.array([[0], [0]], np.int32),
            np.array([[1], [3]], np.int32), np.array([[2], [1]], np.int32),
            np.array([[1], [3]], np.int32))
    got = _run(case, 2, groups=((0,), (1,)))
    _same(got, np.array([[0, 0, 1, 0], [0, 2, 3, 4]], np.int32))


def test_jax_case_grad():
    """JAX's gradient case (the docstring example in f32) against the model's transpose."""
    case = (np.array([[1, 2, 2], [3, 4, 0]], np.float32), np.zeros((2, 4), np.float32),
            np.array([[0, 1], [0, 1]], np.int32), np.array([[1, 2], [1, 1]], np.int32),
            np.array([[0, 0], [1, 2]], np.int32), np.array([[1, 1], [2, 1]], np.int32))
    _check_vjp(case, 2, np.random.default_rng(0))


def test_jax_case_vmap_expert_pipeline():
    """JAX's vmap case: EP 2 x pipeline 4, the op vmapped over the pipeline stages."""
    mesh = make_mesh((2, 4), ("expert", "pipeline"))
    x_spec = P("expert", None)

    def body(x, out, io, ss, oo, rs):
        return jax_ep.ragged_all_to_all(x, out, io.reshape(-1), ss.reshape(-1), oo.reshape(-1),
                                        rs.reshape(-1), axis_name="expert")

    f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec,) * 6, out_specs=x_spec)
    x = np.tile(np.arange(8.0, dtype=np.float32)[:, None], (1, 3))
    meta = [np.array(v, np.int32) for v in ([[0, 2], [0, 2]], [[2, 2], [2, 2]],
                                           [[0, 0], [2, 2]], [[2, 2], [2, 2]])]
    want = np.array([0, 1, 4, 5, 2, 3, 6, 7], np.float32)[:, None] * np.ones(3, np.float32)
    _same(jax.jit(f)(x, x.copy(), *meta), want)
    tile = lambda a: np.tile(a[None], (4,) + (1,) * a.ndim)
    spec = NamedSharding(mesh, P("pipeline", "expert", None))
    args = [jax.device_put(tile(a), spec) for a in (x, x.copy(), *meta)]
    got = jax.jit(jax.vmap(f))(*args)
    for i in range(4):
        _same(got[i], want)


@pytest.mark.parametrize("batch_axis", [0, 1])
def test_jax_case_vmap_multi_dim_operand(batch_axis):
    """JAX's vmap cases: 3-D inputs, the op vmapped over one axis, checked per slice."""
    mesh = make_mesh((2,), ("x",))
    operand = np.array([[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]], np.int32)
    ss = np.array([[[1, 2], [1, 1]], [[1, 2], [1, 1]]], np.int32)
    oo = np.array([[[0, 0], [1, 2]], [[0, 0], [1, 2]]], np.int32)
    rs = np.array([[[1, 1], [2, 1]], [[1, 1], [2, 1]]], np.int32)
    io = np.array([[[0, 1], [0, 1]], [[0, 1], [0, 1]]], np.int32)
    output = np.zeros((2, 2, 4), np.int32)
    spec = P("x", None)

    def body(*a):
        a = [v.reshape(v.shape[1:]) for v in a]
        return jax_ep.ragged_all_to_all(*a, axis_name="x")

    f = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=P("x"))
    args = (operand, output, io, ss, oo, rs)
    got = jax.jit(jax.vmap(f, in_axes=batch_axis))(*args)
    for i in range(2):
        _same(got[i], jax.jit(f)(*[np.take(a, i, axis=batch_axis) for a in args]))


# ----------------------------------------------------------- random cases
# R, N, M, S, row shape, dtype
CASES = [
    (2, 6, 9, 1, (), np.float32),
    (4, 12, 16, 2, (3,), jnp.bfloat16),
    (8, 16, 24, 1, (2, 3), np.int32),
    (8, 10, 14, 3, (5,), np.float32),
    (4, 7, 11, 1, (4,), np.int8),
    (8, 9, 9, 2, (3,), np.float16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{c[0]}_N{c[1]}_M{c[2]}_S{c[3]}_"
                         f"{'x'.join(map(str, c[4])) or 'vec'}_{np.dtype(c[5]).name}")
def test_random_cases_match_model(case):
    R, N, M, S, feat, dt = case
    rng = np.random.default_rng(R * 100 + N)
    c = ragged_model.random_case(rng, R, N, M, S, feature=feat, dtype=dt)
    _same(_run(c, R), ragged_model.ragged_all_to_all(*c))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_cases_many(seed):
    rng = np.random.default_rng(1000 + seed)
    R = int(rng.choice([2, 4, 8]))
    S = int(rng.integers(1, 4))
    N, M = int(rng.integers(0, 40)), int(rng.integers(0, 60))
    feat = [(), (4,), (2, 3)][seed % 3]
    dt = [np.float32, jnp.bfloat16, np.int32, np.uint8][seed % 4]
    c = ragged_model.random_case(rng, R, N, M, S, feature=feat, dtype=dt,
                                 fill=float(rng.uniform(0, 1)), empty=float(rng.uniform(0, 0.6)))
    _same(_run(c, R), ragged_model.ragged_all_to_all(*c))


def _shaped(R, N, M, K, feat=(3,)):
    rng = np.random.default_rng(R + N + M)
    return (rng.standard_normal((R, N) + feat).astype(np.float32),
            rng.standard_normal((R, M) + feat).astype(np.float32),
            np.zeros((R, K), np.int32), np.zeros((R, K), np.int32),
            np.zeros((R, K), np.int32), np.zeros((R, K), np.int32))


def test_empty_sends_keep_output():
    c = _shaped(4, 5, 6, 4)
    _same(_run(c, 4), c[1])


def test_self_sends_only():
    """Each rank sends rows 1..3 to itself, at rows 2..4."""
    R = 4
    op, out, io, ss, oo, rs = _shaped(R, 5, 6, R)
    for r in range(R):
        io[r, r], ss[r, r], oo[r, r], rs[r, r] = 1, 3, 2, 3
    c = (op, out, io, ss, oo, rs)
    got = _run(c, R)
    _same(got, ragged_model.ragged_all_to_all(*c))
    np.testing.assert_array_equal(got[:, 2:5], op[:, 1:4])


def test_all_rows_to_one_rank():
    """Every rank sends its whole operand to rank 2, one block each."""
    R, N = 4, 3
    op, out, io, ss, oo, rs = _shaped(R, N, R * N + 2, R)
    for s in range(R):
        ss[s, 2], oo[s, 2], rs[2, s] = N, 1 + s * N, N
    c = (op, out, io, ss, oo, rs)
    got = _run(c, R)
    _same(got, ragged_model.ragged_all_to_all(*c))
    np.testing.assert_array_equal(got[2, 1:1 + R * N], op.reshape(R * N, 3))


@pytest.mark.parametrize("N,M", [(0, 5), (4, 0), (0, 0)])
def test_zero_rows(N, M):
    c = _shaped(2, N, M, 2)
    _same(_run(c, 2), c[1])


def test_bad_slices_are_not_written():
    """A slice past operand or the receiver's output, with a negative size, or
    whose size differs from the receiver's recv_sizes, writes nothing; the
    valid ones still land (the native kernel also raises a device-side error)."""
    R = 4
    rng = np.random.default_rng(3)
    op, out, io, ss, oo, rs = ragged_model.random_case(rng, R, 8, 12, 1, feature=(2,), empty=0)
    ss[0, 1] += 50                 # past operand and the receiver's output
    rs[1, 0] = ss[0, 1]
    io[1, 2] = -1                  # a negative offset
    rs[3, 2] += 1                  # a size the sender does not send
    ss[2, 0], rs[0, 2] = -2, -2    # a negative size, on both sides
    c = (op, out, io, ss, oo, rs)
    got = _run(c, R)
    _same(got, ragged_model.ragged_all_to_all(*c))
    _same(got[1, oo[0, 1]:oo[0, 1] + 1], out[1, oo[0, 1]:oo[0, 1] + 1])


@pytest.mark.parametrize("groups", [((0, 1), (2, 3), (4, 5), (6, 7)),
                                    ((0, 2, 4, 6), (1, 3, 5, 7)), ((3, 1, 2, 0), (7, 5, 6, 4))])
def test_axis_index_groups(groups):
    rng = np.random.default_rng(len(groups[0]))
    c = ragged_model.random_case(rng, 8, 10, 14, 2, feature=(3,), groups=groups)
    _same(_run(c, 8, groups=groups), ragged_model.ragged_all_to_all(*c, groups=groups))


# ----------------------------------------------------------------- gradients
def _check_vjp(case, R, rng, groups=None):
    """Per rank, inside shard_map (check_vma=True), the vjp of the op for a
    random cotangent -> the model's transpose, exactly (each row's gradient
    is one cotangent value: no sums)."""
    op, out = case[0], case[1]
    ct = rng.standard_normal(out.shape).astype(out.dtype)

    def per_rank(op, out, io, ss, oo, rs, ct):
        f = lambda a, b: jax_ep.ragged_all_to_all(a, b, io, ss, oo, rs, axis_name="x",
                                                  axis_index_groups=groups)
        y, vjp = jax.vjp(f, op, out)
        return (y, *vjp(ct))

    mesh = make_mesh((R,), ("x",))
    y, d_op, d_out = run_per_rank(per_rank, mesh, "x", *case, ct)
    w_op, w_out = ragged_model.transpose(ct, *case, groups=groups)
    _same(y, ragged_model.ragged_all_to_all(*case, groups=groups))
    _same(d_op, w_op.astype(op.dtype))
    _same(d_out, w_out.astype(out.dtype))


@pytest.mark.parametrize("R,S,feat", [(2, 1, ()), (4, 2, (3,)), (8, 1, (2, 2))])
def test_vjp_matches_model_transpose(R, S, feat):
    rng = np.random.default_rng(R * 7 + S)
    _check_vjp(ragged_model.random_case(rng, R, 9, 13, S, feature=feat), R, rng)


def test_vjp_with_groups():
    rng = np.random.default_rng(11)
    groups = ((0, 2), (1, 3))
    _check_vjp(ragged_model.random_case(rng, 4, 6, 8, 1, feature=(2,), groups=groups), 4, rng,
               groups=groups)


def test_grad_through_jit_and_shard_map():
    """jax.grad of a global loss through jit(shard_map(...)) with check_vma=True,
    the operand replicated (invariant) on input."""
    R = 4
    rng = np.random.default_rng(5)
    case = ragged_model.random_case(rng, R, 6, 10, 1, feature=(2,))
    mesh = make_mesh((R,), ("x",))
    ct = rng.standard_normal(case[1].shape).astype(np.float32)
    flat = lambda a: jnp.asarray(a).reshape((-1,) + a.shape[2:])
    ints = [flat(a) for a in case[2:]]

    def body(op, out, io, ss, oo, rs):
        r = jax.lax.axis_index("x")
        mine = jax.lax.dynamic_index_in_dim(op, r, 0, keepdims=False)   # op: [R, N, 2] replicated
        return jax_ep.ragged_all_to_all(mine, out, io, ss, oo, rs, axis_name="x")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(),) + (P("x"),) * 5, out_specs=P("x"),
                      check_vma=True)
    loss = lambda op, out: jnp.sum(f(op, out, *ints) * flat(ct))
    d_op, d_out = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(case[0]), flat(case[1]))
    w_op, w_out = ragged_model.transpose(ct, *case)
    np.testing.assert_array_equal(np.asarray(d_op), w_op.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(d_out), flat(w_out.astype(np.float32)))


def test_forward_mode_is_refused():
    R = 2
    case = _shaped(R, 3, 4, R)
    mesh = make_mesh((R,), ("x",))

    def per_rank(op, out, io, ss, oo, rs):
        f = lambda a: jax_ep.ragged_all_to_all(a, out, io, ss, oo, rs, axis_name="x")
        return jax.jvp(f, (op,), (op,))[1]

    with pytest.raises(TypeError, match="reverse-mode"):
        run_per_rank(per_rank, mesh, "x", *case)


def test_sub_axis_of_a_larger_mesh():
    """The exchange over "ep" of a ("data", "ep") mesh: each data row is its own group."""
    mesh = make_mesh((2, 4), ("data", "ep"))
    rng = np.random.default_rng(9)
    parts = [ragged_model.random_case(rng, 4, 5, 7, 1, feature=(3,)) for _ in range(2)]
    case = [np.concatenate([p[i] for p in parts]) for i in range(6)]
    got = run_per_rank(lambda *a: jax_ep.ragged_all_to_all(*a, axis_name="ep"), mesh, "ep",
                       *case)
    want = np.concatenate([ragged_model.ragged_all_to_all(*p) for p in parts])
    _same(got, want)


# -------------------------------------------------------------------- errors
def _trace(R=2, **over):
    """Trace one call with ``over`` replacing arguments (per-rank shapes); -> raises or not."""
    args = dict(operand=jnp.zeros((4, 3)), output=jnp.zeros((5, 3)),
                input_offsets=jnp.zeros((R,), jnp.int32), send_sizes=jnp.zeros((R,), jnp.int32),
                output_offsets=jnp.zeros((R,), jnp.int32), recv_sizes=jnp.zeros((R,), jnp.int32))
    kw = dict(axis_name="x")
    for k, v in over.items():
        (kw if k in ("axis_name", "axis_index_groups", "config") else args)[k] = v
    mesh = make_mesh((R,), ("x",))
    names = list(args)
    f = jax.shard_map(lambda *a: jax_ep.ragged_all_to_all(**dict(zip(names, a)), **kw),
                      mesh=mesh, in_specs=(P(),) * 6, out_specs=P("x"))
    jax.jit(f).lower(*args.values())


@pytest.mark.parametrize("name", ["input_offsets", "send_sizes", "output_offsets", "recv_sizes"])
def test_errors_like_lax(name):
    with pytest.raises(ValueError, match=f"ragged_all_to_all {name} must be integer type"):
        _trace(**{name: jnp.zeros((2,), jnp.float32)})
    with pytest.raises(ValueError, match=rf"{name} must be rank 1 with positive dimension size, "
                                         r"but got shape \(1, 2\)"):
        _trace(**{name: jnp.zeros((1, 2), jnp.int32)})
    with pytest.raises(ValueError, match=rf"{name} must be rank 1 .* shape \(0,\)"):
        _trace(**{name: jnp.zeros((0,), jnp.int32)})


@pytest.mark.parametrize("over,err,match", [
    (dict(send_sizes=jnp.zeros((4,), jnp.int32)), ValueError, "one length"),
    (dict(input_offsets=jnp.zeros((3,), jnp.int32), send_sizes=jnp.zeros((3,), jnp.int32),
          output_offsets=jnp.zeros((3,), jnp.int32), recv_sizes=jnp.zeros((3,), jnp.int32)),
     ValueError, "not a multiple of the 2 ranks"),
    (dict(output=jnp.zeros((5, 4))), ValueError, "equal sizes after the first dimension"),
    (dict(output=jnp.zeros((5, 3, 1))), ValueError, "one rank"),
    (dict(operand=jnp.zeros(())), ValueError, "rank >= 1"),
    (dict(output=jnp.zeros((5, 3), jnp.int32)), TypeError, "one dtype"),
    (dict(axis_name="y"), ValueError, "not a mesh axis bound here"),
    (dict(axis_name=("x", "y")), NotImplementedError, "one axis"),
    (dict(axis_index_groups=[[0], [0]]), ValueError, "cover 0..1"),
    (dict(axis_index_groups=[[0, 1], []]), ValueError, "cover 0..1"),
    (dict(config="native"), TypeError, "RaggedConfig"),
    (dict(config=jax_ep.RaggedConfig(backend="native")), RuntimeError, "initialize"),
], ids=["lengths", "multiple", "row_shape", "row_rank", "scalar", "dtype", "axis", "axes",
        "groups_twice", "groups_sizes", "config_type", "native_down"])
def test_errors(over, err, match):
    with pytest.raises(err, match=match):
        _trace(**over)


@pytest.mark.parametrize("field,value", [("backend", "gpu"), ("transport", "nvlink"),
                                         ("num_sms", 0), ("num_sms", True)])
def test_config_errors(field, value):
    with pytest.raises(ValueError, match=f"RaggedConfig.{field}"):
        jax_ep.RaggedConfig(**{field: value})
