"""A multi-host job rehearsed on one machine: run by two launchers that
present themselves as two hosts, e.g. (one GPU, 4 processes sharing it)::

    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 JAX_EP_TEST_NUM_NODES=1
    for r in 0 1; do
      python -m jax_ep.launch -n 2 --gpus 1 --nnodes 2 --node-rank $r --host-id node$r \\
          --coordinator 127.0.0.1:29555 tests/gpu/rehearsal.py &
    done; wait

Each process joins through ``init_distributed`` (the launcher's variables),
then runs the internode workers of test_native_internode.py with
``num_nodes=1`` configs (``JAX_EP_TEST_NUM_NODES=1``): jax_ep must see two
hosts and split the EP group one node per host by itself (hosts.auto_nodes),
lay out the internode region for it, and keep NVSHMEM's network transport off
(one machine). Exits non-zero when a check fails on this rank.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(os.path.dirname(_HERE))]   # tests/gpu and this tree


def main() -> int:
    from jax_ep.launch import init_distributed

    info = init_distributed()
    import jax

    jax.devices()   # the GPU client before NVSHMEM starts
    import harness
    import test_native_internode as t
    from jax_ep import hosts, runtime

    if harness.testing_skip_reason():  # the workers check the poisoned outputs
        print(f"rehearsal: {harness.testing_skip_reason()}", flush=True)
        return 1

    rank, n = info.process_id, info.num_processes
    failed = []
    # each worker's _start asserts the internode region has 2 nodes (the split by host)
    for worker, nets in ((t._dispatch_worker, t.NETS), (t._combine_worker, t.NETS),
                         (t._grad_worker, ["auto"])):
        for net in nets:
            failed += [f"{worker.__name__}[{net}] {c['name']}" for c in worker(rank, n, net=net)
                       if not c["ok"]]
    print(f"rehearsal rank {rank}/{n} on host {hosts.host_id()}: "
          f"{'all checks passed' if not failed else 'FAILED ' + ', '.join(failed)}; "
          f"NVSHMEM_REMOTE_TRANSPORT={os.environ.get('NVSHMEM_REMOTE_TRANSPORT')}; "
          f"runtime up: {runtime.is_initialized()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
