"""Which implementation runs an operation: the Pallas kernels' constraints, a
one-time compile check per configuration, and the two-consumer tiles."""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import jax
import jax.numpy as jnp

from .config import (DW_PIPELINE, SMALL_GROUP_ROWS, SMALL_GROUP_TILES, GroupedMatmulConfig,
                     Tiles)
from .pallas_common import EPILOGUE_ROWS
from .pallas_dw import tgmm_pallas, tgmm_pallas_ring, tgmm_pallas_ws
from .pallas_fwd import gmm_pallas, gmm_pallas_ws


SMEM_BYTES = 227 * 1024   # Hopper: dynamic shared memory per block
# Beside the staged tiles: the pipeline's barriers and buffer alignment (Mosaic
# counts 64 bytes at the default tiles; the kernels have no reductions, so no
# reduction scratch).
SMEM_RESERVE = 1024


def _two_consumer_bytes(bm, bn, bk, wide, item):
    """Shared memory of a 2-consumer kernel whose CTA tile is ``wide`` along
    the split side: (one pipeline stage: an x tile and a w / dy tile, one
    output slot of both consumers)."""
    return bk * (bm + bn + wide // 2) * item, 2 * EPILOGUE_ROWS * bn * item


def two_consumer_tiles(tiles: Tiles, split: str, dim: int, dtype) -> Optional[Tiles]:
    """The tiles of a 2-consumer kernel, stages cut to fit shared memory, or
    None where it does not apply. ``split``: which tile side the two consumer
    warpgroups split, ``"m"`` (dw: CTA tile ``2 block_m x block_n``, needs
    ``dim = K`` divisible by ``2 block_m``) or ``"n"`` (forward/dx: CTA tile
    ``block_m x 2 block_n``, needs ``dim = N`` divisible by ``2 block_n``)."""
    bm, bn, bk, steps, band = tiles
    wide = 2 * bm if split == "m" else 2 * bn
    if dim % wide or bm * bn > 128 * 128:
        return None   # a consumer's f32 accumulator: at most 128 x 128 (registers)
    stage, out = _two_consumer_bytes(bm, bn, bk, wide, jnp.dtype(dtype).itemsize)
    fit = (SMEM_BYTES - out - SMEM_RESERVE) // stage
    if fit < 2:
        return None
    return (bm, bn, bk, int(min(steps, fit)), band)


def small_groups(x, groups: int) -> bool:
    """Whether the groups are small: ``x``'s rows / ``groups`` <=
    SMALL_GROUP_ROWS (a static bound on the mean; it picks the small-group
    tiles and dw pipeline)."""
    return x.shape[0] <= SMALL_GROUP_ROWS * groups


def op_tiles(cfg: GroupedMatmulConfig, op, x, w, groups: int) -> Tiles:
    """The tiles ``op`` runs with: the config's, or where it leaves them unset
    and the groups are small (``x``'s rows / ``groups`` <= SMALL_GROUP_ROWS, a
    static bound on the mean) SMALL_GROUP_TILES where they apply (and fit)."""
    t = cfg.tiles(op)
    small = SMALL_GROUP_TILES.get(op)
    if small is None or getattr(cfg, op) is not None or not small_groups(x, groups):
        return t
    return small if constraint_error(op, small, x, w, x.dtype) is None else t


def fwd_ws_tiles(cfg, op, x, w, transpose_rhs) -> Optional[Tiles]:
    """Tiles of the 2-consumer forward/dx kernel, or None: the 1-warpgroup one."""
    if cfg.fwd_warpgroups != 2:
        return None
    n = w.shape[1] if transpose_rhs else w.shape[2]
    ws = two_consumer_tiles(op_tiles(cfg, op, x, w, w.shape[0]), "n", n, x.dtype)
    if ws is not None and not cfg.interpret and cfg.impl == "auto":
        ws = ws if pallas_compiles(f"{op}_ws", ws, x.dtype.name) else None
    return ws


def _pallas_dtype_ok(x, w):
    return x.dtype == w.dtype and x.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def constraint_error(op, tiles, x, w, out_dtype) -> Optional[str]:
    """Why the Pallas kernel cannot run ``op`` on these operands (None: it can)."""
    bm, bn, bk, steps, band = tiles
    if not _pallas_dtype_ok(x, w):
        return f"needs x and w of one 16-bit dtype, got {x.dtype}/{w.dtype}"
    if out_dtype != x.dtype:
        return f"output dtype must be the input dtype {x.dtype}, got {out_dtype}"
    if bm % 64 or bk % 16 or bn % 8 or not 8 <= bn <= 256 or bm > 256:
        return f"bad tiles {tiles}"
    if steps < 2 or band < 1:
        return f"bad tiles {tiles} (max_concurrent_steps >= 2, band >= 1)"
    m = x.shape[0]
    if m % 8:
        return f"needs M % 8 == 0 (tiled TMA layouts), got M={m}"
    if op == "fwd":        # x [M, K] @ w [G, K, N]
        k, n = x.shape[1], w.shape[2]
    elif op == "dx":       # x [M, N] @ w [G, K, N]^T
        k, n = x.shape[1], w.shape[1]
    else:                  # x [M, K]^T @ dy [M, N]
        k, n = x.shape[1], w.shape[1]
        if k % bm or n % bn:
            return f"dw needs K % block_m == 0 and N % block_n == 0 (K={k}, N={n}, tiles {tiles})"
        if m < bk:
            return f"dw needs M >= block_k (M={m})"
        return None
    if k % bk or n % bn:
        return f"{op} needs K % block_k == 0 and N % block_n == 0 (K={k}, N={n}, tiles {tiles})"
    if m < bm:
        return f"{op} needs M >= block_m (M={m})"
    return None


def _on_hopper() -> bool:
    try:
        if jax.default_backend() != "gpu":
            return False
        d = jax.devices()[0]
        return str(getattr(d, "compute_capability", "")).startswith("9")
    except Exception:  # pragma: no cover
        return False


@functools.lru_cache(maxsize=None)
def pallas_compiles(op: str, tiles: Tiles, dtype_name: str, cluster: int = 1) -> bool:
    """Compile a small instance of the kernel once; False (with a warning) on
    failure. ``cluster``: the dw kernel's CTAs per cluster."""
    bm, bn, bk, _, _ = tiles
    dt = jnp.dtype(dtype_name)
    g = 3
    sds = jax.ShapeDtypeStruct
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if op.startswith("dw"):
                m, k, n = 2 * bk + 8, 2 * bm, cluster * bn
                if op in ("dw_ws", "dw_ring"):
                    kern = tgmm_pallas_ws if op == "dw_ws" else tgmm_pallas_ring
                    f = lambda a, b, o: kern(a, b, o, tiles, dt, False, cluster)
                else:
                    f = lambda a, b, o: tgmm_pallas(a, b, o, tiles, dt, False)
                args = (sds((m, k), dt), sds((m, n), dt), sds((g + 1,), jnp.int32))
            else:   # fwd, dx, fwd_ws, dx_ws
                m, k, n = 2 * bm + 8, bk, 2 * bn
                t = op.startswith("dx")
                wshape = (g, n, k) if t else (g, k, n)
                if op.endswith("_ws"):
                    f = lambda a, b, o: gmm_pallas_ws(a, b, o, t, tiles, dt, False)
                else:
                    f = lambda a, b, o: gmm_pallas(a, b, o, t, tiles, dt, False)
                args = (sds((m, k), dt), sds(wshape, dt), sds((g + 1,), jnp.int32))
            jax.jit(f).lower(*args).compile()
        return True
    except Exception as e:  # noqa: BLE001 -- any failure means "use XLA"
        warnings.warn(f"jax_ep.grouped_matmul: Pallas {op} kernel with tiles {tiles} "
                      f"(cluster {cluster}) does not compile here ({type(e).__name__}: {str(e)[:200]}); using "
                      + ("a 1-CTA cluster" if cluster > 1
                         else "the per-group pipeline" if op == "dw_ring"
                         else "the 1-warpgroup kernel" if "_ws" in op else "jax.lax.ragged_dot")
                      + " instead")
        return False


def dw_pipeline(cfg: GroupedMatmulConfig, x, groups: int) -> str:
    """The 2-consumer dw kernel's pipeline: the config's, else ``DW_PIPELINE``
    by group size (``x``'s rows / ``groups`` <= SMALL_GROUP_ROWS: small)."""
    if cfg.dw_pipeline is not None:
        return cfg.dw_pipeline
    return DW_PIPELINE["small" if small_groups(x, groups) else "default"]


def dw_kernel_op(pipeline: str) -> str:
    """The compile-check key of the 2-consumer dw kernel with this pipeline."""
    return "dw_ring" if pipeline == "ring" else "dw_ws"


def dw_cluster(cfg: GroupedMatmulConfig, ws: Tiles, n: int, dtype, pipeline: str) -> int:
    """CTAs per cluster of the 2-consumer dw kernel with tiles ``ws``, ``N =
    n`` and this pipeline: the config's where ``N % (cluster block_n) == 0``
    (and, in auto mode on a GPU, the kernel compiles), else 1."""
    c = cfg.dw_cluster
    if c == 1 or n % (c * ws[1]):
        return 1
    if (not cfg.interpret and cfg.impl == "auto"
            and not pallas_compiles(dw_kernel_op(pipeline), ws, dtype.name, c)):
        return 1
    return c


def choose(cfg: GroupedMatmulConfig, op, x, w, out_dtype, groups: int) -> str:
    if cfg.impl == "xla":
        return "xla"
    tiles = op_tiles(cfg, op, x, w, groups)
    err = constraint_error(op, tiles, x, w, out_dtype)
    if cfg.impl == "pallas":
        if err is not None:
            raise ValueError(f"grouped_matmul impl='pallas': {err}")
        return "pallas"
    if err is not None or cfg.interpret or not _on_hopper():
        return "pallas" if (err is None and cfg.interpret) else "xla"
    return "pallas" if pallas_compiles(op, tiles, x.dtype.name) else "xla"
