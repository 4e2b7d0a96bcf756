// fp8 NT grouped matmul on Hopper (contract: gmm/kernels.h): a persistent,
// warp-specialized kernel. One CTA per SM walks the output tiles (128 rows of
// one row tile x 128 columns) t = blockIdx.x, + gridDim.x, ...; per tile and
// 128-wide k-step, one producer thread loads the x and v tiles (TMA, 128-byte
// swizzle), the rows' scales and the weight block's scale into a stage of a
// ring; two consumer warpgroups (64 rows each) run four 64 x 128 x 32 WGMMAs
// into a fresh f32 accumulator, release the stage, and add the product times
// xs[row] * vs[block] to the tile's f32 sum (one FMA per register): the
// tensor core's fp8 partial sums are promoted every 128 of the contraction, as
// DeepSeek-V3 does. While one consumer promotes, the other's WGMMAs run. The
// sum goes to HBM from registers, only the rows [lo, hi) of the tile.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <mutex>

#include "gmm/kernels.h"
#include "gmm/sm90.cuh"

namespace jax_ep {
namespace {

constexpr int kBM = 128, kBN = 128, kBK = 128;
constexpr int kStages = 6;
constexpr int kConsumers = 2;                       // warpgroups, 64 rows each
constexpr int kThreads = 128 * (kConsumers + 1);    // + the producer warpgroup
constexpr uint32_t kTileBytes = kBM * kBK;          // an x or v tile: 16 KB of e4m3
constexpr int kVsBox = 4;                           // weight scales per TMA box (16 bytes)
constexpr int kVsSlot = 32;                         // floats: a TMA destination is 128-byte aligned
constexpr uint32_t kStageTx = 2 * kTileBytes + kBM * 4 + kVsBox * 4;

// The stage ring in dynamic shared memory (1024-byte aligned: the swizzle).
struct Ring {
  uint8_t* x;        // [kStages][kTileBytes]
  uint8_t* v;        // [kStages][kTileBytes]
  float* xs;         // [kStages][kBM]
  float* vs;         // [kStages][kVsSlot], the first kVsBox used
  uint64_t* full;    // [kStages]: loaded
  uint64_t* empty;   // [kStages]: released by both consumers

  __device__ static Ring at(uint8_t* base) {
    Ring r;
    r.x = base;
    r.v = r.x + kStages * kTileBytes;
    r.xs = reinterpret_cast<float*>(r.v + kStages * kTileBytes);
    r.vs = r.xs + kStages * kBM;
    r.full = reinterpret_cast<uint64_t*>(r.vs + kStages * kVsSlot);
    r.empty = r.full + kStages;
    return r;
  }
};
constexpr size_t kSmemBytes =
    1024 + 2 * kStages * kTileBytes + kStages * (kBM + kVsSlot) * 4 + 2 * kStages * 8;

struct Maps {
  CUtensorMap x, v, xs, vs;
};

struct Tile {
  int row_start, lo, hi, group, col;
};

__device__ __forceinline__ Tile tile_at(const GmmFp8Args& a, int t, int grid_n) {
  const int f = t / grid_n;
  return {a.row_start[f], a.lo[f], a.hi[f], a.group[f], t % grid_n};
}

__device__ void produce(const GmmFp8Args& a, const Maps& maps, const Ring& ring, int tiles,
                        int grid_n, int ksteps) {
  sm90::tma_prefetch(&maps.x);
  sm90::tma_prefetch(&maps.v);
  uint32_t it = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile tl = tile_at(a, t, grid_n);
    if (tl.group < 0) continue;
    const int v_row = tl.group * a.n + tl.col * kBN;
    const int vs_row = tl.group * (a.n / kBN) + tl.col;
    for (int k = 0; k < ksteps; ++k, ++it) {
      const int s = it % kStages;
      if (it >= kStages) sm90::bar_wait(&ring.empty[s], ((it / kStages) & 1) ^ 1);
      sm90::bar_arrive_tx(&ring.full[s], kStageTx);
      sm90::tma_load_2d(ring.x + s * kTileBytes, &maps.x, &ring.full[s], k * kBK, tl.row_start);
      sm90::tma_load_2d(ring.v + s * kTileBytes, &maps.v, &ring.full[s], k * kBK, v_row);
      sm90::tma_load_2d(ring.xs + s * kBM, &maps.xs, &ring.full[s], tl.row_start, k);
      sm90::tma_load_2d(ring.vs + s * kVsSlot, &maps.vs, &ring.full[s], k, vs_row);
    }
  }
}

template <typename Out>
__device__ __forceinline__ void store_pair(Out* p, float a, float b);
template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ void store_pair<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}

// Consumer `wg`: its 64 rows of every tile. Accumulator layout of a 64 x 128
// WGMMA: thread (warp w, lane l) holds rows 16 w + l/4 (registers 4j, 4j+1)
// and 16 w + l/4 + 8 (4j+2, 4j+3), columns 8 j + 2 (l % 4) + {0, 1}.
template <typename Out>
__device__ void consume(const GmmFp8Args& a, const Ring& ring, int tiles, int grid_n,
                        int ksteps, int wg) {
  const int lane = threadIdx.x % 32;
  const int row = 64 * wg + 16 * ((threadIdx.x % 128) / 32) + lane / 4;   // in the tile
  float prod[64], sum[64];
  uint32_t it = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile tl = tile_at(a, t, grid_n);
#pragma unroll
    for (int i = 0; i < 64; ++i) sum[i] = 0.f;
    for (int k = 0; tl.group >= 0 && k < ksteps; ++k, ++it) {
      const int s = it % kStages;
      sm90::bar_wait(&ring.full[s], (it / kStages) & 1);
      const uint64_t da = sm90::kmajor_sw128_desc(ring.x + s * kTileBytes + wg * 64 * kBK);
      const uint64_t db = sm90::kmajor_sw128_desc(ring.v + s * kTileBytes);
#pragma unroll
      for (int i = 0; i < 64; ++i) sm90::reg_fence(prod[i]);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 32; ++kk)
        sm90::wgmma_m64n128k32_e4m3(prod, da + 2 * kk, db + 2 * kk, kk > 0);
      sm90::wgmma_commit();
      // the scales while the tensor core runs
      const float w_scale = ring.vs[s * kVsSlot];
      const float s0 = ring.xs[s * kBM + row] * w_scale;
      const float s1 = ring.xs[s * kBM + row + 8] * w_scale;
      sm90::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 64; ++i) sm90::reg_fence(prod[i]);
      __syncwarp();
      if (lane == 0) sm90::bar_arrive(&ring.empty[s]);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        sum[4 * j + 0] = fmaf(prod[4 * j + 0], s0, sum[4 * j + 0]);
        sum[4 * j + 1] = fmaf(prod[4 * j + 1], s0, sum[4 * j + 1]);
        sum[4 * j + 2] = fmaf(prod[4 * j + 2], s1, sum[4 * j + 2]);
        sum[4 * j + 3] = fmaf(prod[4 * j + 3], s1, sum[4 * j + 3]);
      }
    }
    // rows outside [lo, hi) belong to a neighbouring group (or the tail): not stored
    const int r0 = tl.row_start + row, r1 = r0 + 8;
    const bool in0 = r0 >= tl.lo && r0 < tl.hi, in1 = r1 >= tl.lo && r1 < tl.hi;
    Out* o = static_cast<Out*>(a.out) + tl.col * kBN + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (in0) store_pair(o + static_cast<size_t>(r0) * a.n + 8 * j, sum[4 * j], sum[4 * j + 1]);
      if (in1)
        store_pair(o + static_cast<size_t>(r1) * a.n + 8 * j, sum[4 * j + 2], sum[4 * j + 3]);
    }
  }
}

template <typename Out>
__global__ void __launch_bounds__(kThreads, 1)
    gmm_fp8_nt_kernel(const __grid_constant__ Maps maps, const __grid_constant__ GmmFp8Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  // aligned by an offset from the shared-space address: the compiler keeps
  // seeing a shared-memory pointer (ld.shared for the scales)
  uint8_t* base = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);
  const Ring ring = Ring::at(base);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::bar_init(&ring.full[s], 1);
      sm90::bar_init(&ring.empty[s], kConsumers * 4);   // one arrival per consumer warp
    }
    sm90::bar_init_fence();
  }
  __syncthreads();
  const int grid_n = a.n / kBN, ksteps = a.kc / kBK;
  const int tiles = (a.counts[0] + a.counts[1]) * grid_n;
  const int wg = threadIdx.x / 128;
  if (wg == kConsumers) {
    sm90::regs_decrease<40>();
    if (threadIdx.x == 128 * kConsumers) produce(a, maps, ring, tiles, grid_n, ksteps);
  } else {
    sm90::regs_increase<232>();
    consume<Out>(a, ring, tiles, grid_n, ksteps, wg);
  }
#else
  __trap();   // built for sm_90a only (CMakeLists.txt)
#endif
}

// cuTensorMapEncodeTiled, from the driver the runtime loaded (no libcuda link).
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  return fn;
}

// A 2D map of a row-major [rows, cols] array: boxes of box_rows x box_cols.
bool encode_2d(CUtensorMap* map, CUtensorMapDataType type, const void* ptr, uint64_t rows,
               uint64_t cols, uint32_t elem_bytes, uint32_t box_rows, uint32_t box_cols,
               CUtensorMapSwizzle swizzle) {
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * elem_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode_fn()(map, type, 2, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <typename Out>
cudaError_t launch_typed(const GmmFp8Args& a, const Maps& maps, int blocks, cudaStream_t stream) {
  // per launch: the attribute belongs to the current device's context (one
  // process may drive several GPUs), and setting it is cheap
  const cudaError_t attr = cudaFuncSetAttribute(
      gmm_fp8_nt_kernel<Out>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(kSmemBytes));
  if (attr != cudaSuccess) return attr;
  gmm_fp8_nt_kernel<Out><<<blocks, kThreads, kSmemBytes, stream>>>(maps, a);
  return cudaGetLastError();
}

}  // namespace

const char* gmm_fp8_shape_error(const GmmFp8Args& a) {
  if (a.kc <= 0 || a.kc % kBK) return "Kc must be a positive multiple of 128";
  if (a.n <= 0 || a.n % kBN) return "N must be a positive multiple of 128";
  if (a.m < kBM || a.m % 8) return "M must be a multiple of 8 and at least 128";
  if (a.groups <= 0) return "there must be at least one group";
  if (a.kb_pad % kVsBox || a.kb_pad < a.kc / kBK)
    return "the weight scales' last dim must be Kc/128 rounded up to a multiple of 4";
  if (static_cast<long long>(a.groups) * a.n >= (1LL << 31))
    return "G * N must fit in int32";
  return "";
}

cudaError_t launch_gmm_fp8_nt(const GmmFp8Args& a, cudaStream_t stream) {
  if (encode_fn() == nullptr) return cudaErrorSymbolNotFound;
  Maps maps;
  const auto e4m3 = CU_TENSOR_MAP_DATA_TYPE_UINT8, f32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const uint64_t kb = a.kc / kBK;
  if (!encode_2d(&maps.x, e4m3, a.x, a.m, a.kc, 1, kBM, kBK, CU_TENSOR_MAP_SWIZZLE_128B) ||
      !encode_2d(&maps.v, e4m3, a.v, uint64_t(a.groups) * a.n, a.kc, 1, kBN, kBK,
                 CU_TENSOR_MAP_SWIZZLE_128B) ||
      !encode_2d(&maps.xs, f32, a.xs_t, kb, a.m, 4, 1, kBM, CU_TENSOR_MAP_SWIZZLE_NONE) ||
      !encode_2d(&maps.vs, f32, a.vs, uint64_t(a.groups) * (a.n / kBN), a.kb_pad, 4, 1, kVsBox,
                 CU_TENSOR_MAP_SWIZZLE_NONE))
    return cudaErrorInvalidValue;
  int blocks = a.num_sms;
  if (blocks <= 0) {
    const cudaError_t e =
        cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, a.device);
    if (e != cudaSuccess) return e;
  }
  return a.out_f32 ? launch_typed<float>(a, maps, blocks, stream)
                   : launch_typed<__nv_bfloat16>(a, maps, blocks, stream);
}

}  // namespace jax_ep
