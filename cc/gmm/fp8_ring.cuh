// What the fp8 grouped-matmul kernels (fp8_nt.cu, fp8_dw.cu) share: 128-column
// CTA tiles, 128-wide k-steps, a ring of stages in shared memory filled by one
// producer thread (TMA) and drained by two consumer warpgroups (WGMMA), and
// the register layout of a consumer's 64 x 128 f32 accumulator.
//
// A stage holds an A tile (ARows rows of 128 e4m3: 128 for dw, 256 for the
// forward), a B tile (128 rows), both K-major and 128-byte swizzled, and f32
// scales for A's rows and B's rows (dw loads B's; the forward reads its
// weight-block scales from global memory, 32 k-steps at a time into the lanes
// of each consumer warp). dw's consumer waits for the stage's
// "full" barrier, runs four 64 x 128 x 32 WGMMAs of its 64 rows into a fresh
// accumulator (dw_start_kstep), waits for them, promotes the product and releases
// the stage on its "empty" barrier (one arrival per consumer warp).
//
// Issue budget (nvdisasm of the sm_90a build, static count): a forward
// consumer warp's k-step over its two 64-row blocks is 266 instructions: 8
// WGMMAs, 128 promoting FFMAs, the rest barrier, descriptor and scale work,
// mostly on the uniform datapath (ConsumerRing keeps the ring's shared
// addresses as 32-bit values). Recomputing the addresses from generic pointers
// at each k-step cost about 90 more.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/sync.cuh"
#include "gmm/sm90.cuh"

namespace jax_ep {
namespace fp8_ring {

constexpr int kBM = 128, kBN = 128, kBK = 128;
constexpr int kConsumers = 2;                       // warpgroups, 64 rows each
constexpr int kThreads = 128 * (kConsumers + 1);    // + the producer warpgroup
constexpr uint32_t kTileBytes = kBM * kBK;          // a 128-row tile: 16 KB of e4m3
constexpr int kScales = 128;                        // f32 scales per 128 rows of a stage
constexpr int kBoxBytes = 64 * 128;                 // 64 rows x 64 bf16 columns: a TMA store box

// The tensor maps of a call: the A and B operands, their scales, and the
// output where the kernel stores it by TMA (dw; the forward with tma_store).
struct Maps {
  CUtensorMap a, b, a_scales, b_scales, out;
  // the forward's 64-row boxes of A and of its row scales (paired tiles)
  CUtensorMap a_block, a_block_scales;
};

// A ring of `Stages` stages of an ARows-row A tile, a 128-row B tile and their
// rows' scales, with a "full" and an "empty" barrier per stage.
template <int ARows, int Stages>
struct RingOf {
  static constexpr int kStages = Stages;
  static constexpr int kARows = ARows;
  static constexpr uint32_t kABytes = ARows * kBK;
  static constexpr size_t kSmemBytes =
      1024 + Stages * (kABytes + kTileBytes + (ARows + kBN) * 4) + 2 * Stages * 8;

  uint8_t* a;        // [Stages][kABytes]
  uint8_t* b;        // [Stages][kTileBytes]
  float* a_scales;   // [Stages][ARows]
  float* b_scales;   // [Stages][kBN]
  uint64_t* full;    // [Stages]: loaded
  uint64_t* empty;   // [Stages]: released by every consumer warp

  // The ring in dynamic shared memory, 1024-byte aligned (the swizzle) by an
  // offset from its shared-space address, so the compiler keeps seeing a
  // shared-memory pointer.
  __device__ static RingOf at(uint8_t* smem) {
    uint8_t* base = smem + ((1024 - (sm90::smem_addr(smem) & 1023)) & 1023);
    RingOf r;
    r.a = base;
    r.b = r.a + Stages * kABytes;
    r.a_scales = reinterpret_cast<float*>(r.b + Stages * kTileBytes);
    r.b_scales = r.a_scales + Stages * ARows;
    r.full = reinterpret_cast<uint64_t*>(r.b_scales + Stages * kBN);
    r.empty = r.full + Stages;
    return r;
  }

  // Thread 0: the barriers; the caller then syncs the CTA.
  __device__ void init() const {
    for (int s = 0; s < Stages; ++s) {
      sm90::bar_init(&full[s], 1);
      sm90::bar_init(&empty[s], kConsumers * 4);
    }
    sm90::bar_init_fence();
  }

  // The i-th use of the ring: its stage and the parity of that stage's phase.
  __device__ __forceinline__ static int stage_of(uint32_t i) { return i % Stages; }
  __device__ __forceinline__ static uint32_t parity_of(uint32_t i) { return (i / Stages) & 1; }

  // Producer: wait until use i's stage is free and expect `tx` bytes of loads
  // on its full barrier; -> the stage.
  __device__ __forceinline__ int fill(uint32_t i, uint32_t tx) const {
    const int s = stage_of(i);
    if (i >= Stages) sm90::bar_wait(&empty[s], parity_of(i) ^ 1);
    sm90::bar_arrive_tx(&full[s], tx);
    return s;
  }

  // Consumer: wait until use i's stage is loaded; -> the stage.
  __device__ __forceinline__ int wait_loaded(uint32_t i) const {
    const int s = stage_of(i);
    sm90::bar_wait(&full[s], parity_of(i));
    return s;
  }

  // Consumer warp: stage s read (every lane), one arrival on its empty barrier.
  __device__ __forceinline__ void release(int s) const {
    __syncwarp();
    if (threadIdx.x % 32 == 0) sm90::bar_arrive(&empty[s]);
  }
};

// A ring R followed by `OutBytes` of output staging for TMA stores, 1024-byte
// aligned for the 128-byte swizzle.
template <typename R, int OutBytes>
struct WithOut : R {
  static constexpr size_t kSmemBytes = R::kSmemBytes + 1024 + OutBytes;
  uint8_t* out_tile;

  __device__ static WithOut at(uint8_t* smem) {
    WithOut d;
    static_cast<R&>(d) = R::at(smem);
    // d.a is the ring's 1024-byte aligned start
    const long used = reinterpret_cast<const uint8_t*>(d.empty + R::kStages) - d.a;
    d.out_tile = d.a + (used + 1023) / 1024 * 1024;
    return d;
  }
};

// dw's ring: 128-row A tiles, 5 stages (165 KiB; its output tile takes 32 KB more).
using DwRing = RingOf<kBM, 5>;

// dw's producer: wait until use i's stage is free, expect `tx` bytes on its
// full barrier, and load the A and B tiles and A's scales; returns the stage
// (the caller may load more into it: `tx` counts those bytes too). Coordinates
// are (innermost, outer) of each map's box.
__device__ __forceinline__ int dw_load_stage(const Maps& m, const DwRing& r, uint32_t i,
                                             int a0, int a1, int b0, int b1, int as0, int as1,
                                             uint32_t tx) {
  const int s = r.fill(i, tx);
  sm90::tma_load_2d(r.a + s * kTileBytes, &m.a, &r.full[s], a0, a1);
  sm90::tma_load_2d(r.b + s * kTileBytes, &m.b, &r.full[s], b0, b1);
  sm90::tma_load_2d(r.a_scales + s * kScales, &m.a_scales, &r.full[s], as0, as1);
  return s;
}

// Consumer: issue the product of 64 rows of A (`a`: their first row in a
// stage) with the 128 rows of B (`b`) into `prod` (from zero), one commit group.
// The tiles given by their descriptors' low words (sm90::sw128_desc_lo).
__device__ __forceinline__ void issue_product(float (&prod)[64], uint32_t a_lo, uint32_t b_lo) {
#pragma unroll
  for (int j = 0; j < 64; ++j) sm90::reg_fence(prod[j]);
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < kBK / 32; ++k)
    sm90::wgmma_m64n128k32_e4m3(prod, sm90::sw128_desc(a_lo + 2 * k),
                                sm90::sw128_desc(b_lo + 2 * k), k > 0);
  sm90::wgmma_commit();
}
__device__ __forceinline__ void issue_product(float (&prod)[64], const uint8_t* a,
                                              const uint8_t* b) {
  issue_product(prod, sm90::sw128_desc_lo(sm90::smem_addr(a)),
                sm90::sw128_desc_lo(sm90::smem_addr(b)));
}

// Wait for the products issued, then keep the compiler's hands off `prod` until here.
__device__ __forceinline__ void wait_product(float (&prod)[64]) {
  sm90::wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < 64; ++j) sm90::reg_fence(prod[j]);
}

// dw's consumer wg: wait for use i's stage and issue its 64 rows' product;
// -> the stage.
__device__ __forceinline__ int dw_start_kstep(float (&prod)[64], const DwRing& r, uint32_t i,
                                              int wg) {
  const int s = r.wait_loaded(i);
  issue_product(prod, r.a + s * kTileBytes + wg * 64 * kBK, r.b + s * kTileBytes);
  return s;
}

// A consumer thread's place in its 64 x 128 accumulator: registers 4j, 4j+1
// hold row `acc_row(wg)` and 4j+2, 4j+3 row `acc_row(wg) + 8`, at columns
// 8j + acc_col() + {0, 1}.
__device__ __forceinline__ int acc_row(int wg) {
  return 64 * wg + 16 * ((threadIdx.x % 128) / 32) + (threadIdx.x % 32) / 4;
}
__device__ __forceinline__ int acc_col() { return 2 * (threadIdx.x % 4); }

// A consumer thread's view of ring R: the stage-0 addresses it uses, as 32-bit
// shared addresses computed once (a k-step then adds a stage offset: no
// generic-to-shared conversion, no 64-bit descriptor arithmetic), and its place
// in the ring's sequence of uses (use i: stage i % Stages, parity (i / Stages) & 1).
template <typename R>
struct ConsumerRing {
  uint32_t a_lo, b_lo;    // descriptor low words of stage 0's A and B tiles
  uint32_t a_scales0;     // stage 0's A scale of this thread's row acc_row(0)
  uint32_t full0, empty0; // stage 0's barriers
  int s = 0;              // the stage of the current use
  uint32_t parity = 0;    // its phase parity

  __device__ explicit ConsumerRing(const R& r)
      : a_lo(sm90::kept(sm90::sw128_desc_lo(sm90::smem_addr(r.a)))),
        b_lo(sm90::kept(sm90::sw128_desc_lo(sm90::smem_addr(r.b)))),
        a_scales0(sm90::kept(sm90::smem_addr(r.a_scales + acc_row(0)))),
        full0(sm90::kept(sm90::smem_addr(r.full))),
        empty0(sm90::kept(sm90::smem_addr(r.empty))) {}

  __device__ __forceinline__ void next() {
    if (++s == R::kStages) {
      s = 0;
      parity ^= 1;
    }
  }
  __device__ __forceinline__ void wait_loaded() const { sm90::bar_wait(full0 + 8 * s, parity); }
  // this warp has read the stage (every lane): one arrival on its empty
  // barrier, where `when`
  __device__ __forceinline__ void release(bool when = true) const {
    __syncwarp();
    sm90::bar_arrive_if(empty0 + 8 * s, when && threadIdx.x % 32 == 0);
  }
  // 64-row block b of the stage's A tile, and its B tile: descriptor low words
  __device__ __forceinline__ uint32_t a_desc(int b) const {
    return a_lo + (s * R::kABytes + b * 64 * kBK) / 16;
  }
  __device__ __forceinline__ uint32_t b_desc() const { return b_lo + s * (kTileBytes / 16); }
  // the stage's A scale of row acc_row(0) + 64 b + plus
  __device__ __forceinline__ float a_scale(int b, int plus) const {
    return sm90::lds_f32(a_scales0 + 4 * (s * R::kARows + 64 * b + plus));
  }
};

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

// Columns [64h, 64h + 64) of consumer wg's 64 x 128 sum, rounded to bf16, into
// `box`: a TMA store's 64 x 64 box, 64 rows of 128 bytes, 128-byte swizzled
// (free of bank conflicts). Each thread puts 4 bytes of rows rr and rr + 8
// (acc_row) at byte 4(t % 4) of 16-byte chunk c; the chunk sits at c ^ (row % 8).
__device__ __forceinline__ void put_box_bf16(const float (&sum)[64], uint8_t* box, int h) {
  const int rr = acc_row(0), within = 4 * (threadIdx.x % 4), sw = rr % 8;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int j = 8 * h + c;
    uint8_t* p = box + rr * 128 + ((c ^ sw) * 16) + within;
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(sum[4 * j], sum[4 * j + 1]);
    // row rr + 8: the same swizzle
    *reinterpret_cast<__nv_bfloat162*>(p + 8 * 128) =
        __floats2bfloat162_rn(sum[4 * j + 2], sum[4 * j + 3]);
  }
}

// Consumer wg's whole 64 x 128 sum as two boxes at `dst`: columns [0, 64),
// then [64, 128).
__device__ __forceinline__ void put_block_bf16(const float (&sum)[64], uint8_t* dst) {
  put_box_bf16(sum, dst, 0);
  put_box_bf16(sum, dst + kBoxBytes, 1);
}
// The two boxes at `src` stored to rows [row0, +64), columns [col0, +128) of
// `map` (TMA coordinates: the column first).
__device__ __forceinline__ void store_block_tma(const CUtensorMap* map, const uint8_t* src,
                                                int col0, int row0) {
  sm90::tma_store_2d(map, src, col0, row0);
  sm90::tma_store_2d(map, src + kBoxBytes, col0 + 64, row0);
}

// A TMA store of consumer warpgroup wg through its own staging buffer: its
// lead thread waits until the last stores have read the buffer, the 128
// threads run put() (their values into the buffer) and fence it for the TMA,
// then the lead runs issue() (the stores) and commits them as one bulk group.
// Named barrier 1 + wg: the consumer's 128 threads only.
template <typename Put, typename Issue>
__device__ __forceinline__ void staged_tma_store(int wg, Put put, Issue issue) {
  const bool lead = threadIdx.x % 128 == 0;
  if (lead) sm90::bulk_wait_read<0>();
  named_barrier(1 + wg, 128);
  put();
  sm90::fence_async_smem();
  named_barrier(1 + wg, 128);
  if (lead) {
    issue();
    sm90::bulk_commit();
  }
}
// The consumer's stores complete before its CTA (and the buffer) ends.
__device__ __forceinline__ void drain_tma_stores() {
  if (threadIdx.x % 128 == 0) sm90::bulk_wait<0>();
}

// The kernels' body: the ring R, then one thread of the producer warpgroup
// runs produce(ring) and each consumer warpgroup consume(ring, wg), registers
// handed from the producer warpgroup to the consumers.
template <typename R, typename Produce, typename Consume>
__device__ __forceinline__ void run(uint8_t* smem, Produce produce, Consume consume) {
  const R ring = R::at(smem);
  if (threadIdx.x == 0) ring.init();
  __syncthreads();
  // warp-uniform to the compiler (the lane-0 value): index math stays scalar
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  if (wg == kConsumers) {
    sm90::regs_decrease<40>();
    if (threadIdx.x == 128 * kConsumers) produce(ring);
  } else {
    sm90::regs_increase<232>();
    consume(ring, wg);
  }
}

// Host: kernel(maps, args) on `num_sms` CTAs (0: one per SM of `device`) with
// the shared memory of ring R.
template <typename R, typename Args>
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
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(R::kSmemBytes));
  if (attr != cudaSuccess) return attr;
  kernel<<<blocks, kThreads, R::kSmemBytes, stream>>>(maps, args);
  return cudaGetLastError();
}

}  // namespace fp8_ring
}  // namespace jax_ep
