// Host interface of the grouped-matmul kernels (jax_ep.gmm, CUDA backend):
// the fp8 forward / dx (fp8_nt.cu) and the fp8 dw (fp8_dw.cu).
//
// fp8 NT grouped matmul, the contract of jax_ep/gmm/pallas_fp8.py:
//   out[rows of g] = (x * xs)[rows of g] @ ((v * vs)[g])^T
// x [M, Kc] e4m3, xs_t [Kc/128, M] f32 (x's scales transposed: per 128 of the
// contraction, per row), v
// [G, N, Kc] e4m3, vs [G, N/128, Kc/128] f32 (128 x 128 blocks), f32
// accumulation promoted every 128 of the contraction, out [M, N] bf16 or f32.
// The rows come as a row-tile table of 256-row tiles (jax_ep/gmm/pallas_common.py
// row_tiles, bm = 256, its one-block tiles paired by jax_ep/gmm/cuda_fp8.py
// pair_one_block_tiles; the caller names the rows it cut, tile_rows, and the
// kernel refuses a table cut for other tiles): tile f loads rows
// [row_start[f], +256) (rows past m read as zeros) and stores [lo[f], hi[f])
// of group group[f]; group -1: zeros (rows past the groups' end).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep {

struct GmmFp8Args {
  const void* x = nullptr;          // [m, kc] e4m3
  const float* xs_t = nullptr;      // [kc/128, m]: the row scales, block-major
  const void* v = nullptr;          // [groups, n, kc] e4m3
  const float* vs = nullptr;        // [groups, n/128, kc/128]
  const int32_t* row_start = nullptr;   // the row-tile table, [tiles]
  const int32_t* lo = nullptr;
  const int32_t* hi = nullptr;
  const int32_t* group = nullptr;
  // [tiles]: a tile storing rows of its first 64-row block only, paired with
  // another such tile (its index, past the tiles counted), or -1
  const int32_t* partner = nullptr;
  const int32_t* counts = nullptr;  // [2]: group tiles, then tail tiles, first in the table
  int tiles = 0;                    // T, the table's length
  int tile_rows = 0;                // the rows per tile the table was cut at
  bool tma_store = false;           // bf16 out: full 64-row blocks by TMA (fp8_nt.cu); f32: ignored
  void* out = nullptr;              // [m, n]
  bool out_f32 = false;             // else bf16
  int m = 0, kc = 0, n = 0, groups = 0;
  int num_sms = 0;                  // CTAs (persistent); 0: one per SM of `device`
  int device = 0;                   // XLA's (= CUDA's) ordinal of the call
};

// Why the kernel cannot run these shapes ("" if it can): multiples of 128,
// m % 8 == 0 and m >= 128, a row-tile table of the kernel's tile rows whose
// T x N/128 output tiles stay below 2^30.
const char* gmm_fp8_shape_error(const GmmFp8Args& a);

cudaError_t launch_gmm_fp8_nt(const GmmFp8Args& a, cudaStream_t stream);

// fp8 dw, the contract of jax_ep/gmm/pallas_fp8_dw.py:
//   out[g] = Σ_{128-blocks b of segment g} (a[:, b] * as[b]) @ (c[:, b] * cs[b])^T
// a [Ka, P] e4m3, as [P/128, Ka] f32 (per row, per block), c [Nc, P] e4m3, cs
// [P/128, Nc] f32, segments [G+1] int32 (multiples of 128: group g owns
// columns [segments[g], segments[g+1]) of P); out [G, Ka, Nc] bf16 or f32, an
// empty group's zero.
struct GmmFp8DwArgs {
  const void* a = nullptr;
  const float* a_scales = nullptr;
  const void* c = nullptr;
  const float* c_scales = nullptr;
  const int32_t* segments = nullptr;
  void* out = nullptr;
  bool out_f32 = false;
  int ka = 0, nc = 0, p = 0, groups = 0;
  int num_sms = 0, device = 0;
};

const char* gmm_fp8_dw_shape_error(const GmmFp8DwArgs& a);

cudaError_t launch_gmm_fp8_dw(const GmmFp8DwArgs& a, cudaStream_t stream);

}  // namespace jax_ep
