"""The kernel variants of the grouped matmul and what each supports.

A variant states the operations it runs (``fwd``: ``x @ w[g]``, ``dx``:
``dy @ w[g]^T``, ``dw``: ``x[g]^T @ dy[g]``), its tile family, the input
dtypes and devices it runs on, the shapes and alignments it needs and the
shared memory it uses; ``select`` asks these questions and nothing else.

The fp8 variants (:class:`Fp8Variant`) run the fp8 path's forward and dx in
the fp8 kernel's form ``(x * xs) @ ((v * vs)[g])^T`` (both operands K-major,
``pallas_fp8``), and its dw either on the bf16 variants above or, with
``fp8_dw``, in the fp8 dw kernel's form (``pallas_fp8_dw``); with
``fp8_kernel="cuda"`` the native extension's kernels of the same contracts
(``cuda_fp8``) run them.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from ..fp8 import FP8_BLOCK
from . import cuda_fp8, pallas_fp8, pallas_fp8_dw
from .devices import DeviceInfo
from .pallas_common import EPILOGUE_ROWS
from .pallas_dw import tgmm_pallas, tgmm_pallas_ring, tgmm_pallas_ws
from .pallas_fwd import gmm_pallas, gmm_pallas_ws
from .tiles import DwTiles, FwdTiles
from .xla import gmm_fp8_nt_xla, gmm_xla, tgmm_fp8_nt_xla, tgmm_xla

# Beside the staged tiles: the pipeline's barriers and buffer alignment (Mosaic
# counts 64 bytes at the default tiles; the kernels have no reductions, so no
# reduction scratch).
SMEM_RESERVE = 1024
# A consumer's f32 accumulator lives in registers: at most 128 x 128 per warpgroup.
MAX_ACC_ELEMENTS = 128 * 128
_PALLAS_DTYPES = ("bfloat16", "float16")
_HOPPER = ("9",)   # compute capability majors the Mosaic-GPU kernels are written for


def op_dims(op, x, w):
    """``(M, K, N)`` of ``op``: rows, contraction (per-row width of ``x``) and
    output columns (``w`` is ``dy`` for dw, whose output is ``[G, K, N]``)."""
    if op == "fwd":      # x [M, K] @ w [G, K, N]
        return x.shape[0], x.shape[1], w.shape[2]
    return x.shape[0], x.shape[1], w.shape[1]   # dx: x [M, N] @ w [G, K, N]^T; dw: x^T @ dy [M, N]


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    ops: Tuple[str, ...]
    tiles_type: Optional[type]         # FwdTiles / DwTiles; None: takes no tiles (XLA)
    dtypes: Optional[Tuple[str, ...]]  # x's and w's (one) dtype; None: any
    archs: Tuple[str, ...]             # compute capability majors (a kind's: devices.py); (): any
    split: Optional[str]               # 2 consumers split the CTA tile along "m" / "n"; None: 1
    launch: Callable                   # (x, w, offsets, op, tiles, cluster, out_dtype, interpret)
    probe: Optional[Callable] = None   # (op, tiles, dtype, cluster) -> (fn, args): compile check
    fallback: str = ""                 # what runs instead when it does not compile (warning text)

    def runs_on(self, dev: DeviceInfo) -> bool:
        return _runs_on(self.archs, dev)

    def supports(self, op, tiles, x, w, out_dtype, dev: DeviceInfo) -> bool:
        """Whether this variant runs ``op`` with ``tiles`` on these operands
        on ``dev`` (the 2-consumer kernels: with their stages cut to fit)."""
        if not self.runs_on(dev) or self.check(op, tiles, x, w, out_dtype, dev) is not None:
            return False
        return self.split is None or self.fit(op, tiles, x, w, dev) is not None

    def check(self, op, tiles, x, w, out_dtype, dev: DeviceInfo) -> Optional[str]:
        """Why this variant cannot run ``op`` with ``tiles`` on these operands
        (None: it can). Devices are ``runs_on``'s question."""
        if op not in self.ops:
            return f"{self.name} does not run {op}"
        if self.tiles_type is not None and not isinstance(tiles, self.tiles_type):
            return f"{self.name} takes {self.tiles_type.__name__}, got {tiles!r}"
        if self.dtypes is None:
            return None
        if not (x.dtype == w.dtype and jnp.dtype(x.dtype).name in self.dtypes):
            return f"needs x and w of one 16-bit dtype, got {x.dtype}/{w.dtype}"
        if out_dtype != x.dtype:
            return f"output dtype must be the input dtype {x.dtype}, got {out_dtype}"
        err = _tile_error(op, tiles, x, w)
        if err is None and self.split is None and self.smem_bytes(tiles, x.dtype) > dev.smem_per_block:
            err = (f"tiles {tiles} need {self.smem_bytes(tiles, x.dtype)} bytes of shared "
                   f"memory, the device has {dev.smem_per_block}")
        return err

    def smem_bytes(self, tiles, dtype) -> int:
        """Shared memory of the kernel at ``tiles`` (a lower bound for the
        1-warpgroup kernels: their stages, or their output tile, which is
        staged after the pipeline is gone)."""
        item = jnp.dtype(dtype).itemsize
        bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
        if self.split is None:
            return max(tiles.stages * bk * (bm + bn) * item, bm * bn * item) + SMEM_RESERVE
        stage, out = _two_consumer_bytes(bm, bn, bk, self.split, item)
        return tiles.stages * stage + out + SMEM_RESERVE

    def fit(self, op, tiles, x, w, dev: DeviceInfo):
        """The tiles the 2-consumer kernel runs for ``tiles`` (stages cut to
        what fits the device's shared memory), or None where it does not
        apply: the split side not divisible by the CTA tile, an accumulator
        too large for registers, fewer than 2 stages fit."""
        _, k, n = op_dims(op, x, w)
        dim, wide = (k, 2 * tiles.block_m) if self.split == "m" else (n, 2 * tiles.block_n)
        if dim % wide or tiles.block_m * tiles.block_n > MAX_ACC_ELEMENTS:
            return None
        stage, out = _two_consumer_bytes(tiles.block_m, tiles.block_n, tiles.block_k, self.split,
                                         jnp.dtype(x.dtype).itemsize)
        fit = (dev.smem_per_block - out - SMEM_RESERVE) // stage
        if fit < 2:
            return None
        return dataclasses.replace(tiles, stages=int(min(tiles.stages, fit)))


def _runs_on(archs, dev: DeviceInfo) -> bool:
    if not archs:
        return True
    return dev.platform == "gpu" and dev.compute_capability.split(".")[0] in archs


def _two_consumer_bytes(bm, bn, bk, split, item):
    """(one pipeline stage: an x tile and a w / dy tile of the CTA tile, the
    output slots of both consumers: ``EPILOGUE_ROWS`` rows each)."""
    wide = 2 * bm if split == "m" else 2 * bn
    return bk * (bm + bn + wide // 2) * item, 2 * EPILOGUE_ROWS * bn * item


def _tile_error(op, tiles, x, w) -> Optional[str]:
    """The Pallas kernels' common constraints on tiles and shapes."""
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    if bm % 64 or bk % 16 or bn % 8 or not 8 <= bn <= 256 or bm > 256:
        return f"bad tiles {tiles}"
    if tiles.stages < 2 or tiles.band < (1 if op == "dw" else 0):
        return (f"bad tiles {tiles} (stages >= 2; band >= 1, or 0 for the group order of "
                "the forward and dx)")
    m, k, n = op_dims(op, x, w)
    if m % 8:
        return f"needs M % 8 == 0 (tiled TMA layouts; the masked layout: G * C), got M={m}"
    if op == "dw":
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


# ------------------------------------------------------------- the variants

_G = 3   # groups of a compile-check instance


def _gmm_probe(kernel):
    def probe(op, tiles, dt, cluster):
        m, k, n = 2 * tiles.block_m + 8, tiles.block_k, 2 * tiles.block_n
        t = op == "dx"
        wshape = (_G, n, k) if t else (_G, k, n)
        return ((lambda a, b, o: kernel(a, b, o, t, tiles, dt, False)),
                ((m, k), wshape, (_G + 1,)))
    return probe


def _tgmm_probe(kernel, clustered):
    def probe(op, tiles, dt, cluster):
        m, k, n = 2 * tiles.block_k + 8, 2 * tiles.block_m, cluster * tiles.block_n
        f = ((lambda a, b, o: kernel(a, b, o, tiles, dt, False, cluster)) if clustered
             else (lambda a, b, o: kernel(a, b, o, tiles, dt, False)))
        return f, ((m, k), (m, n), (_G + 1,))
    return probe


GMM = Variant(
    "gmm", ("fwd", "dx"), FwdTiles, _PALLAS_DTYPES, _HOPPER, None,
    lambda x, w, off, op, t, c, od, i: gmm_pallas(x, w, off, op == "dx", t, od, i),
    _gmm_probe(gmm_pallas), "jax.lax.ragged_dot")
GMM_WS = Variant(
    "gmm_ws", ("fwd", "dx"), FwdTiles, _PALLAS_DTYPES, _HOPPER, "n",
    lambda x, w, off, op, t, c, od, i: gmm_pallas_ws(x, w, off, op == "dx", t, od, i),
    _gmm_probe(gmm_pallas_ws), "the 1-warpgroup kernel")
TGMM = Variant(
    "tgmm", ("dw",), DwTiles, _PALLAS_DTYPES, _HOPPER, None,
    lambda x, dy, off, op, t, c, od, i: tgmm_pallas(x, dy, off, t, od, i),
    _tgmm_probe(tgmm_pallas, False), "jax.lax.ragged_dot")
TGMM_WS = Variant(
    "tgmm_ws", ("dw",), DwTiles, _PALLAS_DTYPES, _HOPPER, "m",
    lambda x, dy, off, op, t, c, od, i: tgmm_pallas_ws(x, dy, off, t, od, i, c),
    _tgmm_probe(tgmm_pallas_ws, True), "the 1-warpgroup kernel")
TGMM_RING = Variant(
    "tgmm_ring", ("dw",), DwTiles, _PALLAS_DTYPES, _HOPPER, "m",
    lambda x, dy, off, op, t, c, od, i: tgmm_pallas_ring(x, dy, off, t, od, i, c),
    _tgmm_probe(tgmm_pallas_ring, True), "the per-group pipeline")


def _xla_launch(x, w, off, op, tiles, cluster, out_dtype, interpret):
    if op == "dw":
        return tgmm_xla(x, w, off, off.shape[0] - 1, out_dtype)
    return gmm_xla(x, w, off, op == "dx", out_dtype)


XLA = Variant("xla", ("fwd", "dx", "dw"), None, None, (), None, _xla_launch)


# ------------------------------------------------------------- the fp8 variants

_E4M3 = "float8_e4m3fn"


@dataclasses.dataclass(frozen=True)
class Fp8Variant:
    """An fp8 grouped matmul in a kernel's NT form. Forward and dx: ``x [M,
    Kc]`` e4m3 with ``xs [M, Kc/128]`` f32, ``v [G, Nout, Kc]`` e4m3 with ``vs
    [G, Nout/128, Kc/128]`` f32 -> ``[M, Nout]`` (forward: ``v = w^T``; dx:
    ``v = w``), ``launch`` taking row offsets. dw: ``x`` is ``a [Ka, P]``
    with ``as [P/128, Ka]``, ``v`` is ``c [Nc, P]`` with ``cs [P/128, Nc]``
    -> ``[G, Ka, Nc]``, ``launch`` taking segment starts
    (``pallas_fp8_dw``)."""
    name: str
    ops: Tuple[str, ...]
    archs: Tuple[str, ...]             # compute capability majors; (): any
    out_dtypes: Optional[Tuple[str, ...]]   # None: any float
    # forward / dx: (x, xs, v, vs, offsets, out_dtype, interpret, cluster, tma_store),
    # tma_store the CUDA kernel's TMA tile stores (select.fp8_tma_store), ignored by
    # the others; dw: (a, as, c, cs, segments, out_dtype, interpret, cluster)
    launch: Callable
    probe: Optional[Callable] = None   # (op, tiles, dtype, cluster) -> (fn, args)
    fallback: str = ""
    # (x, xs, v, vs) -> why the kernel cannot run them: shapes, alignment, the
    # operands' agreement with their scales (the API checked them for the user)
    kernel_check: Optional[Callable] = None

    def runs_on(self, dev: DeviceInfo) -> bool:
        return _runs_on(self.archs, dev)

    def check(self, op, x, xs, v, vs, out_dtype) -> Optional[str]:
        """Why this variant cannot run ``op`` on these operands (None: it can)."""
        if op not in self.ops:
            return f"{self.name} does not run {op}"
        if not (jnp.dtype(x.dtype).name == _E4M3 and jnp.dtype(v.dtype).name == _E4M3):
            return f"needs {_E4M3} operands, got {x.dtype}/{v.dtype}"
        if xs.dtype != jnp.float32 or vs.dtype != jnp.float32:
            return f"needs float32 scales, got {xs.dtype}/{vs.dtype}"
        if self.out_dtypes is not None and jnp.dtype(out_dtype).name not in self.out_dtypes:
            return f"writes {'/'.join(self.out_dtypes)}, not {jnp.dtype(out_dtype).name}"
        return self.kernel_check(x, xs, v, vs) if self.kernel_check else None


def _fp8_probe(op, tiles, dt, cluster):
    m, kc, nout = 2 * FP8_BLOCK + 8, 2 * FP8_BLOCK, 2 * FP8_BLOCK
    f32, e4 = jnp.float32, jnp.dtype(_E4M3)
    sds = jax.ShapeDtypeStruct
    return ((lambda x, xs, v, vs, o: pallas_fp8.gmm_fp8_nt(x, xs, v, vs, o, tiles=tiles,
                                                           out_dtype=jnp.bfloat16,
                                                           cluster=cluster)),
            (sds((m, kc), e4), sds((m, kc // FP8_BLOCK), f32), sds((_G, nout, kc), e4),
             sds((_G, nout // FP8_BLOCK, kc // FP8_BLOCK), f32), (_G + 1,)))


# pallas_fp8.gmm_fp8_nt is looked up at each call (not bound here), so a test
# can stand a reference implementation of its contract in for it.
FP8_PALLAS = Fp8Variant(
    "gmm_fp8", ("fwd", "dx"), _HOPPER, ("bfloat16", "float32"),
    lambda x, xs, v, vs, off, od, i, c, t: pallas_fp8.gmm_fp8_nt(
        x, xs, v, vs, off, tiles=None, out_dtype=od, cluster=c, interpret=i),
    _fp8_probe, "the dequantizing XLA reference", pallas_fp8.check_fp8_nt)


def _fp8_cuda_probe(op, tiles, dt, cluster):
    fn, shapes = _fp8_probe(op, tiles, dt, cluster)
    return ((lambda x, xs, v, vs, o: cuda_fp8.gmm_fp8_nt_cuda(x, xs, v, vs, o)), shapes)


# the same contract as FP8_PALLAS, run by the CUDA kernel of the native extension
FP8_CUDA = Fp8Variant(
    "gmm_fp8_cuda", ("fwd", "dx"), _HOPPER, ("bfloat16", "float32"),
    lambda x, xs, v, vs, off, od, i, c, t: cuda_fp8.gmm_fp8_nt_cuda(
        x, xs, v, vs, off, out_dtype=od, tma_store=t),
    _fp8_cuda_probe, "the dequantizing XLA reference", cuda_fp8.check_fp8_nt_cuda)
FP8_XLA = Fp8Variant(
    "fp8_xla", ("fwd", "dx"), (), None,
    lambda x, xs, v, vs, off, od, i, c, t: gmm_fp8_nt_xla(x, xs, v, vs, off, od))


def _fp8_dw_probe(op, tiles, dt, cluster):
    ka, nc, p = FP8_BLOCK, 2 * FP8_BLOCK, 3 * FP8_BLOCK
    f32, e4 = jnp.float32, jnp.dtype(_E4M3)
    sds = jax.ShapeDtypeStruct
    return ((lambda a, a_s, c, c_s, seg: pallas_fp8_dw.tgmm_fp8_nt(a, a_s, c, c_s, seg,
                                                                  out_dtype=jnp.bfloat16)),
            (sds((ka, p), e4), sds((p // FP8_BLOCK, ka), f32), sds((nc, p), e4),
             sds((p // FP8_BLOCK, nc), f32), (_G + 1,)))


FP8_DW_PALLAS = Fp8Variant(
    "tgmm_fp8", ("dw",), _HOPPER, ("bfloat16", "float32"),
    lambda a, a_s, c, c_s, seg, od, i, cl: pallas_fp8_dw.tgmm_fp8_nt(a, a_s, c, c_s, seg,
                                                                     out_dtype=od, interpret=i),
    _fp8_dw_probe, "the dequantizing XLA reference", pallas_fp8_dw.check_fp8_dw)


def _fp8_dw_cuda_probe(op, tiles, dt, cluster):
    fn, shapes = _fp8_dw_probe(op, tiles, dt, cluster)
    return ((lambda a, a_s, c, c_s, seg: cuda_fp8.tgmm_fp8_nt_cuda(a, a_s, c, c_s, seg)), shapes)


FP8_DW_CUDA = Fp8Variant(
    "tgmm_fp8_cuda", ("dw",), _HOPPER, ("bfloat16", "float32"),
    lambda a, a_s, c, c_s, seg, od, i, cl: cuda_fp8.tgmm_fp8_nt_cuda(a, a_s, c, c_s, seg,
                                                                     out_dtype=od),
    _fp8_dw_cuda_probe, "the dequantizing XLA reference", cuda_fp8.check_fp8_dw_cuda)
FP8_DW_XLA = Fp8Variant(
    "fp8_dw_xla", ("dw",), (), None,
    lambda a, a_s, c, c_s, seg, od, i, cl: tgmm_fp8_nt_xla(a, a_s, c, c_s, seg, od))

VARIANTS = {v.name: v for v in (GMM, GMM_WS, TGMM, TGMM_WS, TGMM_RING, XLA, FP8_PALLAS,
                                FP8_CUDA, FP8_DW_PALLAS, FP8_DW_CUDA)}

# The 1-warpgroup kernel of each op: its constraints decide whether the op
# runs on Pallas at all; the 2-consumer kernels are preferred where they fit.
BASE = {"fwd": GMM, "dx": GMM, "dw": TGMM}
TWO_CONSUMER = {"fwd": GMM_WS, "dx": GMM_WS}
DW_PIPELINE_VARIANT = {"per_group": TGMM_WS, "ring": TGMM_RING}
