// Device side shared by the internode dispatch and combine kernels: the two
// transport legs (the seam a network transport replaces), the per-op epoch and
// the warp-level publish of a chunk.
#pragma once

#include <cuda_runtime.h>

#include "kernels/internode.h"
#include "kernels/sync.cuh"
#include "transport/p2p.cuh"

namespace jax_ep {
namespace {

// ---- The network leg (between nodes). Today a P2P store through the peer
// table (emulated nodes: every rank is mapped). NVSHMEM put-with-signal
// (IBGDA) replaces these two: net_dst then returns a local staging row that
// the put sends once the warp wrote it, and net_signal becomes the signal
// half of nvshmemx_putmem_signal_nbi_warp (NVSHMEM_SIGNAL_SET, tag). Callers
// already write every row and meta word of a chunk before the one signal of
// that chunk, which is what put-with-signal orders.
__device__ __forceinline__ char* net_dst(const PeerTable& p, int r, size_t off) {
  return peer_ptr(p, r, off);
}
// One lane: the warp's writes for rank r (ordered before it by __syncwarp)
// are visible before the flag reads tag.
__device__ __forceinline__ void net_signal(const PeerTable& p, int r, size_t flag_off,
                                           unsigned long long tag) {
  __threadfence_system();
  st_release_sys64(reinterpret_cast<unsigned long long*>(peer_ptr(p, r, flag_off)), tag);
}

// ---- The NVLink leg (inside a node): P2P stores, as the intranode kernels.
__device__ __forceinline__ char* nvl_dst(const PeerTable& p, int r, size_t off) {
  return peer_ptr(p, r, off);
}
__device__ __forceinline__ void nvl_signal(const PeerTable& p, int r, size_t flag_off,
                                           unsigned long long tag) {
  __threadfence_system();
  st_release_sys64(reinterpret_cast<unsigned long long*>(peer_ptr(p, r, flag_off)), tag);
}

__device__ __forceinline__ InterCtrl* inter_ctrl(const PeerTable& p, const InterLayout& lay,
                                                 int op) {
  return reinterpret_cast<InterCtrl*>(peer_ptr(p, p.rank, lay.ctrl)) + op;
}

// As sync.cuh's finish_call, for the internode control words.
__device__ __forceinline__ void inter_finish(InterCtrl* ctrl, unsigned int epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned int prev = atomicAdd(&ctrl->done, 1u);
    if (prev == gridDim.x - 1) {
      ctrl->done = 0;
      *reinterpret_cast<volatile unsigned int*>(&ctrl->epoch) = epoch;
      __threadfence();
    }
  }
}

// Every lane waits (acquire) for the local flag at byte off, so every lane may
// read what it publishes. False on timeout (the error is raised on the host).
__device__ __forceinline__ bool wait_local(const PeerTable& p, size_t off, unsigned long long tag,
                                           int* host_err, unsigned long long timeout_ns) {
  return wait_tag(reinterpret_cast<const unsigned long long*>(peer_ptr(p, p.rank, off)), tag,
                  host_err, timeout_ns);
}
__device__ __forceinline__ bool ready_local(const PeerTable& p, size_t off,
                                            unsigned long long tag) {
  return tag_ready_warp(reinterpret_cast<const unsigned long long*>(peer_ptr(p, p.rank, off)),
                        tag);
}

}  // namespace
}  // namespace jax_ep
