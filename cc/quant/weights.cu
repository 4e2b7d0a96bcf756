// Expert weights to fp8 in both layouts in one pass (quant/kernels.h).
//
// One CTA per 128 x 128 block of w[g], 256 threads. Thread (warp w, lane l)
// holds column chunk c = l % 16 (8 columns) of rows 4ρ..4ρ+3 and 64+4ρ..
// (ρ = 2w + l/16): its loads are 16 lanes over one row (coalesced), and for
// each of its 8 columns the 4 rows' fp8 bytes form one 32-bit word of the
// transposed block, stored to shared memory and read back as the rows of
// q_t (coalesced). The word at (column n, word wc) sits at n*33 + (wc ^
// 2(n/8)): the padding and the swizzle make both the stores and the reads
// free of bank conflicts.
#include <cuda_bf16.h>

#include "common/fp8_cast.cuh"
#include "quant/kernels.h"

namespace jax_ep {

namespace {

constexpr int kBlock = 128;
constexpr int kThreads = 256;
constexpr int kRowWords = kBlock / 4 + 1;   // a transposed row of 128 bytes, padded

__device__ __forceinline__ int t_word(int n, int wc) { return n * kRowWords + (wc ^ ((n >> 3) << 1)); }

// 8 values -> 8 e4m3 bytes (little-endian: column j is byte j % 4 of word j / 4).
__device__ __forceinline__ uint2 cast8(const float* f, float inv) {
  uint2 r;
  unsigned short* h = reinterpret_cast<unsigned short*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    h[i] = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(f[2 * i], inv), __fmul_rn(f[2 * i + 1], inv)),
                                    __NV_SATFINITE, __NV_E4M3);
  return r;
}

template <typename Tin>
__global__ void __launch_bounds__(kThreads) quant_weights_kernel(QuantWeightsArgs a) {
  __shared__ uint32_t tile[kBlock * kRowWords];
  __shared__ float warp_max[kThreads / 32];
  const int kb_n = a.k / kBlock, nb_n = a.n / kBlock;
  const long long blk = blockIdx.x;
  const int nb = static_cast<int>(blk % nb_n), kb = static_cast<int>((blk / nb_n) % kb_n);
  const long long g = blk / (static_cast<long long>(nb_n) * kb_n);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = lane % 16, rho = 2 * warp + lane / 16;

  // rows r(h, i) = 64h + 4rho + i of the block, columns 8c..8c+7
  const Tin* src = static_cast<const Tin*>(a.w) +
                   ((g * a.k + static_cast<long long>(kb) * kBlock) * a.n + nb * kBlock + 8 * c);
  float f[2][4][8];
  float amax = 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      Load8<Tin>::run(src + static_cast<long long>(64 * h + 4 * rho + i) * a.n, f[h][i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(f[h][i][j]));
    }
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) warp_max[warp] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) amax = fmaxf(amax, warp_max[i]);
  float scale, inv;
  fp8_block_scale(fmaxf(amax, 1e-4f), a.scale_mode, &scale, &inv);

  char* q = static_cast<char*>(a.q) +
            ((g * a.k + static_cast<long long>(kb) * kBlock) * a.n + nb * kBlock + 8 * c);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint2 b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      b[i] = cast8(f[h][i], inv);
      *reinterpret_cast<uint2*>(q + static_cast<long long>(64 * h + 4 * rho + i) * a.n) = b[i];
    }
    // column j's 4 bytes (rows 4rho..4rho+3) -> one word of transposed row 8c + j
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int sel = (j % 4) | ((4 + j % 4) << 4);
      const uint32_t r01 = __byte_perm(j < 4 ? b[0].x : b[0].y, j < 4 ? b[1].x : b[1].y, sel);
      const uint32_t r23 = __byte_perm(j < 4 ? b[2].x : b[2].y, j < 4 ? b[3].x : b[3].y, sel);
      tile[t_word(8 * c + j, 16 * h + rho)] = __byte_perm(r01, r23, 0x5410);
    }
  }
  if (threadIdx.x == 0) {
    a.scales[(g * kb_n + kb) * nb_n + nb] = scale;
    a.scales_t[(g * nb_n + nb) * kb_n + kb] = scale;
  }
  __syncthreads();

  // q_t rows n0 + n, columns k0 .. k0+127: 8 threads x 16 bytes a row
  const int q4 = threadIdx.x % 8;
#pragma unroll
  for (int p = 0; p < kBlock / (kThreads / 8); ++p) {
    const int n = p * (kThreads / 8) + threadIdx.x / 8;
    uint4 v;
    v.x = tile[t_word(n, 4 * q4)];
    v.y = tile[t_word(n, 4 * q4 + 1)];
    v.z = tile[t_word(n, 4 * q4 + 2)];
    v.w = tile[t_word(n, 4 * q4 + 3)];
    char* dst = static_cast<char*>(a.q_t) +
                ((g * a.n + static_cast<long long>(nb) * kBlock + n) * a.k + kb * kBlock + 16 * q4);
    *reinterpret_cast<uint4*>(dst) = v;
  }
}

}  // namespace

const char* quant_weights_shape_error(const QuantWeightsArgs& a) {
  if (a.k <= 0 || a.k % kBlock || a.n <= 0 || a.n % kBlock)
    return "K and N must be positive multiples of 128";
  if (a.groups <= 0) return "there must be at least one group";
  const long long blocks = static_cast<long long>(a.groups) * (a.k / kBlock) * (a.n / kBlock);
  if (blocks >= (1LL << 31)) return "the 128 x 128 blocks must fit in int32";
  return "";
}

cudaError_t launch_quant_weights(const QuantWeightsArgs& a, cudaStream_t stream) {
  const long long blocks = static_cast<long long>(a.groups) * (a.k / kBlock) * (a.n / kBlock);
  if (a.w_f32)
    quant_weights_kernel<float><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  else
    quant_weights_kernel<__nv_bfloat16><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace jax_ep
