"""The GPU harness's job mechanics on CPU (one process, no jax.distributed):
a job serves several requests when warm jobs are on, a fresh run gets its
own, a worker that fails takes its job down, and the failure names the rank."""
import os

import pytest

import harness


def _pid_worker(rank, n, fail=False):
    if fail:
        raise SystemExit(3)
    return os.getpid()


def _run(**kw):
    return harness.run("test_harness:_pid_worker", 1, init_native=False, distributed=False,
                       timeout=120, **kw)


@pytest.mark.slow
def test_warm_jobs_serve_several_requests(monkeypatch):
    monkeypatch.setenv("JAX_EP_TEST_WARM", "1")
    try:
        (a,), (b,) = _run(), _run()
        (c,) = _run(fresh=True)          # its own job, which also retires the warm one
        (d,) = _run()
        assert a == b and c != a and d not in (a, c)
        with pytest.raises(pytest.fail.Exception, match="rank 0 exited with code 3"):
            _run(kwargs={"fail": True})
        (e,) = _run()                    # a new job after the failure
        assert e not in (a, c, d)
    finally:
        harness.close_warm_job()
    monkeypatch.setenv("JAX_EP_TEST_WARM", "0")
    (f,), (g,) = _run(), _run()
    assert f != g                        # one job per run


def test_assert_checks_counts_and_names():
    from gpu_helpers import assert_checks

    ok = lambda name: dict(name=name, ok=True, detail="")
    assert_checks([[ok("a"), ok("b")], [ok("a"), ok("b")]], "w", expect=2)
    with pytest.raises(AssertionError, match="fewer than 2 checks"):
        assert_checks([[ok("a"), ok("b")], [ok("a")]], "w", expect=2)
    with pytest.raises(AssertionError, match="different checks"):
        assert_checks([[ok("a")], [ok("b")]], "w")
    with pytest.raises(AssertionError, match="1 failed"):
        assert_checks([[ok("a")], [dict(ok("a"), ok=False)]], "w")
