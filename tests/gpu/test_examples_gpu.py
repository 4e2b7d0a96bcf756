"""The examples as users run them on GPUs: ``jax-ep-launch -n N`` (N =
$JAX_EP_TEST_NPROCS) with the native backend, the processes sharing the GPUs
when there are fewer than N (jax_ep.shared_gpu).

- decode_overlap.py: two micro-batches through the low-latency hook (send,
  independent work, receive; the second send ordered after the first receive
  by ``after=``), equal to the same step without the hook and, within fp8's
  error, to the dense model;
- train_moe.py: the training example learns (loss falls well below its start)
  with finite gradients;
- ragged_moe.py: the MaxText-style layer on jax_ep.ragged_all_to_all's kernel
  lowers its loss; in one process (one GPU, where lax runs) its losses equal
  those of the same layer on jax.lax.ragged_all_to_all.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import harness

_REASON = harness.skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _run(cmd, timeout):
    """Run an example's command line to its end; its output. A warm job of the
    tests before it is ended first: its ranks would keep their share of the GPU."""
    harness.close_warm_job()
    try:
        r = subprocess.run(cmd, cwd=harness.ROOT, env=harness.launch_env(), capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s:\n{(e.stdout or '')[-4000:]}"
                    f"{(e.stderr or '')[-4000:]}")
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{out[-8000:]}"
    return out


def _launch(script, *args, timeout=420):
    """An example on ``harness.nprocs()`` processes through ``jax_ep.launch``."""
    n = harness.nprocs()
    gpus = min(n, max(1, harness.gpu_count()))
    return _run([sys.executable, "-m", "jax_ep.launch", "-n", str(n), "--gpus", str(gpus),
                 os.path.join(harness.ROOT, "examples", script), *args], timeout)


def test_decode_overlap_native():
    out = _launch("decode_overlap.py", "--backend", "native", "--steps", "2")
    m = re.search(r"overlapped == sequential up to bf16 rounding: (\w+).*"
                  r"matches the dense model: (\w+)", out)
    assert m and m.groups() == ("True", "True"), out[-6000:]


def test_train_moe_native_learns():
    out = _launch("train_moe.py", "--backend", "native", "--platform", "gpu", "--steps", "120",
                  "--no-comm-timing", "--log-every", "40")
    m = re.search(r"loss: start ([\d.]+) -> end [\d.]+ \(mean of last \d+: ([\d.]+);.*"
                  r"grads finite: (\w+)", out)
    assert m, out[-6000:]
    first, last, finite = float(m.group(1)), float(m.group(2)), m.group(3)
    assert finite == "True" and last < 0.8 * first, out[-6000:]


def test_ragged_moe_native_learns():
    out = _launch("ragged_moe.py", "--backend", "native", "--platform", "gpu", "--steps", "4")
    losses = [float(v) for v in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert len(losses) == 4 and losses[-1] < losses[0], out[-6000:]


def test_ragged_moe_one_gpu_equals_lax():
    out = _run([sys.executable, os.path.join(harness.ROOT, "examples", "ragged_moe.py"),
                "--platform", "gpu", "--backend", "native", "--compare-lax", "--steps", "3"], 300)
    m = re.search(r"losses equal to lax's: (\w+) \(largest relative difference ([\d.e+-]+)\)",
                  out)
    assert m and float(m.group(2)) < 1e-6, out[-6000:]
