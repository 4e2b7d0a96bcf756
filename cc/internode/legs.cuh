// Device side shared by the internode dispatch and combine kernels: the two
// legs (network: P2P or NVSHMEM puts; NVLink: P2P), the per-op epoch and the
// waits on local flags.
#pragma once

#include <cuda_runtime.h>
#include "common/sync.cuh"
#include "internode/kernels.h"
#include "transport/nvshmem_put.cuh"
#include "transport/peer.cuh"

namespace jax_ep {
namespace {

// ---- The network leg (between nodes). Bit r of put_mask (InterDispatchArgs)
// says how rank r is reached (internode/ffi_handlers.cc, NetPutMask;
// docs/internode.md "Network leg transports"):
//  - P2P: net_dst is the row in place on r (peer table);
//  - put: the warp writes the row into this rank's staging area (own_ptr)
//    and put_row_warp sends it (transport/nvshmem_put.cuh).
// A network signal is send_signal<PUT, SignalOrder::kFenceFirst>: the
// signalling lane fences before it (nvshmem_fence for a put rank, a system fence for a
// P2P one), so every row and meta word of the chunk, written or put by its
// warp before the chunk's one signal, is delivered first.
// The kernels are built twice: PUT = false is the P2P code with no NVSHMEM
// call, PUT = true per rank (the loopback harness runs both: its put mode
// holds every rank's buffer in one PE's heap, PeerTable::put_at_peer).
__device__ __forceinline__ char* net_dst(const PeerTable& p, int r, size_t off) {
  return peer_ptr(p, r, off);
}

// ---- The NVLink leg (inside a node): P2P stores, as the intranode kernels.
__device__ __forceinline__ char* nvl_dst(const PeerTable& p, int r, size_t off) {
  return peer_ptr(p, r, off);
}
__device__ __forceinline__ void nvl_signal(const PeerTable& p, int r, size_t flag_off,
                                           unsigned long long tag) {
  p2p_signal<SignalOrder::kFenceFirst>(p, r, flag_off, tag);
}

__device__ __forceinline__ InterCtrl* inter_ctrl(const PeerTable& p, const InterLayout& lay,
                                                 int op) {
  return reinterpret_cast<InterCtrl*>(peer_ptr(p, p.rank, lay.ctrl)) + op;
}

// What both kernels start from: where this rank sits in the N x G grid of
// ranks (node my_node, local index my_g), the token window of this launch
// (ia.t0, ia.tw) in chunks, the region's layout for it, this op's control
// words and the call's epoch (read once: every block starts the same call).
struct InterFrame {
  int me, R, N, G, my_node, my_g;
  int T, t0, chunk, NC;  // the window's tokens, its first token, tokens per chunk, chunks
  InterLayout lay;
  InterCtrl* ctrl;
  unsigned int epoch;
};

template <typename InterArgs>
__device__ __forceinline__ InterFrame inter_frame(const InterArgs& ia, const PeerTable& p,
                                                  int chunk, int op) {
  InterFrame f;
  f.me = p.rank;
  f.R = p.num_ranks;
  f.N = ia.nodes;
  f.G = f.R / f.N;
  f.my_node = f.me / f.G;
  f.my_g = f.me % f.G;
  f.T = ia.tw;
  f.t0 = ia.t0;
  f.chunk = chunk;
  f.NC = (f.T + chunk - 1) / chunk;
  f.lay = inter_layout(ia.sym_bytes, f.N, f.G, f.T, ia.layout_T);
  f.ctrl = inter_ctrl(p, f.lay, op);
  f.epoch = ld_volatile(&f.ctrl->epoch) + 1u;
  return f;
}

// As transport/ring.cuh's finish_call, for the internode control words. PUT: thread
// 0's quiet (after the barrier: every warp's puts issued) completes the
// block's puts first, so the staging rows are free for the next call.
template <bool PUT>
__device__ __forceinline__ void inter_finish(InterCtrl* ctrl, unsigned int epoch) {
  __syncthreads();
  if constexpr (PUT) {
    if (threadIdx.x == 0) quiet_puts();
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
