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

The masked layout (DeepGEMM's "masked" grouped GEMM): ``x [G, C, K]`` (fp8:
``x_scales [G, C, K/128]``), group ``g`` its first ``group_sizes[g]`` rows
(clipped to ``C``), ``-> [G, C, N]``: a per-expert receive buffer of fixed
capacity, used as it is. The kernels run on ``x`` flattened to ``[G·C, K]``
with the groups at fixed starts (``rows.FixedStarts``): the same tile table
without tail tiles, so a group costs its own rows' tiles whatever ``C``.
Output rows at or past a group's size are not written by the kernels
(unspecified; zero on the XLA path); their input rows may hold anything and
get zero gradient. The backward's dx runs at fixed starts too; dw runs on
the flattened rows with those rows zeroed (``C`` rows per group of work).
Tiles are chosen for ``C`` rows per group unless
``GroupedMatmulConfig(expected_rows=...)`` says how many the groups hold.

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

* ``"pallas"``: Pallas Mosaic-GPU kernels in this package (Hopper, sm_90):
  persistent, one CTA per SM, TMA + WGMMA with a multi-stage shared-memory
  pipeline, f32 accumulators in registers. See "Pallas kernels" below.
* ``"xla"``: ``jax.lax.ragged_dot`` / ``ragged_dot_general`` (inputs' tail rows
  masked to zero first). Runs everywhere; slow on GPU (~5 TF/s on H200).
* ``"auto"`` (default): ``"pallas"`` on a Hopper GPU when the operation fits
  the kernels' constraints and a small instance of the kernel compiles (checked
  once per configuration), else ``"xla"``. The choice is made per operation
  (forward, dx, dw).

fp8 (``x_scales`` / ``w_scales``; module ``fp8``): ``x`` float8_e4m3fn
``[M, K]`` with f32 scales ``[M, K/128]`` (per row and 128 columns: fp8
dispatch's output, f32 or UE8M0 values; ``jax_ep.quantize_activations``),
``w`` e4m3 ``[G, K, N]`` with one f32 scale per 128 x 128 block ``[G, K/128,
N/128]`` (``jax_ep.quantize_weights``), or ``w_layout="gnk"``: ``[G, N, K]``
and ``[G, N/128, K/128]``. Output ``Σ_k (x·xs)(w·ws)`` accumulated in f32,
bf16 unless ``preferred_element_type``. The fp8 kernel (``pallas_fp8``,
Hopper) takes both operands K-major: the forward runs it on ``w^T`` for
``"gkn"`` (a transpose XLA fuses into the quantization when both are in one
jit; ``w_transposed=`` hands it the K-major copy made earlier) and on ``w``
for ``"gnk"``; dx (``GroupedMatmulConfig.fp8_dx``, default
in fp8: ``dy`` cast as dispatch casts it) on ``w`` for ``"gkn"`` and ``w^T``
for ``"gnk"``; dw in bf16 through ``tgmm`` on ``x·xs`` rounded to bf16
(``x``'s per-row scales vary along dw's contraction and cannot be applied
after an fp8 product), or with ``GroupedMatmulConfig.fp8_dw`` in fp8 on ``x·xs``
and ``dy`` recast per column and 128 rows (``fp8_columns``, ``pallas_fp8_dw``).
``GroupedMatmulConfig.fp8_kernel="cuda"`` runs the fp8 forward, dx and (with
``fp8_dw``) dw on the native extension's kernels (``cuda_fp8``; the Pallas
kernels' bits; the forward on 256-row tiles); the device's table picks the
family by default (CUDA; Pallas where the native extension is not loaded).
The fp8 kernel can run on CTA pairs that share
the x tile by TMA multicast where the output width is a multiple of 256
(``GroupedMatmulConfig.fp8_cluster=2``; by default where the device's table
says pairs win: on an H200, nowhere yet). Cotangents of fp8 operands are those of their
dequantized values (``w``: f32, ``x``: ``dy``'s dtype); the scales get none.
``"auto"`` runs the kernel on Hopper where it applies and a small instance
compiles (once), else the reference: dequantize to f32, ``ragged_dot`` at
HIGHEST precision (``"xla"``).

Layout of the package: ``api`` (``grouped_matmul``), ``ops`` (``gmm``,
``tgmm``: the operations without a VJP rule), ``fp8`` (the fp8 path),
``rows`` (where the groups' rows lie: offsets, or fixed starts),
``config`` (``GroupedMatmulConfig``), ``tiles`` (``FwdTiles``, ``DwTiles``:
the typed tile configs), ``registry`` (the kernel variants and what each
supports: ops, dtypes, devices, shapes, shared memory), ``devices`` (SM count
and shared memory per device kind), ``tuned_tiles.json`` + ``tuning`` (tuned
tiles per device kind), ``heuristic`` (which tuned tiles an operation asks
for), ``select`` (the plan: variant, tiles, cluster, tile store), ``probe`` (the
one-time compile check), ``xla`` (the ragged_dot fallback and the fp8
reference), ``pallas_common``, ``pallas_fwd``, ``pallas_dw``, ``pallas_fp8``
(the kernels).

Pallas kernels
--------------
Forward and dx (``pallas_fwd``: ``gmm_pallas``, and by default ``gmm_pallas_ws``, a
producer and two consumer warpgroups on a ``block_m x 2 block_n`` tile, one
warp-specialized pipeline per SM across all of its tiles, so the next tile's
loads are in flight while the last tile's accumulator is stored): every non-empty group is cut into row tiles
of ``block_m`` rows starting at its first row rounded down to 8 (TMA row
offsets of the tiled shared-memory layout are 8-aligned; the up to 7 rows of
the previous group are computed and not stored), and the tail ``[total, M)``
into zero-store tiles. The tile table (row start, rows to store, group) is
computed on the device by XLA and handed to the kernel as int32 arrays; the
kernel loops over ``tiles x column tiles`` (persistent over SMs, in the group
order by default: each group's row tiles together at each column tile, so a
``w`` tile is read from HBM once while in use; or a snake of ``band`` row
tiles), computes the full
``block_m x block_n`` tile against ``w[g]`` and stores only the group's rows
(TMA stores of power-of-two row counts). Tail tiles skip the matmul and store
zeros (in ``gmm_pallas_ws`` after the pipeline), so the output is fully written by the kernel (no extra masking pass);
rows of other groups or of the tail can only reach accumulator rows that are
never stored (a row's output depends on that row alone). Work:
``sum_g cdiv(size_g + lead_g, block_m)`` tiles -- under one extra tile per
group, none for empty groups and none past ``total`` (tiles cut at fixed
``block_m`` boundaries, an earlier version, cost one more tile per boundary
inside a block: 1.5x the work at ~256 rows per group).

Tiles: ``GroupedMatmulConfig``'s, else the device's tuned tiles
(``tuned_tiles.json``, by ``jax.devices()[0].device_kind``; kinds not in it
get the H200's); with small groups (``M / G``, or the config's ``expected_rows``, at most the entry's
``small_group_rows``, 96, and the config's tiles for the op unset) the ops
take the entry's small-group tiles where they fit the shape (forward: 64 x 256
tiles with 2 stages, dx: block_m 64, block_k 128; dw: block_m 64 with 5
stages; the measurements are in ``tuning``'s docstring).

dw (``pallas_dw``): two consumer warpgroups fed by a producer warpgroup (a
CTA owns a ``2 block_m x block_n`` tile of ``dw[g]``, loads of the next tile
overlap the epilogue of the last), on 2-CTA clusters (``dw_cluster=2``, the
default where ``N % (2 block_n) == 0``: a CTA pair owns adjacent column tiles
and shares the x tile by TMA multicast). By default ``tgmm_pallas_ring``: one
ring of pipeline stages per SM (cluster) across all groups, a hand-written
loop nest (group, this SM's tiles of it, k-steps), so the next group's loads
are in flight while the last group's tiles finish (0.79 of dense at V3 T 4096
shapes); where groups are small (the small-group tile bound)
``tgmm_pallas_ws``, one warp-specialized pipeline per (SM, group) across the
SM's tiles (the ring lost 5% there: one k-step per tile). Where ``K % (2
block_m) != 0`` (or ``dw_warpgroups=1``) ``tgmm_pallas``, one warpgroup with ``block_m x
block_n`` tiles and one shared-memory pipeline per work item ``(g, tile)``
(persistent over SMs). Either pipeline walks the rows of group ``g`` in steps
of ``block_k`` starting at ``off[g]`` rounded down to a multiple of 8 (the tiled shared-memory
layout needs 8-aligned TMA row offsets); on the steps that stage rows outside
``[off[g], off[g+1])`` (the first when ``off[g] % 8 != 0``, the last when the
group ends inside it) those rows are *selected* to zero in both operands (a
select, not a multiply, so NaN/Inf in neighbouring or tail rows cannot leak).
Empty groups store zeros.

The 2-consumer kernels (``gmm_pallas_ws``, ``tgmm_pallas_ws``) store a
consumer's accumulator through shared memory in 64-row chunks
(``EPILOGUE_ROWS``): half the staging of a 128-row tile, which fits a 4th
pipeline stage at the default tiles (``registry.Variant.fit`` cuts the
configured stages to what fits the device's shared memory).

Constraints of the Pallas path (checked; otherwise ``"auto"`` falls back to XLA
and ``"pallas"`` raises): x and w of the same 16-bit dtype (bf16/f16) and the
output in that dtype; ``block_m``/``block_n``/``block_k`` multiples of 64/64/16
(block_n 8..256), forward: ``K % block_k == 0`` and ``N % block_n == 0``; dx:
``N % block_k == 0`` and ``K % block_n == 0``; dw: ``K % block_m == 0`` and
``N % block_n == 0``; ``M % 8 == 0``, ``M >= block_m`` (forward/dx) and
``M >= block_k`` (dw); the 1-warpgroup kernels' stages within the device's
shared memory per block (the 2-consumer kernels cut their stages to fit).
Each kernel variant states these in ``registry``.
Any group sizes (empty, skewed, unaligned, ``total < M``) are fine.
"""
from __future__ import annotations

from .api import gmm, grouped_matmul, tgmm
from .config import GROUP_ALIGNMENT, GroupedMatmulConfig
from .quantize import quantize_swiglu, quantize_weights_pair
from .tiles import DwTiles, FwdTiles

__all__ = ["GroupedMatmulConfig", "grouped_matmul", "gmm", "tgmm", "FwdTiles", "DwTiles",
           "GROUP_ALIGNMENT", "quantize_weights_pair", "quantize_swiglu"]
