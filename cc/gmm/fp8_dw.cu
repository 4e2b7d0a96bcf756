// fp8 dw of the grouped matmul on Hopper (contract: gmm/kernels.h,
// GmmFp8DwArgs), on the ring of fp8_ring.cuh: the contraction is cut into
// groups along its length (each group's segment a whole number of 128-blocks),
// both operands per-row scaled per block. One CTA per SM walks the tiles of
// every out[g] (group-major: CTAs side by side share the group's operands in
// L2); per tile and block of the group's segment the producer thread loads the
// a and c tiles and both rows' scales; each consumer warpgroup adds its 64
// rows' product times a_s[row] times c_s[col] (a multiply and an FMA per
// register) to the tile's f32 sum. An empty group's tiles are zeros.
#include "gmm/fp8_ring.cuh"
#include "gmm/kernels.h"
#include "gmm/tensor_map.h"

namespace jax_ep {
namespace {

using namespace fp8_ring;

constexpr uint32_t kStageTx = 2 * kTileBytes + 2 * kScales * 4;

struct DwTile {
  int group, row, col;   // out[group], its row tile and column tile
  int block0, blocks;    // the group's 128-blocks of the contraction
};

__device__ __forceinline__ DwTile dw_tile_at(const GmmFp8DwArgs& a, int t, int grid_n,
                                             int per_group) {
  const int g = t / per_group, u = t % per_group;
  const int b0 = a.segments[g] / kBK;
  return {g, u / grid_n, u % grid_n, b0, a.segments[g + 1] / kBK - b0};
}

__device__ void produce(const GmmFp8DwArgs& a, const Maps& m, const Ring& r, int tiles,
                        int grid_n, int per_group) {
  for (const CUtensorMap* map : {&m.a, &m.b, &m.a_scales, &m.b_scales}) sm90::tma_prefetch(map);
  uint32_t i = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const DwTile tl = dw_tile_at(a, t, grid_n, per_group);
    for (int k = 0; k < tl.blocks; ++k, ++i) {
      const int b = tl.block0 + k;
      const int s = load_stage(m, r, i, b * kBK, tl.row * kBM, b * kBK, tl.col * kBN,
                               tl.row * kBM, b, kStageTx);
      sm90::tma_load_2d(r.b_scales + s * kScales, &m.b_scales, &r.full[s], tl.col * kBN, b);
    }
  }
}

template <typename Out>
__device__ void consume(const GmmFp8DwArgs& a, const Ring& r, int tiles, int grid_n,
                        int per_group, int wg) {
  const int row = acc_row(wg), col = acc_col();
  float prod[64], sum[64];
  uint32_t i = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const DwTile tl = dw_tile_at(a, t, grid_n, per_group);
#pragma unroll
    for (int j = 0; j < 64; ++j) sum[j] = 0.f;
    for (int k = 0; k < tl.blocks; ++k, ++i) {
      const int s = start_kstep(prod, r, i, wg);
      const float ra0 = r.a_scales[s * kScales + row], ra1 = r.a_scales[s * kScales + row + 8];
      const float* cs = r.b_scales + s * kScales + col;
      // the column scales are read after the wait (held across it they would
      // take 32 more registers), so the stage is released after the promotion
      wait_product(prod);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 cb = *reinterpret_cast<const float2*>(cs + 8 * j);
        // (product * row scale) * column scale + sum: pallas_fp8_dw's rounding
        sum[4 * j + 0] = fmaf(prod[4 * j + 0] * ra0, cb.x, sum[4 * j + 0]);
        sum[4 * j + 1] = fmaf(prod[4 * j + 1] * ra0, cb.y, sum[4 * j + 1]);
        sum[4 * j + 2] = fmaf(prod[4 * j + 2] * ra1, cb.x, sum[4 * j + 2]);
        sum[4 * j + 3] = fmaf(prod[4 * j + 3] * ra1, cb.y, sum[4 * j + 3]);
      }
      r.release(s);
    }
    Out* out = static_cast<Out*>(a.out) + static_cast<long long>(tl.group) * a.ka * a.nc;
    store_tile(sum, out, a.nc, static_cast<long long>(tl.row) * kBM, tl.col * kBN, wg,
               [](long long) { return true; });
  }
}

template <typename Out>
__global__ void __launch_bounds__(kThreads, 1)
    gmm_fp8_dw_kernel(const __grid_constant__ Maps maps, const __grid_constant__ GmmFp8DwArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem[];
  const int grid_n = a.nc / kBN, per_group = (a.ka / kBM) * grid_n;
  const int tiles = a.groups * per_group;
  run<Ring>(smem, [&](const Ring& r) { produce(a, maps, r, tiles, grid_n, per_group); },
      [&](const Ring& r, int wg) { consume<Out>(a, r, tiles, grid_n, per_group, wg); });
#else
  __trap();   // built for sm_90a only (CMakeLists.txt)
#endif
}

}  // namespace

const char* gmm_fp8_dw_shape_error(const GmmFp8DwArgs& a) {
  if (a.ka <= 0 || a.ka % kBM) return "Ka must be a positive multiple of 128";
  if (a.nc <= 0 || a.nc % kBN) return "Nc must be a positive multiple of 128";
  if (a.p <= 0 || a.p % kBK) return "P must be a positive multiple of 128";
  if (a.groups <= 0) return "there must be at least one group";
  if (static_cast<long long>(a.groups) * (a.ka / kBM) * (a.nc / kBN) >= (1LL << 31))
    return "the tiles must fit in int32";
  return "";
}

cudaError_t launch_gmm_fp8_dw(const GmmFp8DwArgs& a, cudaStream_t stream) {
  if (!has_tensor_map_encoder()) return cudaErrorSymbolNotFound;
  Maps maps;
  const auto e4m3 = CU_TENSOR_MAP_DATA_TYPE_UINT8, f32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const auto sw128 = CU_TENSOR_MAP_SWIZZLE_128B, plain = CU_TENSOR_MAP_SWIZZLE_NONE;
  if (!encode_2d(&maps.a, e4m3, a.a, a.ka, a.p, 1, kBM, kBK, sw128) ||
      !encode_2d(&maps.b, e4m3, a.c, a.nc, a.p, 1, kBN, kBK, sw128) ||
      !encode_2d(&maps.a_scales, f32, a.a_scales, a.p / kBK, a.ka, 4, 1, kScales, plain) ||
      !encode_2d(&maps.b_scales, f32, a.c_scales, a.p / kBK, a.nc, 4, 1, kScales, plain))
    return cudaErrorInvalidValue;
  return launch<Ring>(a.out_f32 ? gmm_fp8_dw_kernel<float> : gmm_fp8_dw_kernel<__nv_bfloat16>, maps, a, a.num_sms,
                a.device, stream);
}

}  // namespace jax_ep
