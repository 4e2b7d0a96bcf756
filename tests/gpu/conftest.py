"""GPU tests: multi-process jobs spawned by the tests themselves (harness.py).

They are marked ``gpu`` and skip with a one-line reason when there are fewer
than ``$JAX_EP_TEST_NPROCS`` (default 2) GPUs or jax_ep._C is not built.
"""
import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The grouped-matmul tests run on GPU 0 inside this (parent) process; by default
# JAX would keep 75% of that GPU for the rest of the session, and the
# multi-process jobs that follow (60% each) would run out of memory. Allocate
# on demand and give memory back; the children get the defaults again (harness).
if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ and "XLA_PYTHON_CLIENT_ALLOCATOR" not in os.environ:
    os.environ.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_ALLOCATOR="platform",
                      _JAX_EP_PARENT_ALLOCATOR="1")

# A SIGTERM (e.g. `timeout` around pytest in scripts/gpu_check.sh) raises
# KeyboardInterrupt like Ctrl-C, so harness.run's cleanup stops the job's ranks
# and pytest still prints its summary.
if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
    signal.signal(signal.SIGTERM, signal.default_int_handler)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test ends the warm job (harness.warm_jobs): a peer timeout or an
    aborted NCCL communicator stays in its ranks and would fail the next test."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        import harness
        harness.close_warm_job()
