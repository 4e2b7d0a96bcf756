// Device side shared by the internode dispatch and combine kernels: the two
// transport legs (the seam a network transport replaces), the per-op epoch and
// the warp-level publish of a chunk.
#pragma once

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "kernels/internode.h"
#include "kernels/sync.cuh"
#include "transport/p2p.cuh"

namespace jax_ep {
namespace {

// ---- The network leg (between nodes): the only place the kernels may reach
// a rank by NVSHMEM puts. Bit r of put_mask (InterDispatchArgs) says how rank
// r is reached (cc/ffi_internode.cc, NetPutMask; docs/internode.md "Network
// leg transports"):
//  - P2P: net_dst is the row in place on r (peer table); net_signal is a
//    system-scope release store after a system fence.
//  - put: the warp writes the row into this rank's staging area (symmetric
//    heap: a put reads its source there), then net_put_warp sends it to the
//    same offset on PE pe[r] (put_target); net_signal is nvshmem_fence + nvshmemx_signal_op
//    (SET, tag). The fence orders delivery of every earlier put of this PE to
//    pe[r] before the signal ("All operations on symmetric data objects issued
//    to a particular PE prior to the call to nvshmem_fence are guaranteed to
//    be delivered before any subsequent operations ... to the same PE",
//    https://docs.nvidia.com/nvshmem/api/gen/api/ordering.html). A chunk is
//    several puts (rows, scales, the chunk's mask words), so the single-put
//    nvshmemx_putmem_signal_nbi_warp would order only its own data: fence it is.
// Callers write every row and meta word of a chunk before that chunk's one
// signal. The kernels are built twice: PUT = false is the P2P code with no
// NVSHMEM call, PUT = true per rank (the loopback harness runs both: its
// put mode holds every rank's buffer in one PE's heap, PeerTable::put_at_peer).
__device__ __forceinline__ bool net_by_put(unsigned int put_mask, int r) {
  return (put_mask >> r) & 1u;
}
__device__ __forceinline__ char* net_dst(const PeerTable& p, int r, size_t off) {
  return peer_ptr(p, r, off);
}
// Byte off of this rank's region: NVSHMEM names a symmetric object (a put's
// target on another PE too) by the caller's own address of it.
__device__ __forceinline__ char* net_sym(const PeerTable& p, size_t off) {
  return peer_ptr(p, p.rank, off);
}
// Whole warp: bytes staged at src_off here (the warp's writes, ordered before
// this by __syncwarp) to dst_off on rank r. Non-blocking: the staging bytes
// stay untouched until the kernel's quiet (inter_finish).
__device__ __forceinline__ void net_put_warp(const PeerTable& p, int r, size_t dst_off,
                                             size_t src_off, long long bytes) {
  nvshmemx_putmem_nbi_warp(put_target(p, r, dst_off), net_sym(p, src_off),
                           static_cast<size_t>(bytes), p.pe[r]);
}
// One lane: the warp's writes / puts for rank r (ordered before it by
// __syncwarp) are delivered before the flag reads tag.
template <bool PUT>
__device__ __forceinline__ void net_signal(const PeerTable& p, unsigned int put_mask, int r,
                                           size_t flag_off, unsigned long long tag) {
  if constexpr (PUT) {
    if (net_by_put(put_mask, r)) {
      nvshmem_fence();
      nvshmemx_signal_op(reinterpret_cast<uint64_t*>(put_target(p, r, flag_off)), tag,
                         NVSHMEM_SIGNAL_SET, p.pe[r]);
      return;
    }
  }
  __threadfence_system();
  st_release_sys64(reinterpret_cast<unsigned long long*>(peer_ptr(p, r, flag_off)), tag);
}
// Whole warp, after its wait for a network flag raised by puts: a word seen
// set does not by itself make a network put's data visible to this GPU's
// loads on every platform; NVSHMEM's test of a word takes that consistency
// step (as low_latency.cu's ll_puts_visible). No-op without puts.
template <bool PUT>
__device__ __forceinline__ void net_puts_visible(const PeerTable& p, size_t flag_off, int lane) {
  if constexpr (PUT) {
    if (lane == 0)
      nvshmem_uint64_test(reinterpret_cast<uint64_t*>(net_sym(p, flag_off)), NVSHMEM_CMP_GE, 0);
    __syncwarp();
  }
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

// As sync.cuh's finish_call, for the internode control words. PUT: thread
// 0's quiet (after the barrier: every warp's puts issued) completes the
// block's puts first, so the staging rows are free for the next call.
template <bool PUT>
__device__ __forceinline__ void inter_finish(InterCtrl* ctrl, unsigned int epoch) {
  __syncthreads();
  if constexpr (PUT) {
    if (threadIdx.x == 0) nvshmem_quiet();
    __syncthreads();
  }
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
