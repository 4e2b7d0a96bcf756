"""Normal-mode reference backend: the executable definition of docs/semantics.md.

Routing (handle, counts, weights) is ``jax_ep.routing``, shared with the native
backend; rows move through ``jax.lax.all_to_all`` over a dense, statically shaped ``[R, T, W]``
send buffer (each token at most once per destination rank), so it runs on any
platform and device layout, CPU included. It is the oracle of every native test
and XLA's "dense all_to_all with static capacity" baseline in the benchmark.

Every method runs per rank inside ``jax.shard_map`` (``jax_ep.backend.RowBackend``).
It serves both normal-mode families: the internode kernels give the same
semantics (up to one rounding per node partial in bf16 combine).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .. import routing
from ..config import EpConfig
from ..fp8 import F32, fp8_cast
from ..types import Handle


class ReferenceBackend:
    """docs/semantics.md in pure JAX: the shared routing (``jax_ep.routing``) over XLA's
    all_to_all (``router``), and the rows moved by the same all_to_all of a
    dense ``[R, T, W]`` buffer."""

    name = "reference"
    router = routing.XlaRouter()

    def unavailable(self, cfg: EpConfig):
        return None   # runs anywhere

    def layout(self, topk_idx, cfg: EpConfig, R: int):
        return routing.layout_counts(topk_idx, cfg, R)

    # -- data movement --------------------------------------------------------
    def _send_rows(self, x, handle: Handle, cfg: EpConfig):
        return routing.send_rows(x, handle, cfg, self.router.exchange)

    def dispatch_rows(self, x, x_scales: Optional[jax.Array], handle: Handle, cfg: EpConfig):
        src = handle.row_src
        safe = jnp.maximum(src, 0)

        def place(rows):
            flat = self._send_rows(rows, handle, cfg)
            return jnp.where((src >= 0)[:, None], flat[safe], jnp.zeros((), rows.dtype))

        return place(x), (None if x_scales is None else place(x_scales))

    def dispatch_rows_fp8(self, x, handle: Handle, cfg: EpConfig):
        return self.dispatch_rows(*fp8_cast(x, cfg.fp8_scale_format), handle, cfg)

    def combine_rows(self, y, row_weights, handle: Handle, cfg: EpConfig):
        R, T, K = handle.recv_local_idx.shape
        W = y.shape[1]
        if handle.layout == "expert_major":
            acc = jnp.zeros((R, T, W), F32)
            for k in range(K):  # fixed order: k ascending
                row = handle.slot_row[:, :, k]
                ok = (row >= 0)[..., None]
                v = y[jnp.maximum(row, 0)].astype(F32)
                if row_weights is not None:
                    v = row_weights[jnp.maximum(row, 0)][..., None].astype(F32) * v
                acc = acc + jnp.where(ok, v, 0.0)
            partial = acc.astype(y.dtype)
        else:
            row = handle.slot_row[:, :, 0]
            partial = jnp.where((row >= 0)[..., None], y[jnp.maximum(row, 0)],
                                jnp.zeros((), y.dtype))
        back = self.router.exchange(partial, cfg)  # [R(expert rank), T, W]
        mask = handle.send_mask
        out = jnp.zeros((T, W), F32)
        for r in range(R):  # fixed order: ranks ascending
            out = out + jnp.where(mask[:, r:r + 1], back[r].astype(F32), 0.0)
        return out.astype(y.dtype)

    def combine_backward(self, g, y, row_weights, handle: Handle, cfg: EpConfig):
        """Backward of ``combine_rows(y, row_weights)`` for ``g = d_out [T, W]``:
        ``g_rows = f32(dispatch_rows(g))``; ``dy = cast_y(w * g_rows)``, ``dw =
        sum_h g_rows * f32(y)`` (f32). Without weights (rank_major) ``dy`` is the
        dispatch of ``g`` in y's dtype and ``dw`` None. Materialises ``[C, W]`` f32
        temporaries in XLA; the native backend fuses this into its dispatch kernel."""
        g_rows = self.dispatch_rows(g, None, handle, cfg)[0].astype(F32)  # [C, W]
        if row_weights is None:
            return g_rows.astype(y.dtype), None
        dy = (row_weights[:, None] * g_rows).astype(y.dtype)
        dw = jnp.sum(g_rows * y.astype(F32), axis=1)
        return dy, dw


BACKEND = ReferenceBackend()
