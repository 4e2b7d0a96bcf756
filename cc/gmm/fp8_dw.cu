// fp8 dw of the grouped matmul on Hopper (contract: gmm/kernels.h,
// GmmFp8DwArgs), on the ring of fp8_ring.cuh: the contraction is cut into
// groups along its length (each group's segment a whole number of 128-blocks),
// both operands per-row scaled per block. One CTA per SM walks the tiles of
// every out[g] (group-major: CTAs side by side share the group's operands in
// L2); per tile and block of the group's segment the producer thread loads the
// a and c tiles and both rows' scales; each consumer warpgroup adds its 64
// rows' product times a_s[row] times c_s[col] (a multiply and an FMA per
// register) to the tile's f32 sum. An empty group's tiles are zeros.
//
// A bf16 tile leaves through shared memory by TMA: at 256 rows per group a
// tile has two blocks of the contraction, so the kernel mostly writes (V3 up:
// 7.5 GB of dw for 1.9 PFLOP); from registers each warp store wrote 16 bytes
// to each of 8 rows, as many L2 requests as 16-byte pieces of dw, and the
// consumers waited on them before their next tile. Now each consumer
// warpgroup puts its 64 rows in its 16 KB of the output tile (128-byte
// swizzled, free of bank conflicts) and one thread stores them as two 64 x 64
// boxes while the warpgroup runs the next tile. f32 dw stores from registers.
#include <type_traits>

#include "gmm/fp8_ring.cuh"
#include "gmm/kernels.h"
#include "gmm/tensor_map.h"

namespace jax_ep {
namespace {

using namespace fp8_ring;

constexpr uint32_t kStageTx = 2 * kTileBytes + 2 * kScales * 4;
constexpr int kOutBytes = kConsumers * 2 * kBoxBytes;   // a 128 x 128 bf16 tile

// The ring, then the bf16 output tile [consumer][column half][64 rows][128 bytes].
using DwSmem = WithOut<DwRing, kOutBytes>;

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

__device__ void produce(const GmmFp8DwArgs& a, const Maps& m, const DwRing& r, int tiles,
                        int grid_n, int per_group) {
  for (const CUtensorMap* map : {&m.a, &m.b, &m.a_scales, &m.b_scales}) sm90::tma_prefetch(map);
  uint32_t i = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const DwTile tl = dw_tile_at(a, t, grid_n, per_group);
    for (int k = 0; k < tl.blocks; ++k, ++i) {
      const int b = tl.block0 + k;
      const int s = dw_load_stage(m, r, i, b * kBK, tl.row * kBM, b * kBK, tl.col * kBN,
                                  tl.row * kBM, b, kStageTx);
      sm90::tma_load_2d(r.b_scales + s * kScales, &m.b_scales, &r.full[s], tl.col * kBN, b);
    }
  }
}

// Consumer wg's 64 x 128 sum, rounded to bf16, into its 16 KB of the output
// tile and stored by TMA to out rows [row0, +64), columns [col0, +128) (the
// map's rows: G * Ka).
__device__ __forceinline__ void store_tile_tma(const float (&sum)[64], const DwSmem& r,
                                               const Maps& m, int row0, int col0, int wg) {
  uint8_t* tile = r.out_tile + wg * 2 * kBoxBytes;
  staged_tma_store(wg, [&] { put_block_bf16(sum, tile); },
                   [&] { store_block_tma(&m.out, tile, col0, row0); });
}

template <typename Out>
__device__ void consume(const GmmFp8DwArgs& a, const Maps& m, const DwSmem& r, int tiles,
                        int grid_n, int per_group, int wg) {
  const int row = acc_row(wg), col = acc_col();
  float prod[64], sum[64];
  uint32_t i = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const DwTile tl = dw_tile_at(a, t, grid_n, per_group);
#pragma unroll
    for (int j = 0; j < 64; ++j) sum[j] = 0.f;
    for (int k = 0; k < tl.blocks; ++k, ++i) {
      const int s = dw_start_kstep(prod, r, i, wg);
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
    if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
      store_tile_tma(sum, r, m, tl.group * a.ka + tl.row * kBM + wg * 64, tl.col * kBN, wg);
    } else {
      Out* out = static_cast<Out*>(a.out) + static_cast<long long>(tl.group) * a.ka * a.nc;
      store_tile(sum, out, a.nc, static_cast<long long>(tl.row) * kBM, tl.col * kBN, wg,
                 [](long long) { return true; });
    }
  }
  drain_tma_stores();
}

template <typename Out>
__global__ void __launch_bounds__(kThreads, 1)
    gmm_fp8_dw_kernel(const __grid_constant__ Maps maps, const __grid_constant__ GmmFp8DwArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem[];
  const int grid_n = a.nc / kBN, per_group = (a.ka / kBM) * grid_n;
  const int tiles = a.groups * per_group;
  run<DwSmem>(smem, [&](const DwSmem& r) { produce(a, maps, r, tiles, grid_n, per_group); },
              [&](const DwSmem& r, int wg) {
                consume<Out>(a, maps, r, tiles, grid_n, per_group, wg);
              });
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
  if (static_cast<long long>(a.groups) * a.ka >= (1LL << 31))
    return "G * Ka must fit in int32";   // the output map's rows
  // below 2^30, not 2^31: a CTA's next tile, t + gridDim.x, stays in int
  if (static_cast<long long>(a.groups) * (a.ka / kBM) * (a.nc / kBN) >= (1LL << 30))
    return "the output tiles G * Ka/128 * Nc/128 must be below 2^30";
  return "";
}

cudaError_t launch_gmm_fp8_dw(const GmmFp8DwArgs& a, cudaStream_t stream) {
  if (!has_tensor_map_encoder()) return cudaErrorSymbolNotFound;
  Maps maps{};   // out stays zeros where the output is f32
  const auto e4m3 = CU_TENSOR_MAP_DATA_TYPE_UINT8, f32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const auto sw128 = CU_TENSOR_MAP_SWIZZLE_128B, plain = CU_TENSOR_MAP_SWIZZLE_NONE;
  if (!encode_2d(&maps.a, e4m3, a.a, a.ka, a.p, 1, kBM, kBK, sw128) ||
      !encode_2d(&maps.b, e4m3, a.c, a.nc, a.p, 1, kBN, kBK, sw128) ||
      !encode_2d(&maps.a_scales, f32, a.a_scales, a.p / kBK, a.ka, 4, 1, kScales, plain) ||
      !encode_2d(&maps.b_scales, f32, a.c_scales, a.p / kBK, a.nc, 4, 1, kScales, plain))
    return cudaErrorInvalidValue;
  // bf16 out [G * Ka, Nc] in 64 x 64 boxes (128 bytes wide: the swizzle's limit)
  if (!a.out_f32 && !encode_2d(&maps.out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a.out,
                               uint64_t(a.groups) * a.ka, a.nc, 2, 64, 64, sw128))
    return cudaErrorInvalidValue;
  return launch<DwSmem>(a.out_f32 ? gmm_fp8_dw_kernel<float> : gmm_fp8_dw_kernel<__nv_bfloat16>,
                        maps, a, a.num_sms, a.device, stream);
}

}  // namespace jax_ep
