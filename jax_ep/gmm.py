"""Grouped (ragged) matmul: the expert compute behind an ``expert_major`` dispatch.

``grouped_matmul(x [M, K], w [G, K, N], group_sizes [G]) -> [M, N]``

Rows are grouped contiguously, in group order, starting at row 0: group ``g``
owns rows ``[off[g], off[g+1])`` with ``off = concat([0], cumsum(group_sizes))``
and those rows are multiplied by ``w[g]``. Rows at or past
``total = sum(group_sizes)`` are *outside every group*: their output rows are
zero and their input values (which may be garbage, NaN or Inf, e.g. rows a
dispatch kernel left unwritten) never influence any result, forward or
backward. Group sizes live on the device; nothing is synchronised to the host.
Sizes are clipped so that ``off`` never exceeds ``M`` (a group that runs past
row ``M`` is cut at ``M``); negative sizes are not allowed.

Differentiable (``jax.custom_vjp``), with

* ``dx = grouped_matmul(dy, w^T)`` -- computed against ``w [G, K, N]`` in place
  (the kernel reads ``w[g]`` transposed from shared memory; ``w^T`` is never
  materialised), rows past ``total`` get zero gradient;
* ``dw[g] = x[rows of g]^T @ dy[rows of g]`` -- a grouped matmul that contracts
  over the ragged row dimension (``[G, K, N]``; zero for empty groups).
* ``group_sizes`` is integer and gets no gradient.

Safe under ``jit``, ``grad``, ``jax.checkpoint``/remat, ``vmap``-free
``shard_map`` with ``check_vma=True`` (operands are brought to the union of
their varying mesh axes and every result carries that type). bf16/f16/f32
inputs, f32 accumulation, output in ``x.dtype`` unless
``preferred_element_type`` says otherwise.

Implementations (``GroupedMatmulConfig.impl``):

* ``"pallas"``: Pallas Mosaic-GPU kernels in this module (Hopper, sm_90):
  persistent, one CTA per SM, TMA + WGMMA with a multi-stage shared-memory
  pipeline, f32 accumulators in registers. See "Pallas kernels" below.
* ``"xla"``: ``jax.lax.ragged_dot`` / ``ragged_dot_general`` (inputs' tail rows
  masked to zero first). Runs everywhere; slow on GPU (~5 TF/s on H200).
* ``"auto"`` (default): ``"pallas"`` on a Hopper GPU when the operation fits
  the kernels' constraints and a small instance of the kernel compiles (checked
  once per configuration), else ``"xla"``. The choice is made per operation
  (forward, dx, dw).

Pallas kernels
--------------
Forward and dx (``_gmm_pallas``): every non-empty group is cut into row tiles
of ``block_m`` rows starting at its first row rounded down to 8 (TMA row
offsets of the tiled shared-memory layout are 8-aligned; the up to 7 rows of
the previous group are computed and not stored), and the tail ``[total, M)``
into zero-store tiles. The tile table (row start, rows to store, group) is
computed on the device by XLA and handed to the kernel as int32 arrays; the
kernel loops over ``tiles x column tiles`` (persistent over SMs, ``band`` row
tiles iterated together for L2 reuse of ``w`` tiles), computes the full
``block_m x block_n`` tile against ``w[g]`` and stores only the group's rows
(TMA stores of power-of-two row counts). Tail tiles skip the matmul and store
zeros, so the output is fully written by the kernel (no extra masking pass);
rows of other groups or of the tail can only reach accumulator rows that are
never stored (a row's output depends on that row alone). Work:
``sum_g cdiv(size_g + lead_g, block_m)`` tiles -- under one extra tile per
group, none for empty groups and none past ``total`` (tiles cut at fixed
``block_m`` boundaries, an earlier version, cost one more tile per boundary
inside a block: 1.5x the work at ~256 rows per group).

dw: by default ``_tgmm_pallas_ws``, two consumer warpgroups fed by a producer
warpgroup (a CTA owns a ``2 block_m x block_n`` tile of ``dw[g]``; one
warp-specialized pipeline per (SM, group) across the SM's tiles, so loads of
the next tile overlap the epilogue of the last); where ``K % (2 block_m) != 0``
(or ``dw_warpgroups=1``) ``_tgmm_pallas``, one warpgroup with ``block_m x
block_n`` tiles and one shared-memory pipeline per work item ``(g, tile)``
(persistent over SMs). Either pipeline walks the rows of group ``g`` in steps
of ``block_k`` starting at ``off[g]`` rounded down to a multiple of 8 (the tiled shared-memory
layout needs 8-aligned TMA row offsets); on the first and last steps the rows
outside ``[off[g], off[g+1])`` are *selected* to zero in both operands (a
select, not a multiply, so NaN/Inf in neighbouring or tail rows cannot leak).
Empty groups store zeros.

Constraints of the Pallas path (checked; otherwise ``"auto"`` falls back to XLA
and ``"pallas"`` raises): x and w of the same 16-bit dtype (bf16/f16) and the
output in that dtype; ``block_m``/``block_n``/``block_k`` multiples of 64/64/16
(block_n 8..256), forward: ``K % block_k == 0`` and ``N % block_n == 0``; dx:
``N % block_k == 0`` and ``K % block_n == 0``; dw: ``K % block_m == 0`` and
``N % block_n == 0``; ``M % 8 == 0``, ``M >= block_m`` (forward/dx) and
``M >= block_k`` (dw).
Any group sizes (empty, skewed, unaligned, ``total < M``) are fine.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ._ffi import to_vma, vma_of

__all__ = ["GroupedMatmulConfig", "grouped_matmul", "gmm", "tgmm", "DEFAULT_TILES"]

# (block_m, block_n, block_k, max_concurrent_steps, band)
Tiles = Tuple[int, int, int, int, int]

# fwd/dx: best of the first H200 sweep (bench/results/history/2026-11-30-h200-grouped-
# matmul-first.md): 5 stages, band 2. dw: the 2-consumer kernel cuts the stages to
# fit shared memory (_two_consumer_tiles); a 1-warpgroup variant with one pipeline per (SM,
# group) measured slower and was deleted (bench/results/README.md, "Deleted variants").
DEFAULT_TILES = {
    "fwd": (128, 128, 64, 5, 2),
    "dx": (128, 128, 64, 5, 2),
    "dw": (128, 128, 64, 4, 4),
}

_IMPLS = ("auto", "pallas", "xla")


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """How :func:`grouped_matmul` runs (hashable; safe as a static argument).

    Attributes:
      impl: ``"auto"`` (Pallas Mosaic-GPU on Hopper where it applies, else
        XLA), ``"pallas"`` (force; raises when unsupported) or ``"xla"``
        (``jax.lax.ragged_dot``).
      fwd, dx, dw: tile configuration of the Pallas kernel for the forward
        ``x @ w[g]``, for ``dx = dy @ w[g]^T`` and for
        ``dw[g] = x[g]^T @ dy[g]``: a tuple
        ``(block_m, block_n, block_k, max_concurrent_steps, band)``, or ``None``
        for :data:`DEFAULT_TILES`. ``max_concurrent_steps`` is the number of
        shared-memory pipeline stages (>= 2); ``band`` is how many row
        tiles (forward/dx) or row tiles of ``dw`` are swept together per
        column tile (L2 locality).
      dw_warpgroups: consumer warpgroups of the dw kernel: 2 (a producer
        warpgroup feeds two consumers that own a ``2 block_m x block_n`` tile;
        used when ``K % (2 block_m) == 0``, else the 1-warpgroup kernel) or 1
        (one warpgroup loads and computes ``block_m x block_n`` tiles).
      fwd_warpgroups: consumer warpgroups of the forward / dx kernel: 2 (a
        producer warpgroup feeds two consumers that own ``block_m x 2
        block_n``; used where ``N % (2 block_n) == 0`` and the stages fit
        shared memory, else the 1-warpgroup kernel) or 1.
      interpret: run the Pallas kernels in Mosaic-GPU interpret mode (for
        testing the kernels on CPU; jax >= 0.11; very slow).
    """

    impl: str = "auto"
    fwd: Optional[Tiles] = None
    dx: Optional[Tiles] = None
    dw: Optional[Tiles] = None
    interpret: bool = False
    dw_warpgroups: int = 2
    fwd_warpgroups: int = 2

    def __post_init__(self):
        if self.impl not in _IMPLS:
            raise ValueError(f"impl must be one of {_IMPLS}, got {self.impl!r}")
        for name in ("dw_warpgroups", "fwd_warpgroups"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"{name} must be 1 or 2, got {getattr(self, name)!r}")
        for name in ("fwd", "dx", "dw"):
            t = getattr(self, name)
            if t is None:
                continue
            t = tuple(int(v) for v in t)
            if len(t) != 5:
                raise ValueError(f"{name} tiles must be (block_m, block_n, block_k, "
                                 f"max_concurrent_steps, band), got {t}")
            object.__setattr__(self, name, t)

    def tiles(self, op: str) -> Tiles:
        t = getattr(self, op)
        return DEFAULT_TILES[op] if t is None else t


# --------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------

def grouped_matmul(x, w, group_sizes, *, preferred_element_type=None,
                   config: Optional[GroupedMatmulConfig] = None,
                   impl: Optional[str] = None):
    """Grouped matmul ``out[rows of g] = x[rows of g] @ w[g]``; tail rows zero.

    Args:
      x: ``[M, K]`` rows grouped contiguously by group, starting at row 0.
        Rows at or past ``sum(group_sizes)`` may hold anything (NaN/Inf
        included); they never influence any result or gradient.
      w: ``[G, K, N]`` one matrix per group.
      group_sizes: ``[G]`` integer, on the device (never read on the host),
        non-negative; ``sum(group_sizes) <= M`` (groups running past row ``M``
        are cut at ``M``).
      preferred_element_type: output dtype (default ``x.dtype``); accumulation
        is always f32.
      config: a :class:`GroupedMatmulConfig` (default ``GroupedMatmulConfig()``).
      impl: shorthand overriding ``config.impl`` (``"auto"|"pallas"|"xla"``).

    Returns:
      ``[M, N]`` in ``preferred_element_type or x.dtype``; rows past
      ``sum(group_sizes)`` are zero.
    """
    cfg = config if config is not None else GroupedMatmulConfig()
    if impl is not None:
        cfg = dataclasses.replace(cfg, impl=impl)
    x = jnp.asarray(x)
    w = jnp.asarray(w)
    group_sizes = jnp.asarray(group_sizes)
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"expected x [M, K] and w [G, K, N], got {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"contracting dims differ: x {x.shape}, w {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must have shape ({w.shape[0]},), got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integer, got {group_sizes.dtype}")
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    # shard_map(check_vma=True): every operand varies over the union of axes;
    # pcast's transpose (a psum) then reduces dw for a replicated w.
    axes = vma_of(x) | vma_of(w) | vma_of(group_sizes)
    x, w, group_sizes = (to_vma(a, axes) for a in (x, w, group_sizes))
    return _gmm_vjp(x, w, group_sizes, cfg, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_vjp(x, w, group_sizes, cfg, out_dtype):
    return gmm(x, w, group_sizes, config=cfg, out_dtype=out_dtype)


def _gmm_vjp_fwd(x, w, group_sizes, cfg, out_dtype):
    return gmm(x, w, group_sizes, config=cfg, out_dtype=out_dtype), (x, w, group_sizes)


def _gmm_vjp_bwd(cfg, out_dtype, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)   # cotangent in the compute dtype (f32 accumulation inside)
    dx = gmm(dy, w, group_sizes, transpose_rhs=True, config=cfg, out_dtype=x.dtype)
    dw = tgmm(x, dy, group_sizes, config=cfg, out_dtype=w.dtype)
    axes = vma_of(x) | vma_of(w)
    return to_vma(dx, axes), to_vma(dw, axes), None


_gmm_vjp.defvjp(_gmm_vjp_fwd, _gmm_vjp_bwd)


# --------------------------------------------------------------------------
# the three operations (no autodiff rules of their own)
# --------------------------------------------------------------------------

def gmm(x, w, group_sizes, *, transpose_rhs: bool = False,
        config: Optional[GroupedMatmulConfig] = None, out_dtype=None):
    """Forward grouped matmul without a VJP rule.

    ``transpose_rhs=False``: ``x [M, K]``, ``w [G, K, N]`` -> ``[M, N]``.
    ``transpose_rhs=True``: ``x [M, N]``, ``w [G, K, N]`` -> ``[M, K]``
    (``x[rows of g] @ w[g]^T``; used for dx). Rows past ``sum(group_sizes)``
    are zero and their input is never used.
    """
    cfg = config if config is not None else GroupedMatmulConfig()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    op = "dx" if transpose_rhs else "fwd"
    offsets = _offsets(group_sizes, x.shape[0])
    if _choose(cfg, op, x, w, out_dtype) == "pallas":
        ws = _fwd_ws_tiles(cfg, op, x, w, transpose_rhs)
        if ws is not None:
            out = _gmm_pallas_ws(x, w, offsets, transpose_rhs, ws, out_dtype, cfg.interpret)
        else:
            out = _gmm_pallas(x, w, offsets, transpose_rhs, cfg.tiles(op), out_dtype,
                              cfg.interpret)
    else:
        out = _gmm_xla(x, w, offsets, transpose_rhs, out_dtype)
    return to_vma(out, vma_of(x) | vma_of(w) | vma_of(group_sizes))


def tgmm(x, dy, group_sizes, *, config: Optional[GroupedMatmulConfig] = None,
         out_dtype=None):
    """Ragged-contraction grouped matmul: ``out[g] = x[rows of g]^T @ dy[rows of g]``.

    ``x [M, K]``, ``dy [M, N]``, ``group_sizes [G]`` -> ``[G, K, N]`` (zero for
    empty groups); rows past ``sum(group_sizes)`` are never used.
    """
    cfg = config if config is not None else GroupedMatmulConfig()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    num_groups = group_sizes.shape[0]
    offsets = _offsets(group_sizes, x.shape[0])
    if _choose(cfg, "dw", x, dy, out_dtype) == "pallas":
        tiles = cfg.tiles("dw")
        ws = (_two_consumer_tiles(tiles, "m", x.shape[1], x.dtype) if cfg.dw_warpgroups == 2
              else None)
        if ws is not None and not cfg.interpret and cfg.impl == "auto":
            ws = ws if _pallas_compiles("dw_ws", ws, x.dtype.name) else None
        if ws is not None:
            out = _tgmm_pallas_ws(x, dy, offsets, ws, out_dtype, cfg.interpret)
        else:
            out = _tgmm_pallas(x, dy, offsets, tiles, out_dtype, cfg.interpret)
    else:
        out = _tgmm_xla(x, dy, offsets, num_groups, out_dtype)
    return to_vma(out, vma_of(x) | vma_of(dy) | vma_of(group_sizes))


_SMEM_BYTES = 227 * 1024   # Hopper: dynamic shared memory per block


def _two_consumer_tiles(tiles: Tiles, split: str, dim: int, dtype) -> Optional[Tiles]:
    """The tiles of a 2-consumer kernel, stages cut to fit shared memory, or
    None where it does not apply. ``split``: which tile side the two consumer
    warpgroups split, ``"m"`` (dw: CTA tile ``2 block_m x block_n``, needs
    ``dim = K`` divisible by ``2 block_m``) or ``"n"`` (forward/dx: CTA tile
    ``block_m x 2 block_n``, needs ``dim = N`` divisible by ``2 block_n``)."""
    bm, bn, bk, steps, band = tiles
    wide = 2 * bm if split == "m" else 2 * bn
    if dim % wide or bm * bn > 128 * 128:
        return None   # a consumer's f32 accumulator: at most 128 x 128 (registers)
    item = jnp.dtype(dtype).itemsize
    stage = bk * (bm + bn + wide // 2) * item     # one staged x tile and one w / dy tile
    fit = (_SMEM_BYTES - 2 * bm * bn * item - 4096) // stage   # 4 KiB: barriers, alignment
    if fit < 2:
        return None
    return (bm, bn, bk, int(min(steps, fit)), band)


def _fwd_ws_tiles(cfg, op, x, w, transpose_rhs) -> Optional[Tiles]:
    """Tiles of the 2-consumer forward/dx kernel, or None: the 1-warpgroup one."""
    if cfg.fwd_warpgroups != 2:
        return None
    n = w.shape[1] if transpose_rhs else w.shape[2]
    ws = _two_consumer_tiles(cfg.tiles(op), "n", n, x.dtype)
    if ws is not None and not cfg.interpret and cfg.impl == "auto":
        ws = ws if _pallas_compiles(f"{op}_ws", ws, x.dtype.name) else None
    return ws


def _offsets(group_sizes, m):
    """int32 ``[G+1]``: group g is rows ``[off[g], off[g+1])``, clipped to ``[0, m]``."""
    gs = jnp.clip(group_sizes.astype(jnp.int32), 0, m)   # clip first: no int32 overflow
    ends = jnp.minimum(jnp.cumsum(gs), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]).astype(jnp.int32)


# --------------------------------------------------------------------------
# XLA fallback
# --------------------------------------------------------------------------

def _row_mask(offsets, m):
    return (jnp.arange(m, dtype=jnp.int32) < offsets[-1])[:, None]


def _acc_type(dtype):
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else None


def _gmm_xla(x, w, offsets, transpose_rhs, out_dtype):
    m = x.shape[0]
    keep = _row_mask(offsets, m)
    xm = jnp.where(keep, x, jnp.zeros((), x.dtype))
    sizes = jnp.diff(offsets)
    if transpose_rhs:
        dn = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [2]), ([], [])),
            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        y = lax.ragged_dot_general(xm, w, sizes, dn,
                                   preferred_element_type=_acc_type(out_dtype))
    else:
        y = lax.ragged_dot(xm, w, sizes, preferred_element_type=_acc_type(out_dtype))
    return jnp.where(keep, y, jnp.zeros((), y.dtype)).astype(out_dtype)


def _tgmm_xla(x, dy, offsets, num_groups, out_dtype):
    m = x.shape[0]
    keep = _row_mask(offsets, m)
    xm = jnp.where(keep, x, jnp.zeros((), x.dtype))
    dym = jnp.where(keep, dy, jnp.zeros((), dy.dtype))
    dn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    out = lax.ragged_dot_general(xm, dym, jnp.diff(offsets), dn,
                                 preferred_element_type=_acc_type(out_dtype))
    assert out.shape[0] == num_groups
    return out.astype(out_dtype)


# --------------------------------------------------------------------------
# implementation choice
# --------------------------------------------------------------------------

def _pallas_dtype_ok(x, w):
    return x.dtype == w.dtype and x.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _constraint_error(op, tiles, x, w, out_dtype) -> Optional[str]:
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
def _pallas_compiles(op: str, tiles: Tiles, dtype_name: str) -> bool:
    """Compile a small instance of the kernel once; False (with a warning) on failure."""
    bm, bn, bk, _, _ = tiles
    dt = jnp.dtype(dtype_name)
    g = 3
    sds = jax.ShapeDtypeStruct
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if op.startswith("dw"):
                m, k, n = 2 * bk + 8, 2 * bm, bn
                kern = _tgmm_pallas_ws if op == "dw_ws" else _tgmm_pallas
                f = lambda a, b, o: kern(a, b, o, tiles, dt, False)
                args = (sds((m, k), dt), sds((m, n), dt), sds((g + 1,), jnp.int32))
            else:   # fwd, dx, fwd_ws, dx_ws
                m, k, n = 2 * bm + 8, bk, 2 * bn
                t = op.startswith("dx")
                wshape = (g, n, k) if t else (g, k, n)
                if op.endswith("_ws"):
                    f = lambda a, b, o: _gmm_pallas_ws(a, b, o, t, tiles, dt, False)
                else:
                    f = lambda a, b, o: _gmm_pallas(a, b, o, t, tiles, dt, False)
                args = (sds((m, k), dt), sds(wshape, dt), sds((g + 1,), jnp.int32))
            jax.jit(f).lower(*args).compile()
        return True
    except Exception as e:  # noqa: BLE001 -- any failure means "use XLA"
        warnings.warn(f"jax_ep.grouped_matmul: Pallas {op} kernel with tiles {tiles} "
                      f"does not compile here ({type(e).__name__}: {str(e)[:200]}); using "
                      + ("the 1-warpgroup kernel" if "_ws" in op else "jax.lax.ragged_dot")
                      + " instead")
        return False


def _choose(cfg: GroupedMatmulConfig, op, x, w, out_dtype) -> str:
    if cfg.impl == "xla":
        return "xla"
    err = _constraint_error(op, cfg.tiles(op), x, w, out_dtype)
    if cfg.impl == "pallas":
        if err is not None:
            raise ValueError(f"grouped_matmul impl='pallas': {err}")
        return "pallas"
    if err is not None or cfg.interpret or not _on_hopper():
        return "pallas" if (err is None and cfg.interpret) else "xla"
    return "pallas" if _pallas_compiles(op, cfg.tiles(op), x.dtype.name) else "xla"


# --------------------------------------------------------------------------
# Pallas Mosaic-GPU kernels (imported lazily: never needed on CPU)
# --------------------------------------------------------------------------

def _plgpu():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return pl, plgpu


def _transposed(plgpu, ref):
    """``ref`` viewed transposed (jax 0.11: ``ref.transpose``; 0.10: ``transpose_ref``)."""
    if hasattr(ref, "transpose"):
        try:
            return ref.transpose((1, 0))
        except (TypeError, NotImplementedError):
            pass
    return plgpu.transpose_ref(ref, (1, 0))


def _kernel_params(plgpu, interpret):
    kw = dict(compiler_params=plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    if interpret:
        kw["interpret"] = plgpu.InterpretGPUParams()
    return kw


def _num_sms(interpret) -> int:
    if interpret:
        return 4
    try:
        d = jax.devices()[0]
        n = int(getattr(d, "core_count", 0) or 0)
        if n > 0:
            return n
    except Exception:  # pragma: no cover
        pass
    return 132  # H100/H200 SXM


def _row_tiles(offsets, m, bm):
    """Row tiles of the forward/dx kernel: int32 ``start, lo, hi, group`` of static length.

    Each non-empty group ``g`` is cut into ``cdiv(size + lead, bm)`` tiles of
    ``bm`` rows starting at ``off[g]`` rounded down to 8 (``lead`` rows of the
    previous group are computed and not stored: 8-aligned TMA row offsets); the
    tail ``[total, m)`` into ``cdiv(m - total, bm)`` zero-store tiles
    (``group -1``). A tile stores rows ``[lo, hi)``; its loads start at
    ``start`` (moved back so the tile ends inside ``[0, m)``). Unused entries
    (``lo == hi``) come last. Per-group tiles waste < ``bm + 7`` rows per
    group, against up to ``2 bm`` for blocks cut at fixed ``bm`` boundaries.
    """
    g_count = offsets.shape[0] - 1
    off = offsets.astype(jnp.int32)
    start, end = off[:-1], off[1:]
    total = off[-1]
    a8 = (start // 8) * 8
    n_g = jnp.where(end > start, (end - a8 + (bm - 1)) // bm, 0)
    t8 = (total // 8) * 8
    n_tail = (m - t8 + (bm - 1)) // bm
    counts = jnp.concatenate([n_g, n_tail[None]])
    cum = jnp.cumsum(counts)
    first = cum - counts
    n_max = (m + (g_count + 1) * (bm + 7)) // bm + 1    # bound on sum(counts)
    t = jnp.arange(n_max, dtype=jnp.int32)
    grp = jnp.searchsorted(cum, t, side="right").astype(jnp.int32)   # g_count = tail
    used = grp <= g_count
    gc = jnp.minimum(grp, g_count)
    base = jnp.concatenate([a8, t8[None]])[gc]
    row = base + (t - first[gc]) * bm
    lo = jnp.maximum(row, jnp.concatenate([start, total[None]])[gc])
    hi = jnp.minimum(row + bm, jnp.concatenate([end, jnp.full((1,), m, jnp.int32)])[gc])
    row = jnp.maximum(jnp.minimum(row, m - bm), 0)      # m % 8 == 0: stays 8-aligned
    lo = jnp.where(used, lo, 0)
    hi = jnp.where(used, hi, 0)
    g = jnp.where(gc == g_count, -1, gc)
    return row.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32), g.astype(jnp.int32)


def _gmm_pallas(x, w, offsets, transpose_rhs, tiles, out_dtype, interpret):
    pl, plgpu = _plgpu()
    bm, bn, bk, steps, band = tiles
    m, k = x.shape
    if transpose_rhs:
        _, n, k2 = w.shape     # w [G, N_out, K_contract]
    else:
        _, k2, n = w.shape
    assert k == k2, (x.shape, w.shape, transpose_rhs)
    rs, r0, r1, grp = _row_tiles(offsets, m, bm)
    nf = r0.shape[0]
    grid_n = n // bn
    top = 1 << int(math.log2(bm))     # largest power of two <= bm

    def body(rs_ref, r0_ref, r1_ref, g_ref, x_ref, w_ref, o_ref):
        @plgpu.nd_loop((nf * grid_n,), collective_axes="sm")
        def _item(info):
            fi, ni = plgpu.planar_snake(info.index[0], (nf, grid_n), 0, band)
            lo = r0_ref[fi]
            hi = r1_ref[fi]
            g = g_ref[fi]

            @pl.when(hi > lo)
            def _():
                row0 = pl.multiple_of(rs_ref[fi], 8)

                def mma_scope(acc_ref):
                    @pl.when(g >= 0)
                    def _():
                        def step(_, x_smem, w_smem):
                            rhs = _transposed(plgpu, w_smem) if transpose_rhs else w_smem
                            plgpu.wgmma(acc_ref, x_smem, rhs)

                        w_spec = (plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk), delay_release=1)
                                  if transpose_rhs else
                                  plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=1))
                        plgpu.emit_pipeline(
                            step,
                            grid=(k // bk,),
                            in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk),
                                                      delay_release=1), w_spec],
                            max_concurrent_steps=steps,
                        )(x_ref.at[pl.ds(row0, bm), :], w_ref.at[jnp.maximum(g, 0)])
                    return acc_ref[...]

                acc = pl.run_scoped(mma_scope, plgpu.ACC((bm, bn)))

                def store_scope(o_smem):
                    o_smem[...] = acc.astype(o_smem.dtype)
                    plgpu.commit_smem()
                    _store_rows(pl, plgpu, o_smem, o_ref.at[:, pl.ds(ni * bn, bn)], lo, hi,
                                row0, top)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                pl.run_scoped(store_scope, plgpu.SMEM((bm, bn), out_dtype))

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(_num_sms(interpret),),
        grid_names=("sm",),
        **_kernel_params(plgpu, interpret),
    )
    return kernel(rs, r0, r1, grp, x, w)


def _dw_transforms(plgpu, dtype, bk, bn):
    """Shared-memory transforms of the dw kernels: the staged ``[bk, *]`` input
    tiles (swizzled along ``bk`` rows of 8) and the ``[*, bn]`` output tile."""
    item = jnp.dtype(dtype).itemsize

    def tiled(width):
        sw = plgpu.find_swizzle(width * item * 8)
        return (plgpu.TilingTransform((8, sw // item)), plgpu.SwizzleTransform(sw))
    return tiled(bk), tiled(bn)


def _zero_rows_outside(plgpu, ref, width, s, bk, lead, size):
    """dw k-step ``s`` of a group: zero the rows of the staged ``[bk, width]``
    tile outside ``[lead, lead + size)`` with a select (never a multiply: the
    neighbouring group's or the tail's rows may hold NaN/Inf)."""
    r = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bk, width), 0), plgpu.Layout.WGMMA)
    r = r + s * bk
    v = ref[...]
    ref[...] = jnp.where((r >= lead) & (r < lead + size), v, jnp.zeros_like(v))


def _tgmm_pallas(x, dy, offsets, tiles, out_dtype, interpret):
    pl, plgpu = _plgpu()
    bm, bn, bk, steps, band = tiles
    m, k = x.shape
    n = dy.shape[1]
    g_count = offsets.shape[0] - 1
    grid_m, grid_n = k // bm, n // bn
    tr, o_tr = _dw_transforms(plgpu, x.dtype, bk, bn)

    def body(off_ref, x_ref, dy_ref, o_ref):
        @plgpu.nd_loop((g_count, grid_m * grid_n), collective_axes="sm")
        def _item(info):
            g = info.index[0]
            mi, ni = plgpu.planar_snake(info.index[1], (grid_m, grid_n), 0, band)
            start = off_ref[g]
            size = off_ref[g + 1] - start
            # Tiled (8-row) shared-memory layouts need 8-aligned TMA row
            # offsets: start at the 8-row boundary at or before the group and
            # select away the `lead` rows of the previous group.
            astart = pl.multiple_of(lax.div(start, jnp.int32(8)) * 8, 8)
            lead = start - astart
            nsteps = lax.div(size + lead + (bk - 1), jnp.int32(bk))

            zero_outside = functools.partial(_zero_rows_outside, plgpu, bk=bk, lead=lead,
                                             size=size)

            def mma_scope(acc_ref):
                @pl.when(size > 0)
                def _():
                    def step(idx, x_smem, dy_smem):
                        s = idx[0]

                        @pl.when((s == 0) | (s == nsteps - 1))
                        def _():
                            zero_outside(x_smem, bm, s)
                            zero_outside(dy_smem, bn, s)
                            plgpu.commit_smem()

                        plgpu.wgmma(acc_ref, _transposed(plgpu, x_smem), dy_smem)

                    rows = pl.ds(astart, m)  # may run past M; steps past the group are never issued
                    plgpu.emit_pipeline(
                        step,
                        grid=(nsteps,),
                        in_specs=[
                            plgpu.BlockSpec((bk, bm), lambda s: (s, mi), delay_release=1,
                                            transforms=tr),
                            plgpu.BlockSpec((bk, bn), lambda s: (s, ni), delay_release=1,
                                            transforms=tr),
                        ],
                        max_concurrent_steps=steps,
                    )(x_ref.at[rows, :], dy_ref.at[rows, :])
                return acc_ref[...]

            acc = pl.run_scoped(mma_scope, plgpu.ACC((bm, bn)))

            def store_scope(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, o_ref.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(store_scope, plgpu.SMEM((bm, bn), out_dtype, transforms=o_tr))

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g_count, k, n), out_dtype),
        grid=(_num_sms(interpret),),
        grid_names=("sm",),
        **_kernel_params(plgpu, interpret),
    )
    return kernel(offsets.astype(jnp.int32), x, dy)


def _ws_step(pl, plgpu, sh, g, t0, lead, size, nsteps, store):
    """Pipeline body of the 2-consumer dw kernel for group ``g`` (``sh``: the
    kernel's static shape values): zero the rows outside the group on the first
    and last k-steps, one wgmma per consumer half, and on a tile's last k-step
    store the accumulator and reset it."""
    bm, bn, bk, cm, nsm, interpret = sh

    def step(idx, x_smem, dy_smem, carry):
        j, s = idx
        wg = lax.axis_index("wg")
        acc_ref, base = carry if interpret else (carry, None)

        @pl.when((s == 0) | (s == nsteps - 1))
        def _():
            # Both consumers select the same rows to zero (identical writes):
            # neither reads a half-masked tile.
            _zero_rows_outside(plgpu, x_smem, cm, s, bk, lead, size)
            _zero_rows_outside(plgpu, dy_smem, bn, s, bk, lead, size)
            plgpu.commit_smem()

        xs = x_smem.at[:, pl.ds(pl.multiple_of(wg * bm, bm), bm)]
        plgpu.wgmma(acc_ref, _transposed(plgpu, xs), dy_smem)
        plgpu.wgmma_wait(1)
        last = s == nsteps - 1
        if interpret:
            # The interpreter cannot store to an accumulator: emulate the
            # reset with a running base (test only).
            val = acc_ref[...]

            @pl.when(last)
            def _():
                store(g, t0 + j * nsm, val - base)
            return acc_ref, jnp.where(last, val, base)

        @pl.when(last)
        def _():
            plgpu.wgmma_wait(0)
            store(g, t0 + j * nsm, acc_ref[...])
            acc_ref[...] = jnp.zeros((bm, bn), jnp.float32)
        return acc_ref

    return step


def _ws_group(pl, plgpu, sh, refs, g, tile_of, store, n_tiles, rot_step, steps, tr):
    """Group ``g`` of the 2-consumer dw kernel on this SM: one warp-specialized
    pipeline over (this SM's tiles of g) x (g's k-steps); zeros for an empty group."""
    bm, bn, bk, cm, nsm, interpret = sh
    off_ref, x_ref, dy_ref = refs
    m = x_ref.shape[0]
    start = off_ref[g]
    size = off_ref[g + 1] - start
    rot = lax.rem(g * jnp.int32(rot_step), jnp.int32(nsm))
    t0 = lax.rem(lax.axis_index("sm") - rot + nsm, jnp.int32(nsm))
    cnt = jnp.where(t0 < n_tiles, lax.div(n_tiles - t0 + (nsm - 1), jnp.int32(nsm)), 0)
    cnt = cnt.astype(jnp.int32)
    astart = pl.multiple_of(lax.div(start, jnp.int32(8)) * 8, 8)
    lead = start - astart
    nsteps = lax.div(size + lead + (bk - 1), jnp.int32(bk))

    def compute_context(run):
        if interpret:
            pl.run_scoped(lambda a: run((a, a[...])), plgpu.ACC((bm, bn)))
        else:
            pl.run_scoped(run, plgpu.ACC((bm, bn)))

    # No allocations= here on purpose: the pipeline's own scoped allocation
    # synchronises the CTA on entry, which is what keeps this group's producer
    # from refilling the slot of the previous group's last step (never released
    # with delay_release=1) while a consumer may still read it. Hoisting the
    # allocations out of the group loop needs an explicit barrier here.
    @pl.when((size > 0) & (cnt > 0))
    def _():
        rows = pl.ds(astart, m)  # may run past M; steps past the group are never issued
        plgpu.emit_pipeline_warp_specialized(
            _ws_step(pl, plgpu, sh, g, t0, lead, size, nsteps, store),
            grid=(cnt, nsteps),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((bk, cm), lambda j, s: (s, tile_of(t0 + j * nsm)[0]),
                                delay_release=1, transforms=tr),
                plgpu.BlockSpec((bk, bn), lambda j, s: (s, tile_of(t0 + j * nsm)[1]),
                                delay_release=1, transforms=tr),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=steps,
            compute_context=compute_context,
        )(x_ref.at[rows, :], dy_ref.at[rows, :])

    @pl.when((size <= 0) & (cnt > 0) & (lax.axis_index("wg") < 2))
    def _():
        @pl.loop(0, cnt)
        def _(j):
            store(g, t0 + j * nsm, jnp.zeros((bm, bn), jnp.float32))


def _tgmm_pallas_ws(x, dy, offsets, tiles, out_dtype, interpret):
    """dw with two consumer warpgroups and a producer warpgroup (warp-specialized).

    A CTA owns a ``2 block_m x block_n`` tile of ``dw[g]`` (each consumer
    warpgroup one ``block_m x block_n`` half); per group, the SM's tiles (dealt
    round-robin, rotated per group) and the group's k-steps form ONE pipeline
    whose loads are issued by the producer warpgroup, so the next tile's loads
    are in flight while the consumers run the previous tile's epilogue (a
    group has only ~4 k-steps of 64 rows at V3 shapes: the epilogue and the
    pipeline fill are what the one-warpgroup kernel waits on).
    """
    pl, plgpu = _plgpu()
    bm, bn, bk, steps, band = tiles
    k, n = x.shape[1], dy.shape[1]
    g_count = offsets.shape[0] - 1
    cm = 2 * bm
    grid_m, grid_n = k // cm, n // bn
    n_tiles = grid_m * grid_n
    nsm = _num_sms(interpret)
    sh = (bm, bn, bk, cm, nsm, interpret)
    tr, o_tr = _dw_transforms(plgpu, x.dtype, bk, bn)

    def tile_of(t):
        return plgpu.planar_snake(t, (grid_m, grid_n), 0, band)

    def body(off_ref, x_ref, dy_ref, o_ref):
        def scoped(o_smem):
            wg = lax.axis_index("wg")

            def store(g, t, val):
                mi, ni = tile_of(t)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # this warpgroup's slot free
                o_smem[wg] = val.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem.at[wg], o_ref.at[g, pl.ds(mi * cm + wg * bm, bm), pl.ds(ni * bn, bn)])

            def group(g, carry):
                _ws_group(pl, plgpu, sh, (off_ref, x_ref, dy_ref), g, tile_of, store, n_tiles,
                          n_tiles % nsm, steps, tr)
                return carry

            lax.fori_loop(0, g_count, group, jnp.int32(0))

            @pl.when(wg < 2)
            def _():
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((2, bm, bn), out_dtype, transforms=o_tr),
                      collective_axes="wg")

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g_count, k, n), out_dtype),
        grid=(nsm,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        **_kernel_params(plgpu, interpret),
    )
    return kernel(offsets.astype(jnp.int32), x, dy)


def _store_rows(pl, plgpu, src_smem, dst, lo, hi, row0, top):
    """TMA-store rows ``[lo, hi)`` (absolute; the tile starts at ``row0``) of a
    staged tile to ``dst`` (indexed by absolute row) as a sum of power-of-two
    row counts (TMA boxes are static)."""
    count = hi - lo
    src = lo - row0
    p = top
    while p >= 1:
        bit = count & p

        @pl.when(bit != 0)
        def _(src=src, p=p):
            plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(src, p)], dst.at[pl.ds(row0 + src, p)])
        src = src + bit
        p //= 2


def _gmm_pallas_ws(x, w, offsets, transpose_rhs, tiles, out_dtype, interpret):
    """Forward / dx with two consumer warpgroups and a producer warpgroup.

    Same row tiles as :func:`_gmm_pallas` (per group, ``_row_tiles``); a CTA
    owns ``block_m x 2 block_n`` of the output (each consumer warpgroup one
    ``block_m x block_n`` half, sharing the staged ``x`` tile), and its k-loop
    is a warp-specialized pipeline: the producer warpgroup keeps
    ``max_concurrent_steps`` loads in flight while the consumers run wgmma.
    (Consumers splitting ``2 block_m x block_n`` instead, skipping a
    row-less half, measured no faster: bench/results/README.md.)
    """
    pl, plgpu = _plgpu()
    bm, bn, bk, steps, band = tiles
    m, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    rs, r0, r1, grp = _row_tiles(offsets, m, bm)
    nf, grid_n = r0.shape[0], n // (2 * bn)
    top = 1 << int(math.log2(bm))
    tr, _ = _dw_transforms(plgpu, x.dtype, bk, bn)
    w_block = (2 * bn, bk) if transpose_rhs else (bk, 2 * bn)

    def mma(_, x_smem, w_smem, acc_ref):
        wg = lax.axis_index("wg")
        cols = pl.ds(pl.multiple_of(wg * bn, bn), bn)
        rhs = (_transposed(plgpu, w_smem.at[cols, :]) if transpose_rhs
               else w_smem.at[:, cols])
        plgpu.wgmma(acc_ref, x_smem, rhs)
        # No delay_release: with the allocations hoisted out of the tile loop,
        # a stage still read by the last step's wgmma would be refilled by the
        # next tile's prologue.
        plgpu.wgmma_wait(0)
        return acc_ref

    def pipeline(compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            mma, grid=(k // bk,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=tr),
                      plgpu.BlockSpec(w_block, (lambda kk: (0, kk)) if transpose_rhs
                                      else (lambda kk: (kk, 0)), transforms=tr)],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps,
            compute_context=compute_context)

    def body(rs_ref, r0_ref, r1_ref, g_ref, x_ref, w_ref, o_ref):
        def scoped(o_smem, allocs):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((nf * grid_n,), collective_axes="sm")
            def _item(info):
                fi, ni = plgpu.planar_snake(info.index[0], (nf, grid_n), 0, band)
                lo, hi, g = r0_ref[fi], r1_ref[fi], g_ref[fi]
                row0 = pl.multiple_of(rs_ref[fi], 8)
                out = o_ref.at[:, pl.ds(ni * (2 * bn) + wg * bn, bn)]

                def store(val):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # our slot is free
                    o_smem[wg] = val.astype(o_smem.dtype)
                    plgpu.commit_smem()
                    _store_rows(pl, plgpu, o_smem.at[wg], out, lo, hi, row0, top)

                def compute_context(run):
                    def acc_scope(acc_ref):
                        run(acc_ref)
                        store(acc_ref[...])
                    pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

                cols = pl.ds(ni * (2 * bn), 2 * bn)
                w_view = (w_ref.at[jnp.maximum(g, 0), cols, :] if transpose_rhs
                          else w_ref.at[jnp.maximum(g, 0), :, cols])

                @pl.when((hi > lo) & (g >= 0))
                def _():
                    pipeline(compute_context)(x_ref.at[pl.ds(row0, bm), :], w_view,
                                              allocations=allocs)

                @pl.when((hi > lo) & (g < 0) & (wg < 2))
                def _():  # tail rows: zeros, no matmul
                    store(jnp.zeros((bm, bn), jnp.float32))

            @pl.when(wg < 2)
            def _():
                plgpu.wait_smem_to_gmem(0)

        x_view = x_ref.at[pl.ds(0, bm), :]
        w_view = w_ref.at[0, pl.ds(0, 2 * bn), :] if transpose_rhs else w_ref.at[0, :, pl.ds(0, 2 * bn)]
        allocs = pipeline(lambda run: None).get_allocations(x_view, w_view)   # sizes only
        pl.run_scoped(scoped, plgpu.SMEM((2, bm, bn), out_dtype), allocs, collective_axes="wg")

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(_num_sms(interpret),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        **_kernel_params(plgpu, interpret),
    )
    return kernel(rs, r0, r1, grp, x, w)
