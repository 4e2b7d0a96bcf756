// What the fp8 grouped-matmul kernels (fp8_nt.cu, fp8_dw.cu) share: 128 x 128
// CTA tiles, 128-wide k-steps, a ring of stages in shared memory filled by one
// producer thread (TMA) and drained by two consumer warpgroups (WGMMA), and
// the register layout of a consumer's 64 x 128 f32 accumulator.
//
// A stage holds an A tile and a B tile (128 rows of 128 e4m3 each, K-major,
// 128-byte swizzled) and 128 f32 scales for each (dw loads B's; the forward
// reads its one weight-block scale from global memory). A consumer waits for the stage's "full"
// barrier, runs four 64 x 128 x 32 WGMMAs of its 64 rows into a fresh
// accumulator, waits for them, and releases the stage on its "empty" barrier
// (one arrival per consumer warp): the forward before promoting the product
// (finish_kstep), dw after (its column scales are read from the stage then).
//
// Issue budget (cuobjdump of the sm_90a build): a forward k-step is 154
// instructions per consumer warp (4 WGMMAs, 64 promoting FMAs, the rest
// barrier, descriptor and scale work) and about 75 for the producer thread:
// ~1,300 per CTA against the Pallas kernel's 2,525 (ncu), which is issue-bound.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "gmm/sm90.cuh"

namespace jax_ep {
namespace fp8_ring {

constexpr int kBM = 128, kBN = 128, kBK = 128;
constexpr int kStages = 6;
constexpr int kConsumers = 2;                       // warpgroups, 64 rows each
constexpr int kThreads = 128 * (kConsumers + 1);    // + the producer warpgroup
constexpr uint32_t kTileBytes = kBM * kBK;          // one tile: 16 KB of e4m3
constexpr int kScales = 128;                        // f32 scales per operand and stage
constexpr size_t kSmemBytes =
    1024 + kStages * (2 * kTileBytes + 2 * kScales * 4) + 2 * kStages * 8;

// The tensor maps of a call: the A and B operands and their scales.
struct Maps {
  CUtensorMap a, b, a_scales, b_scales;
};

struct Ring {
  uint8_t* a;        // [kStages][kTileBytes]
  uint8_t* b;        // [kStages][kTileBytes]
  float* a_scales;   // [kStages][kScales]
  float* b_scales;   // [kStages][kScales]
  uint64_t* full;    // [kStages]: loaded
  uint64_t* empty;   // [kStages]: released by every consumer warp

  // The ring in dynamic shared memory, 1024-byte aligned (the swizzle) by an
  // offset from its shared-space address, so the compiler keeps seeing a
  // shared-memory pointer.
  __device__ static Ring at(uint8_t* smem) {
    uint8_t* base = smem + ((1024 - (sm90::smem_addr(smem) & 1023)) & 1023);
    Ring r;
    r.a = base;
    r.b = r.a + kStages * kTileBytes;
    r.a_scales = reinterpret_cast<float*>(r.b + kStages * kTileBytes);
    r.b_scales = r.a_scales + kStages * kScales;
    r.full = reinterpret_cast<uint64_t*>(r.b_scales + kStages * kScales);
    r.empty = r.full + kStages;
    return r;
  }

  // Thread 0: the barriers; the caller then syncs the CTA.
  __device__ void init() const {
    for (int s = 0; s < kStages; ++s) {
      sm90::bar_init(&full[s], 1);
      sm90::bar_init(&empty[s], kConsumers * 4);
    }
    sm90::bar_init_fence();
  }
};

// The i-th use of the ring: its stage and the parity of that stage's phase.
__device__ __forceinline__ int stage_of(uint32_t i) { return i % kStages; }
__device__ __forceinline__ uint32_t parity_of(uint32_t i) { return (i / kStages) & 1; }

// Producer: wait until use i's stage is free, expect `tx` bytes on its full
// barrier, and load the A and B tiles and A's scales; returns the stage (the
// caller may load more into it: `tx` counts those bytes too). Coordinates are
// (innermost, outer) of each map's box.
__device__ __forceinline__ int load_stage(const Maps& m, const Ring& r, uint32_t i, int a0,
                                          int a1, int b0, int b1, int as0, int as1,
                                          uint32_t tx) {
  const int s = stage_of(i);
  if (i >= kStages) sm90::bar_wait(&r.empty[s], parity_of(i) ^ 1);
  sm90::bar_arrive_tx(&r.full[s], tx);
  sm90::tma_load_2d(r.a + s * kTileBytes, &m.a, &r.full[s], a0, a1);
  sm90::tma_load_2d(r.b + s * kTileBytes, &m.b, &r.full[s], b0, b1);
  sm90::tma_load_2d(r.a_scales + s * kScales, &m.a_scales, &r.full[s], as0, as1);
  return s;
}

// Consumer wg: issue use i's product of its 64 rows of A with the 128 rows of B
// into `prod` (from zero). The caller reads the stage's scales, then waits
// (finish_kstep).
__device__ __forceinline__ void start_kstep(float (&prod)[64], const Ring& r, uint32_t i,
                                            int wg) {
  const int s = stage_of(i);
  sm90::bar_wait(&r.full[s], parity_of(i));
  const uint64_t da = sm90::kmajor_sw128_desc(r.a + s * kTileBytes + wg * 64 * kBK);
  const uint64_t db = sm90::kmajor_sw128_desc(r.b + s * kTileBytes);
#pragma unroll
  for (int j = 0; j < 64; ++j) sm90::reg_fence(prod[j]);
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < kBK / 32; ++k) sm90::wgmma_m64n128k32_e4m3(prod, da + 2 * k, db + 2 * k, k > 0);
  sm90::wgmma_commit();
}

// Wait for the product, then release the stage (its scales already read):
// the forward's order; dw waits and releases around its promotion itself.
__device__ __forceinline__ void finish_kstep(float (&prod)[64], const Ring& r, uint32_t i) {
  sm90::wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < 64; ++j) sm90::reg_fence(prod[j]);
  __syncwarp();
  if (threadIdx.x % 32 == 0) sm90::bar_arrive(&r.empty[stage_of(i)]);
}

// A consumer thread's place in its 64 x 128 accumulator: registers 4j, 4j+1
// hold row `row()` and 4j+2, 4j+3 row `row() + 8`, at columns 8j + col() + {0, 1}.
__device__ __forceinline__ int acc_row(int wg) {
  return 64 * wg + 16 * ((threadIdx.x % 128) / 32) + (threadIdx.x % 32) / 4;
}
__device__ __forceinline__ int acc_col() { return 2 * (threadIdx.x % 4); }

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

// Consumer wg's 64 rows of a 128 x 128 f32 tile whose first row is `row0`
// (column `col0`) of a row-major [*, ld] `out`: only the rows `keep(r)` accepts.
template <typename Out, typename Keep>
__device__ __forceinline__ void store_tile(const float (&sum)[64], Out* out, long long ld,
                                           long long row0, int col0, int wg, Keep keep) {
  const long long r0 = row0 + acc_row(wg), r1 = r0 + 8;
  const bool in0 = keep(r0), in1 = keep(r1);
  Out* o0 = out + r0 * ld + col0 + acc_col();
  Out* o1 = out + r1 * ld + col0 + acc_col();
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (in0) store_pair(o0 + 8 * j, sum[4 * j], sum[4 * j + 1]);
    if (in1) store_pair(o1 + 8 * j, sum[4 * j + 2], sum[4 * j + 3]);
  }
}

// The kernels' body: the ring, then one thread of the producer warpgroup runs
// produce(ring) and each consumer warpgroup consume(ring, wg), registers
// handed from the producer warpgroup to the consumers.
template <typename Produce, typename Consume>
__device__ __forceinline__ void run(uint8_t* smem, Produce produce, Consume consume) {
  const Ring ring = Ring::at(smem);
  if (threadIdx.x == 0) ring.init();
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == kConsumers) {
    sm90::regs_decrease<40>();
    if (threadIdx.x == 128 * kConsumers) produce(ring);
  } else {
    sm90::regs_increase<232>();
    consume(ring, wg);
  }
}

// Host: kernel(maps, args) on `num_sms` CTAs (0: one per SM of `device`) with
// the ring's shared memory.
template <typename Args>
cudaError_t launch(void (*kernel)(Maps, Args), const Maps& maps, const Args& args, int num_sms,
                   int device, cudaStream_t stream) {
  int blocks = num_sms;
  if (blocks <= 0) {
    const cudaError_t e = cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) return e;
  }
  // per launch: the attribute belongs to the current device's context (one
  // process may drive several GPUs), and setting it is cheap
  const cudaError_t attr = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes));
  if (attr != cudaSuccess) return attr;
  kernel<<<blocks, kThreads, kSmemBytes, stream>>>(maps, args);
  return cudaGetLastError();
}

}  // namespace fp8_ring
}  // namespace jax_ep
