// The NVSHMEM put path: the one place a kernel reaches a rank by puts (a rank
// it cannot map, e.g. across the network). Used by the internode network leg
// and the low-latency sends; bit r of their put_mask says rank r goes by puts.
//
// A put reads its source from symmetric memory, so a warp first writes the row
// into this rank's staging area (own_ptr), then put_row_warp sends it to the
// same offset on PE pe[r]. The staging bytes must stay untouched until the
// kernel completes its puts (quiet_puts). A signal to a put rank is
// nvshmemx_signal_op(SET). Kernels that use puts are instantiated with PUT =
// true; PUT = false compiles to the P2P code with no NVSHMEM call at all.
//
// After a wait for a word raised by puts, a word seen set does not by itself
// make the put's data visible to this GPU's loads on every platform; NVSHMEM
// takes a consistency step in its own waits and tests, so a test of the word
// (already seen set, returns at once) takes it here (puts_visible_*).
#pragma once

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "runtime/runtime.h"
#include "transport/peer.cuh"

namespace jax_ep {

__device__ __forceinline__ bool by_put(unsigned int put_mask, int r) {
  return (put_mask >> r) & 1u;
}

// The symmetric address a put or signal to PE p.pe[r] names for byte `off` of
// rank r's buffer (PeerTable::put_at_peer): this rank's own address of the
// same offset (NVSHMEM names a remote object by the caller's address of it),
// or (loopback harness) rank r's buffer in this PE's heap.
__device__ __forceinline__ char* put_target(const PeerTable& p, int r, size_t off) {
  return peer_ptr(p, p.put_at_peer ? r : p.rank, off);
}

// The source of a put: a pointer into symmetric memory, or byte `off` of this
// rank's own buffer.
__device__ __forceinline__ const char* put_source(const PeerTable&, const char* src) { return src; }
__device__ __forceinline__ const char* put_source(const PeerTable& p, size_t off) {
  return own_ptr(p, off);
}

// Whole warp: `bytes` staged at src (put_source; the warp's own writes,
// ordered before this by __syncwarp) to byte off of rank r. Non-blocking.
template <typename Src>
__device__ __forceinline__ void put_row_warp(const PeerTable& p, int r, size_t off, Src src,
                                             long long bytes) {
  nvshmemx_putmem_nbi_warp(put_target(p, r, off), put_source(p, src), static_cast<size_t>(bytes),
                           p.pe[r]);
}

// One lane: a 32-bit value to byte off of rank r (travels by value: no staging).
__device__ __forceinline__ void put_int32(const PeerTable& p, int r, size_t off, int32_t v) {
  nvshmem_int32_p(reinterpret_cast<int32_t*>(put_target(p, r, off)), v, p.pe[r]);
}

// One lane: raise rank r's 64-bit word at byte off to tag, by a signal op when
// r goes by puts (PUT and its put_mask bit), else by a P2P release store.
// kFenceFirst puts nvshmem_fence before the signal op: it orders delivery of
// every earlier put of this PE to pe[r] before the signal
// (https://docs.nvidia.com/nvshmem/api/gen/api/ordering.html; a chunk is
// several puts, so the single-put putmem_signal would order only its own data).
// kOrderedByCaller: the caller completed its puts (quiet) before.
template <bool PUT, SignalOrder ORDER>
__device__ __forceinline__ void send_signal(const PeerTable& p, unsigned int put_mask, int r,
                                            size_t off, unsigned long long tag) {
  if constexpr (PUT) {
    if (by_put(put_mask, r)) {
      if constexpr (ORDER == SignalOrder::kFenceFirst) nvshmem_fence();
      nvshmemx_signal_op(reinterpret_cast<uint64_t*>(put_target(p, r, off)), tag,
                         NVSHMEM_SIGNAL_SET, p.pe[r]);
      return;
    }
  }
  p2p_signal<ORDER>(p, r, off, tag);
}

// One thread: every put this PE issued is complete (delivered and visible at
// its target) and its staging source free.
__device__ __forceinline__ void quiet_puts() { nvshmem_quiet(); }

// One thread: the consistency step for a word seen raised by puts.
__device__ __forceinline__ void puts_visible_test(const unsigned long long* word) {
  nvshmem_uint64_test(reinterpret_cast<uint64_t*>(const_cast<unsigned long long*>(word)),
                      NVSHMEM_CMP_GE, 0);
}

// Whole warp, after its wait for this rank's word at byte off (compile-time
// PUT: no-op without).
template <bool PUT>
__device__ __forceinline__ void puts_visible_warp(const PeerTable& p, size_t off, int lane) {
  if constexpr (PUT) {
    if (lane == 0) puts_visible_test(reinterpret_cast<const unsigned long long*>(own_ptr(p, off)));
    __syncwarp();
  }
}

// Whole block, after every thread's waits, when some rank reaches this one by
// puts (put_mask != 0, block-uniform): the barriers order every thread's
// waits before the test and every later read after it.
__device__ __forceinline__ void puts_visible_block(unsigned int put_mask,
                                                   const unsigned long long* word) {
  if (!put_mask) return;
  __syncthreads();
  if (threadIdx.x == 0) puts_visible_test(word);
  __syncthreads();
}

}  // namespace jax_ep
