// What the fp8 block casts of quant/ share: a CTA of 256 threads casts one
// 128 x 128 block and writes it transposed through shared memory.
//
// Thread (warp w, lane l) holds column chunk c = l % 16 (8 columns) of rows
// 4ρ..4ρ+3 and 64+4ρ..64+4ρ+3 (ρ = 2w + l/16): its loads are 16 lanes over
// one row (coalesced), and for each of its 8 columns the 4 rows' fp8 bytes
// form one 32-bit word of the transposed block, stored to shared memory and
// read back as the rows of the transpose (coalesced). The word at (column n,
// word wc) sits at n*33 + (wc ^ 2(n/8)): the padding and the swizzle make both
// the stores and the reads free of bank conflicts.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace jax_ep {
namespace block_t {

constexpr int kBlock = 128;
constexpr int kThreads = 256;
constexpr int kRowWords = kBlock / 4 + 1;   // a transposed row of 128 bytes, padded
constexpr int kTileWords = kBlock * kRowWords;

// This thread's column chunk and row quad (see above).
__device__ __forceinline__ int chunk() { return threadIdx.x % 32 % 16; }
__device__ __forceinline__ int quad() { return 2 * (threadIdx.x / 32) + threadIdx.x % 32 / 16; }
// Row i (< 4) of half h (< 2) of this thread's rows.
__device__ __forceinline__ int row_of(int h, int i) { return 64 * h + 4 * quad() + i; }

__device__ __forceinline__ int t_word(int n, int wc) {
  return n * kRowWords + (wc ^ ((n >> 3) << 1));
}

// 8 values -> 8 e4m3 bytes (little-endian: column j is byte j % 4 of word
// j / 4), value j times inv[j] (saturating, round to nearest even).
__device__ __forceinline__ uint2 cast8(const float* f, const float* inv) {
  uint2 r;
  unsigned short* h = reinterpret_cast<unsigned short*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    h[i] = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(f[2 * i], inv[2 * i]), __fmul_rn(f[2 * i + 1], inv[2 * i + 1])),
        __NV_SATFINITE, __NV_E4M3);
  return r;
}
// The same with one multiplier for all 8 values.
__device__ __forceinline__ uint2 cast8(const float* f, float inv) {
  const float invs[8] = {inv, inv, inv, inv, inv, inv, inv, inv};
  return cast8(f, invs);
}

// The bytes b[i] of rows row_of(h, i) (this thread's 8 columns each) into
// the transposed tile: column j's 4 bytes make one word of transposed row
// 8 * chunk() + j.
__device__ __forceinline__ void put_t_words(uint32_t* tile, const uint2 (&b)[4], int h) {
  const int c = chunk(), rho = quad();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int sel = (j % 4) | ((4 + j % 4) << 4);
    const uint32_t r01 = __byte_perm(j < 4 ? b[0].x : b[0].y, j < 4 ? b[1].x : b[1].y, sel);
    const uint32_t r23 = __byte_perm(j < 4 ? b[2].x : b[2].y, j < 4 ? b[3].x : b[3].y, sel);
    tile[t_word(8 * c + j, 16 * h + rho)] = __byte_perm(r01, r23, 0x5410);
  }
}

// The transposed tile (after a __syncthreads) to dst: transposed row n at
// dst + n * ld, 128 bytes each, 8 threads x 16 bytes a row.
__device__ __forceinline__ void store_t_tile(const uint32_t* tile, char* dst, long long ld) {
  const int q4 = threadIdx.x % 8;
#pragma unroll
  for (int p = 0; p < kBlock / (kThreads / 8); ++p) {
    const int n = p * (kThreads / 8) + threadIdx.x / 8;
    uint4 v;
    v.x = tile[t_word(n, 4 * q4)];
    v.y = tile[t_word(n, 4 * q4 + 1)];
    v.z = tile[t_word(n, 4 * q4 + 2)];
    v.w = tile[t_word(n, 4 * q4 + 3)];
    *reinterpret_cast<uint4*>(dst + n * ld + 16 * q4) = v;
  }
}

}  // namespace block_t
}  // namespace jax_ep
