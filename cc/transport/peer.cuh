// Peer addressing: how a kernel names byte `off` of another rank's symmetric
// buffer, and the P2P signal (a release store into a mapped peer word).
// PeerTable (runtime/runtime.h) is filled by the runtime with NVSHMEM P2P mappings
// (nvshmem_ptr over NVLink) or, for the peer-memory transport, with CUDA
// peer-access pointers; kernels index it by position in the EP group and never
// ask where a pointer came from. Ranks a kernel cannot map are reached by
// NVSHMEM puts instead (transport/nvshmem_put.cuh).
#pragma once

#include <cuda_runtime.h>

#include "common/sync.cuh"
#include "runtime/runtime.h"

namespace jax_ep {

// Byte `off` of rank r's symmetric buffer (r == p.rank: the local one).
__device__ __forceinline__ char* peer_ptr(const PeerTable& p, int r, size_t off) {
  return static_cast<char*>(p.peers[r]) + off;
}

// Byte `off` of this rank's own buffer.
__device__ __forceinline__ char* own_ptr(const PeerTable& p, size_t off) {
  return peer_ptr(p, p.rank, off);
}

// How a signal orders the writes before it. The two callers differ on
// purpose and each keeps its own rule:
//  - kFenceFirst: the signalling lane fences (system scope; nvshmem_fence for
//    a put rank) right before the signal, covering the writes and puts of its
//    warp (the internode legs: a warp signals its own chunk);
//  - kOrderedByCaller: no fence here; the caller has already ordered every
//    write before the signal (the low-latency send's last block: every block
//    fenced, and quiet its puts, before it arrived on the done counter).
enum class SignalOrder { kFenceFirst, kOrderedByCaller };

// One lane: store tag into the 64-bit word at byte off of rank r (mapped)
// with system-scope release semantics.
template <SignalOrder ORDER>
__device__ __forceinline__ void p2p_signal(const PeerTable& p, int r, size_t off,
                                           unsigned long long tag) {
  if constexpr (ORDER == SignalOrder::kFenceFirst) __threadfence_system();
  st_release_sys64(reinterpret_cast<unsigned long long*>(peer_ptr(p, r, off)), tag);
}

}  // namespace jax_ep
