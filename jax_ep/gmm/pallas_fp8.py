"""FP8 grouped matmul kernel (Pallas Mosaic GPU, Hopper): both operands
fp8-e4m3 and K-major, per-128 scales, f32 accumulation.

``out[rows of g] = (x · xs)[rows of g] @ ((v · vs)[g])^T``

- ``x`` ``[M, Kc]`` e4m3, ``xs`` ``[M, Kc/128]`` f32 (per row, per 128 of the contraction);
- ``v`` ``[G, Nout, Kc]`` e4m3 (the contraction contiguous: fp8 WGMMA takes
  K-major operands only), ``vs`` ``[G, Nout/128, Kc/128]`` f32 (128 x 128 blocks);
- ``offsets`` int32 ``[G+1]`` (``api._offsets``); rows past ``offsets[-1]`` are zero.

The forward of ``x @ w`` with ``w [G, K, N]`` calls it with ``v = w^T``
(``[G, N, K]``); dx = ``dy @ w[g]^T`` calls it with ``v = w`` as stored.
"""
from __future__ import annotations


def gmm_fp8_nt(x, xs, v, vs, offsets, *, tiles=None, out_dtype=None, interpret=False):
    """``[M, Nout]`` in ``out_dtype`` (see the module docstring)."""
    raise NotImplementedError("the fp8 grouped-matmul kernel is not written yet")
