// Hopper (sm_90a) building blocks of the grouped-matmul kernels, as PTX: shared-
// memory barriers (mbarrier), TMA tile loads, WGMMA on shared-memory
// descriptors, and the warpgroup register split. Compiled for sm_90a only
// (CMakeLists.txt builds cc/gmm/*.cu for that target).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace jax_ep {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// `v`, opaque to the compiler: kept in a register where it would otherwise
// recompute it at each use (a shared address: a read of the CTA's id each time).
__device__ __forceinline__ uint32_t kept(uint32_t v) {
  asm volatile("mov.b32 %0, %0;" : "+r"(v));
  return v;
}

// ---------------------------------------------------------------- mbarrier

__device__ __forceinline__ void bar_init(uint64_t* b, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(arrivals)
               : "memory");
}

// The inits visible to the other threads and to the TMA unit (async proxy).
__device__ __forceinline__ void bar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void bar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) { bar_arrive(smem_addr(b)); }
// An arrival where `p`, predicated rather than branched around: the compiler
// keeps it where it stands instead of sinking it below independent work.
__device__ __forceinline__ void bar_arrive_if(uint32_t bar, bool p) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %1, 0;\n\t"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}" ::"r"(bar),
      "r"(static_cast<uint32_t>(p))
      : "memory");
}

// One arrival that also expects `bytes` of TMA transactions on the barrier.
__device__ __forceinline__ void bar_arrive_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)),
               "r"(bytes)
               : "memory");
}

// A pipeline wait longer than this is a bug (a stage never loaded or never
// released): the kernel traps, so the stream's next synchronization reports
// an error within seconds instead of hanging (a trap poisons the CUDA context:
// the process must restart). A correct wait lasts microseconds, far under
// this even under compute-sanitizer.
constexpr unsigned long long kHangNs = 10ull * 1000 * 1000 * 1000;

// Wait until the phase of parity `parity` has completed. One PTX block, so the
// fast path stays a try and a branch; the clock is read only once a try fails
// (the hardware suspends the thread a while before a try answers false).
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred done, hung;\n\t.reg .u64 t0, t;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@done bra DONE;\n\t"
      "mov.u64 t0, %%globaltimer;\n"
      "RETRY:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@done bra DONE;\n\t"
      "mov.u64 t, %%globaltimer;\n\t"
      "sub.u64 t, t, t0;\n\t"
      "setp.gt.u64 hung, t, %2;\n\t"
      "@hung trap;\n\t"
      "bra.uni RETRY;\n"
      "DONE:\n}" ::"r"(bar),
      "r"(parity), "l"(kHangNs)
      : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* b, uint32_t parity) {
  bar_wait(smem_addr(b), parity);
}

__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

// ---------------------------------------------------------------- TMA

__device__ __forceinline__ void tma_prefetch(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// The box of `map` at (c0 innermost, c1) into `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

// The box of `map` at (c0 innermost, c1) from `src` (written by this CTA's
// threads, each of which ran fence_async_smem() after its writes), in the
// calling thread's current bulk group.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0,
                                             int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(src)), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Wait until at most N of the thread's bulk groups still read shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Wait until at most N of the thread's bulk groups are incomplete (written).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
// This thread's shared-memory writes made visible to the TMA (async proxy).
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---------------------------------------------------------------- WGMMA

// Descriptor of a K-major tile of 128-byte rows in shared memory, 128-byte
// swizzled as TMA writes it (the tile 1024-byte aligned): 8-row groups 1024
// bytes apart. Adding 2 per 32 bytes of K steps along the row.
// The descriptor's words: the low one holds the start address (a tile `bytes`
// further on has a low word `bytes >> 4` larger, never carrying into the high
// word: shared addresses stay under 2^18), the high one is the same for every
// tile, so descriptor arithmetic stays 32-bit.
__device__ __forceinline__ uint32_t sw128_desc_lo(uint32_t addr) {
  return ((addr & 0x3FFFF) >> 4)   // start address
         | (1u << 16);             // leading byte offset (unused when swizzled)
}
constexpr uint32_t kSw128DescHi = (1024 >> 4)   // stride byte offset: 8 rows of 128 bytes
                                  | (1u << 30); // 128-byte swizzle (bit 62)
__device__ __forceinline__ uint64_t sw128_desc(uint32_t lo) {
  return (uint64_t(kSw128DescHi) << 32) | lo;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving a register's uses across a WGMMA fence/wait.
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// d[0..63] (+)= A(64 x 32, e4m3, K-major, smem desc a) * B(32 x 128, e4m3,
// K-major, smem desc b); scale_d = 0: d = A * B (the registers' old values ignored).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t a, uint64_t b,
                                                      int scale_d) {
  asm volatile(
      "{\n\t.reg .pred keep;\n\t"
      "setp.ne.b32 keep, %66, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, keep, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(scale_d));
}

// ---------------------------------------------------------------- registers

// Hand registers between the warpgroups of a warp-specialized kernel (every
// thread of the warpgroup executes it).
template <int R>
__device__ __forceinline__ void regs_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void regs_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}

}  // namespace sm90
}  // namespace jax_ep
