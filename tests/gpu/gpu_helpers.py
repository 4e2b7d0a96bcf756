"""Helpers shared by the GPU tests (tests/gpu/test_*.py) and the workers they
run through ``harness.run``.

Worker side: the 1-D ``"ep"`` mesh, global arrays built from per-process data
or from inputs stacked per EP rank, the local shard (or every shard) back as
numpy, bit views for exact comparisons, a jitted ``shard_map`` over stacked
inputs, and ``Checks``: named pass / fail results that a worker returns as JSON.
Test side: ``assert_checks`` on what ``harness.run`` returns.

Importing this module puts tests/ on ``sys.path``, for ``ep_testing`` (random
routings, meshes with explicit Auto axes). Test dependencies: pyproject's
``gpu-test`` extra (pytest, optax, and torch for the one-GPU loopback tests,
which skip without it).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

import numpy as np

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


# ------------------------------------------------------------------ worker side

def ep_mesh(n):
    """``jax.make_mesh((n,), ("ep",))``, JAX's default axis types."""
    import jax

    return jax.make_mesh((n,), ("ep",))


def from_process_local(mesh, spec, a):
    """A global array whose shard on this process is ``a``."""
    import jax
    from jax.sharding import NamedSharding

    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), a)


def from_stacked(mesh, spec, arr):
    """A global array from ``arr`` [R, T, ...] stacked per EP rank, the same on
    every process: reshaped to [R * T, ...] and split as ``spec`` says."""
    import jax
    from jax.sharding import NamedSharding

    arr = np.asarray(arr).reshape((-1,) + arr.shape[2:])
    return jax.make_array_from_callback(arr.shape, NamedSharding(mesh, spec), lambda i: arr[i])


def local(a):
    """This process's shard of ``a`` (one device per process) as numpy."""
    return np.asarray(a.addressable_shards[0].data)


def gather(a):
    """Every process's shard of ``a``, concatenated (collective)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def bits(a):
    """``a`` viewed as unsigned integers of its width: exact comparisons (NaN, -0)."""
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def per_rank_jit(fn, mesh, axes, *arrays):
    """``jit(shard_map(fn))`` over the mesh axes ``axes`` (a tuple) and its
    inputs, global arrays built from ``arrays`` stacked per rank (``from_stacked``;
    a ``jax.Array`` is taken as the global array it is). 0-d outputs become [1]
    per rank. -> (f, inputs)."""
    import jax
    from jax.sharding import PartitionSpec as P

    spec = P(axes)
    ins = [a if isinstance(a, jax.Array) else from_stacked(mesh, spec, a) for a in arrays]

    def body(*xs):
        out = fn(*xs)
        return jax.tree_util.tree_map(lambda o: o[None] if o.ndim == 0 else o, out)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(ins), out_specs=spec))
    return _RanksInStep(f), ins


class _RanksInStep:
    """A jitted function whose calls start on every rank together: compiled
    first (once per input signature), then a host barrier (:func:`sync_ranks`),
    then the call. The native kernels wait on the device for their peers for
    at most 10 s (``kDefaultTimeoutNs``); ranks whose host work before a call
    differs (compiles, numpy checks of outputs of a GB, N processes sharing one
    GPU's host) must not reach a call further apart than that. Other attributes
    (``lower``) are the jitted function's."""

    def __init__(self, jitted):
        self._jitted, self._compiled = jitted, set()

    def __call__(self, *xs):
        import jax

        key = tuple((np.shape(x), str(getattr(x, "dtype", type(x))), str(getattr(x, "sharding", "")))
                    for x in jax.tree_util.tree_leaves(xs))
        if key not in self._compiled:
            self._jitted.lower(*xs).compile()   # XLA's compilation cache serves the call
            self._compiled.add(key)
        sync_ranks()
        return self._jitted(*xs)

    def __getattr__(self, name):
        return getattr(self._jitted, name)


# Where the ranks are, the same on every rank of a job (its workers run the
# same requests, guards and calls): the request, the Checks.guard around the
# call (by name and occurrence), the call's index inside it.
_SCOPE = {"request": None, "name": "", "calls": 0, "seen": {}}
BARRIER_TIMEOUT_S = 60.0


def _request() -> str:
    """This rank's request (harness._child), the scope reset when it changes."""
    request = os.environ.get("JAX_EP_TEST_REQUEST", "0")
    if _SCOPE["request"] != request:
        _SCOPE.update(request=request, name="", calls=0, seen={})
    return request


def _barrier(tag: str, timeout_s: float) -> None:
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(f"jax_ep_tests/{_request()}/{tag}",
                                                    int(timeout_s * 1000))


def sync_ranks(timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Every process of the job reaches this call before any goes on (JAX's
    distributed client: host only, no GPU work); nothing with one process.
    Barriers are named by request, guard and call index, so a rank that left
    a guard early (its exception) cannot pair its next call with another
    rank's different one: the others' wait ends in an error after
    ``timeout_s`` and the guard's exit realigns them."""
    import jax

    if jax.process_count() == 1:
        return
    _request()
    _SCOPE["calls"] += 1
    _barrier(f"{_SCOPE['name']}/{_SCOPE['calls']}", timeout_s)


@contextlib.contextmanager
def _scope(name: str):
    import jax

    _request()
    seen = _SCOPE["seen"]
    seen[name] = seen.get(name, 0) + 1
    outer = (_SCOPE["name"], _SCOPE["calls"])
    _SCOPE["name"], _SCOPE["calls"] = f"{name}#{seen[name]}", 0
    tag = f"{_SCOPE['name']}/end"

    def leave():
        _SCOPE["name"], _SCOPE["calls"] = outer
        if jax.process_count() > 1:
            _barrier(tag, BARRIER_TIMEOUT_S)
    try:
        yield
    except BaseException:
        try:    # the block's own error is the one to report
            leave()
        except Exception:  # noqa: BLE001
            pass
        raise
    leave()


class Checks:
    """Named checks of one worker: printed as ``PASS name ...`` / ``FAIL name
    ...`` as they come, returned (``results``, JSON) to the test."""

    def __init__(self):
        self.results = []

    def report(self, name, ok, detail="", **fields):
        ok = bool(ok)
        text = detail or json.dumps(fields, default=str)
        print(f"{'PASS' if ok else 'FAIL'} {name} {text}", flush=True)
        self.results.append(dict(name=name, ok=ok, detail=detail, **fields))

    @contextlib.contextmanager
    def guard(self, name):
        """An exception inside the block fails check ``name``; the worker goes
        on, its ranks together again once every one has left the block."""
        try:
            with _scope(name):
                yield
        except Exception as e:  # noqa: BLE001 - reported as a failed check
            self.report(name, False, f"{type(e).__name__}: {str(e)[:800]}")


def mesh_case_data(n, seed=7):
    """The permuted-mesh tests' inputs, stacked per rank: T 96, H 1024, top-4 of
    16 experts, skewed routing with -1 slots and a repeated id; -> (idx, x bf16, w)."""
    import jax.numpy as jnp

    from ep_testing import random_routing

    rng = np.random.default_rng(seed)
    T, H, K, E = 96, 1024, 4, 16
    idx = random_routing(rng, n, T, K, E, minus_one=0.2, skew=True)
    idx[0, 0, :2] = [3, 3]  # a repeated id
    x = rng.standard_normal((n, T, H)).astype(jnp.bfloat16)
    w = rng.random((n, T, K)).astype(np.float32)
    return idx, x, w


# ------------------------------------------------------------------ test side

def assert_checks(results, worker="", expect=1):
    """``results``: harness.run's per-rank lists of ``Checks.results``. Every
    check must have passed (a case that raises reports a failed check with its
    exception), every rank must have run at least ``expect`` checks (the
    worker's case count) and the same checks by name."""
    bad = [dict(rank=r, **c) for r, checks in enumerate(results) for c in checks if not c["ok"]]
    assert not bad, f"{worker}: {len(bad)} failed check(s)\n" + json.dumps(bad, indent=1)
    short = [r for r, checks in enumerate(results) if len(checks) < expect]
    assert results and not short, (f"{worker}: fewer than {expect} checks ran on rank(s) {short}: "
                                   f"{[len(c) for c in results]}")
    names = [[c["name"] for c in checks] for checks in results]
    assert all(n == names[0] for n in names), f"{worker}: ranks ran different checks: {names}"
