"""The low-latency (decode) kernel family: docs/semantics.md §12, docs/low_latency.md.

- ``types``: the handle, result and pending (hook) pytrees.
- ``region``: the region ``initialize(low_latency=config)`` lays out (below the runtime).
- ``reference``: the semantics in pure JAX (XLA all_to_all of a dense buffer).
- ``native``: the ``jax_ep_ll_*`` send / receive custom calls.
- ``api``: the public ``low_latency_*`` functions.

This file imports nothing, so that the runtime can import ``region`` without
the backends above it.
"""
