// fp8 NT grouped matmul on Hopper (contract: gmm/kernels.h), on the ring of
// fp8_ring.cuh: a persistent, warp-specialized kernel. One CTA per SM walks
// the output tiles (128 rows of one row tile x 128 columns) t = blockIdx.x, +
// gridDim.x, ...; per tile and 128-wide k-step the producer thread loads the
// x and v tiles and the rows' scales; each consumer warpgroup reads the weight
// block's scale from global memory (one f32, issued before its wait for the
// stage) and adds its 64 rows' product times xs[row] * vs[block] to the tile's
// f32 sum (one FMA per register): the tensor core's fp8 partial sums are
// promoted every 128 of the contraction, as DeepSeek-V3 does. While one
// consumer promotes, the other's WGMMAs run. The sum goes to HBM from
// registers, only the rows [lo, hi) of the tile.
#include "gmm/fp8_ring.cuh"
#include "gmm/kernels.h"
#include "gmm/tensor_map.h"

namespace jax_ep {
namespace {

using namespace fp8_ring;

constexpr uint32_t kStageTx = 2 * kTileBytes + kBM * 4;

struct Tile {
  int row_start, lo, hi, group, col;
};

__device__ __forceinline__ Tile tile_at(const GmmFp8Args& a, int t, int grid_n) {
  const int f = t / grid_n;
  return {a.row_start[f], a.lo[f], a.hi[f], a.group[f], t % grid_n};
}

__device__ void produce(const GmmFp8Args& a, const Maps& m, const Ring& r, int tiles,
                        int grid_n, int ksteps) {
  for (const CUtensorMap* map : {&m.a, &m.b, &m.a_scales}) sm90::tma_prefetch(map);
  uint32_t i = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile tl = tile_at(a, t, grid_n);
    if (tl.group < 0) continue;   // a tail tile: zeros, nothing to load
    const int v_row = tl.group * a.n + tl.col * kBN;
    for (int k = 0; k < ksteps; ++k, ++i)
      load_stage(m, r, i, k * kBK, tl.row_start, k * kBK, v_row, tl.row_start, k, kStageTx);
  }
}

template <typename Out>
__device__ void consume(const GmmFp8Args& a, const Ring& r, int tiles, int grid_n, int ksteps,
                        int wg) {
  const int row = acc_row(wg);
  float prod[64], sum[64];
  uint32_t i = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile tl = tile_at(a, t, grid_n);
#pragma unroll
    for (int j = 0; j < 64; ++j) sum[j] = 0.f;
    // the tile's weight-block scales, [vs_blocks] (a tail tile reads none)
    const float* vs =
        a.vs + (static_cast<long long>(tl.group) * (a.n / kBN) + tl.col) * a.vs_blocks;
    for (int k = 0; tl.group >= 0 && k < ksteps; ++k, ++i) {
      const float w_scale = vs[k];   // in flight while this thread waits for the stage
      start_kstep(prod, r, i, wg);
      const int s = stage_of(i);   // the rows' scales while the tensor core runs
      const float s0 = r.a_scales[s * kScales + row] * w_scale;
      const float s1 = r.a_scales[s * kScales + row + 8] * w_scale;
      finish_kstep(prod, r, i);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        sum[4 * j + 0] = fmaf(prod[4 * j + 0], s0, sum[4 * j + 0]);
        sum[4 * j + 1] = fmaf(prod[4 * j + 1], s0, sum[4 * j + 1]);
        sum[4 * j + 2] = fmaf(prod[4 * j + 2], s1, sum[4 * j + 2]);
        sum[4 * j + 3] = fmaf(prod[4 * j + 3], s1, sum[4 * j + 3]);
      }
    }
    // rows outside [lo, hi) belong to a neighbouring group (or the tail): not stored
    store_tile(sum, static_cast<Out*>(a.out), a.n, tl.row_start, tl.col * kBN, wg,
               [&](long long rr) { return rr >= tl.lo && rr < tl.hi; });
  }
}

template <typename Out>
__global__ void __launch_bounds__(kThreads, 1)
    gmm_fp8_nt_kernel(const __grid_constant__ Maps maps, const __grid_constant__ GmmFp8Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem[];
  const int grid_n = a.n / kBN, ksteps = a.kc / kBK;
  const int tiles = (a.counts[0] + a.counts[1]) * grid_n;
  run(smem, [&](const Ring& r) { produce(a, maps, r, tiles, grid_n, ksteps); },
      [&](const Ring& r, int wg) { consume<Out>(a, r, tiles, grid_n, ksteps, wg); });
#else
  __trap();   // built for sm_90a only (CMakeLists.txt)
#endif
}

}  // namespace

const char* gmm_fp8_shape_error(const GmmFp8Args& a) {
  if (a.kc <= 0 || a.kc % kBK) return "Kc must be a positive multiple of 128";
  if (a.n <= 0 || a.n % kBN) return "N must be a positive multiple of 128";
  if (a.m < kBM || a.m % 8) return "M must be a multiple of 8 and at least 128";
  if (a.groups <= 0) return "there must be at least one group";
  if (a.vs_blocks < a.kc / kBK) return "the weight scales' last dim must be at least Kc/128";
  if (static_cast<long long>(a.groups) * a.n >= (1LL << 31)) return "G * N must fit in int32";
  return "";
}

cudaError_t launch_gmm_fp8_nt(const GmmFp8Args& a, cudaStream_t stream) {
  if (!has_tensor_map_encoder()) return cudaErrorSymbolNotFound;
  Maps maps;
  const auto e4m3 = CU_TENSOR_MAP_DATA_TYPE_UINT8, f32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const auto sw128 = CU_TENSOR_MAP_SWIZZLE_128B, plain = CU_TENSOR_MAP_SWIZZLE_NONE;
  if (!encode_2d(&maps.a, e4m3, a.x, a.m, a.kc, 1, kBM, kBK, sw128) ||
      !encode_2d(&maps.b, e4m3, a.v, uint64_t(a.groups) * a.n, a.kc, 1, kBN, kBK, sw128) ||
      !encode_2d(&maps.a_scales, f32, a.xs_t, a.kc / kBK, a.m, 4, 1, kBM, plain))
    return cudaErrorInvalidValue;
  return launch(a.out_f32 ? gmm_fp8_nt_kernel<float> : gmm_fp8_nt_kernel<__nv_bfloat16>, maps, a, a.num_sms,
                a.device, stream);
}

}  // namespace jax_ep
