"""The intranode kernel family: normal-mode dispatch / combine inside one
NVLink domain (every rank maps every other's buffer).

- ``region``: the staging rings' buffer (sizing; below the runtime).
- ``reference``: normal mode in pure JAX, the semantics every normal-mode
  backend (this family's and internode's) must give.
- ``native``: the ``jax_ep_dispatch`` / ``jax_ep_combine`` / ``jax_ep_combine_bwd``
  custom calls; ``layout``: ``jax_ep_layout``.

This file imports nothing, so that the runtime can import ``region`` without
the backends above it.
"""
