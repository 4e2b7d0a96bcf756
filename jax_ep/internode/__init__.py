"""The internode (hierarchical) kernel family: normal-mode dispatch / combine
for an EP group of several nodes (docs/internode.md). Each token crosses the
network once per destination node and is forwarded inside the node over
NVLink; combine reverses it. Same semantics as the intranode family (its
reference is ``jax_ep.intranode.reference``), up to one rounding per node
partial in bf16 combine.

- ``region``: the region sized for a window of tokens (below the runtime).
- ``native``: ``jax_ep_internode_dispatch`` / ``jax_ep_internode_combine`` and
  when an EP group takes them (``nodes_of``).

This file imports nothing, so that the runtime can import ``region`` without
the backends above it.
"""
