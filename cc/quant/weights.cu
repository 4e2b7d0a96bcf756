// Expert weights to fp8 in both layouts in one pass (quant/kernels.h).
//
// One CTA per 128 x 128 block of w[g], 256 threads (quant/block_t.cuh: which
// thread holds what, the transposed tile in shared memory): the block's
// amax over all its threads, one scale, q stored as loaded and q_t through
// the transposed tile.
#include <cuda_bf16.h>

#include "common/fp8_cast.cuh"
#include "quant/block_t.cuh"
#include "quant/kernels.h"

namespace jax_ep {

namespace {

using namespace block_t;

template <typename Tin>
__global__ void __launch_bounds__(kThreads) quant_weights_kernel(QuantWeightsArgs a) {
  __shared__ uint32_t tile[kTileWords];
  __shared__ float warp_max[kThreads / 32];
  const int kb_n = a.k / kBlock, nb_n = a.n / kBlock;
  const long long blk = blockIdx.x;
  const int nb = static_cast<int>(blk % nb_n), kb = static_cast<int>((blk / nb_n) % kb_n);
  const long long g = blk / (static_cast<long long>(nb_n) * kb_n);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // rows row_of(h, i) of the block, columns 8c..8c+7
  const long long first = (g * a.k + static_cast<long long>(kb) * kBlock) * a.n + nb * kBlock +
                          8 * chunk();
  const Tin* src = static_cast<const Tin*>(a.w) + first;
  float f[2][4][8];
  float amax = 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      Load8<Tin>::run(src + static_cast<long long>(row_of(h, i)) * a.n, f[h][i]);
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
  fp8_block_scale(amax, a.scale_mode, &scale, &inv);

  char* q = static_cast<char*>(a.q) + first;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint2 b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      b[i] = cast8(f[h][i], inv);
      *reinterpret_cast<uint2*>(q + static_cast<long long>(row_of(h, i)) * a.n) = b[i];
    }
    put_t_words(tile, b, h);
  }
  if (threadIdx.x == 0) {
    a.scales[(g * kb_n + kb) * nb_n + nb] = scale;
    a.scales_t[(g * nb_n + nb) * kb_n + kb] = scale;
  }
  __syncthreads();
  // q_t rows n0 + n (n < 128), columns k0 .. k0+127
  store_t_tile(tile,
               static_cast<char*>(a.q_t) + (g * a.n + static_cast<long long>(nb) * kBlock) * a.k +
                   kb * kBlock,
               a.k);
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
