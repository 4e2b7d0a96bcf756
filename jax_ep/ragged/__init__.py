"""The ragged all-to-all family: ``jax_ep.ragged_all_to_all``, a drop-in for
``jax.lax.ragged_all_to_all`` (docs/ragged.md).

- ``config``: :class:`RaggedConfig` (backend, transport, SMs) and the per-call
  facts backend selection reads.
- ``region``: the region ``initialize(ragged_bytes=...)`` lays out (below the runtime).
- ``reference``: the semantics in pure JAX (XLA all_to_all of padded chunks).
- ``native``: the ``jax_ep_ragged_all_to_all`` custom call.
- ``api``: the public function and its differentiation rule.

This file imports nothing, so that the runtime can import ``region`` without
the backends above it.
"""
