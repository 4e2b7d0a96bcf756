// Device-side synchronisation of the kernels: system-scope flag loads and
// stores, epoch tags, a timeout-guarded spin (a missing peer becomes a clear
// error on the host, never a hang). The ring ops' per-call epoch is in
// transport/ring.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_error.h"

namespace jax_ep {

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned int ld_acquire_sys(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(unsigned int* p, unsigned int v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long ld_acquire_sys64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The epoch-tagged value of a ring slot's flags for a block's i-th chunk
// (intranode/ring_layout.h): later calls and later chunks compare greater
// (tag_reached: modulo 2^64, so the 32-bit epoch may wrap).
__device__ __forceinline__ unsigned long long chunk_tag(unsigned int epoch, int i) {
  return (static_cast<unsigned long long>(epoch) << 32) | static_cast<unsigned int>(i + 1);
}

// v has reached tag: the signed difference, as the 32-bit epoch words compare,
// so a word of the epoch before a wrap (2^32 calls of one op: about a day of
// decode steps) never passes for one after it.
__device__ __forceinline__ bool tag_reached(unsigned long long v, unsigned long long tag) {
  return static_cast<long long>(v - tag) >= 0;
}

__device__ __forceinline__ unsigned int ld_volatile(const unsigned int* p) {
  return *reinterpret_cast<const volatile unsigned int*>(p);
}

// Barrier over the first `nthreads` threads of the block (the sender warps),
// so the receiver warps never wait on senders inside a block.
__device__ __forceinline__ void named_barrier(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

// host_err is its op family's word in a 64-byte-aligned block whose word 0
// holds the first error raised, with its family (common/device_error.h): a
// wait that reads word 0 gives up on any family's error, not only its own.
__device__ __forceinline__ volatile int* first_error_word(const int* host_err) {
  return reinterpret_cast<volatile int*>(reinterpret_cast<uintptr_t>(host_err) & ~uintptr_t(63));
}

// Raise a kernel error in host-mapped memory: in the family's word, and in
// word 0 with the family (device_error.h's encoding) if no error is there
// yet. The first error of each stays (an order error, kErrLlOrder, is the
// cause of the timeouts that follow it). Plain check-then-stores: two errors
// racing may leave either, which is fine; atomics on host memory are not used.
__device__ __forceinline__ void raise_error(int* host_err, int code) {
  if (!host_err) return;
  volatile int* w = reinterpret_cast<volatile int*>(host_err);
  if (*w == kErrNone) *w = code;
  volatile int* first = first_error_word(host_err);
  const int op = static_cast<int>(w - first) - 1;
  if (*first == kErrNone) *first = code | (op << 8);
}

// A wait this long also gives up as soon as an error has been raised (by
// another wait of this call, or a call before): the waits of one kernel run
// one after another (peers, chunks, blocks not yet resident), so each paying
// its own timeout turned one missing peer at EP 8 into 7 timeouts, 70 s. Only
// a wait longer than 1 ms (ranks far apart, or a dead peer) reads the host's
// word 0, once per 64 polls; a short wait never does.
constexpr unsigned long long kErrorPollAfterNs = 1000ull * 1000;

__device__ __forceinline__ bool error_raised(const int* host_err) {
  return host_err && *first_error_word(host_err) != kErrNone;
}

// true: keep waiting; false: the wait gave up (timeout raised, or an error
// was already raised).
__device__ __forceinline__ bool keep_waiting(unsigned long long t0, int* host_err,
                                             unsigned long long timeout_ns) {
  const unsigned long long waited = global_timer_ns() - t0;
  if (waited > timeout_ns) {
    raise_error(host_err, kErrTimeout);
    return false;
  }
  return waited < kErrorPollAfterNs || !error_raised(host_err);
}

// Spin (every lane of the warp) until *flag >= epoch. On timeout, raise the
// error in host-mapped memory and return false (the caller moves on; data is
// then garbage, and the next FFI call reports the error).
__device__ __forceinline__ bool wait_flag(const unsigned int* flag, unsigned int epoch,
                                          int* host_err, unsigned long long timeout_ns) {
  if (static_cast<int>(ld_acquire_sys(flag) - epoch) >= 0) return true;
  unsigned long long t0 = global_timer_ns();
  while (true) {
    for (int i = 0; i < 64; ++i)
      if (static_cast<int>(ld_acquire_sys(flag) - epoch) >= 0) return true;
    if (!keep_waiting(t0, host_err, timeout_ns)) return false;
  }
}

// As wait_flag for a 64-bit tagged word: spin until *flag has reached tag.
__device__ __forceinline__ bool wait_tag(const unsigned long long* flag, unsigned long long tag,
                                         int* host_err, unsigned long long timeout_ns) {
  if (tag_reached(ld_acquire_sys64(flag), tag)) return true;
  unsigned long long t0 = global_timer_ns();
  while (true) {
    for (int i = 0; i < 64; ++i)
      if (tag_reached(ld_acquire_sys64(flag), tag)) return true;
    if (!keep_waiting(t0, host_err, timeout_ns)) return false;
  }
}

// Non-blocking, warp-uniform: every lane saw *flag reach tag (acquire).
__device__ __forceinline__ bool tag_ready_warp(const unsigned long long* flag,
                                               unsigned long long tag) {
  return __all_sync(0xffffffffu, tag_reached(ld_acquire_sys64(flag), tag));
}

// Non-blocking: true (uniformly over the warp) when every lane's acquire load
// saw *flag >= epoch, so every lane may read what the flag publishes.
__device__ __forceinline__ bool flag_ready_warp(const unsigned int* flag, unsigned int epoch) {
  const unsigned int v = ld_acquire_sys(flag);
  return __all_sync(0xffffffffu, static_cast<int>(v - epoch) >= 0);
}

}  // namespace jax_ep
