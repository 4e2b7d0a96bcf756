// The ring / credit protocol of the intranode kernels: bounded staging rings
// per (source, receiving block), written by P2P stores through peer_ptr
// (transport/peer.cuh), published by tagged ready words, freed by credits.
//
// Protocol (every op): each call has an epoch e (a device-side counter, so the
// kernels are safe to replay in CUDA graphs). Staging is a bounded ring per
// (source, receiving block) (intranode/ring_layout.h). A sender writes the rows of its
// block's i-th chunk straight into slot q = i % depth of the receiver's ring
// (stores through peer_ptr), then stores tag(e, i) into the receiver's
// ready[sender][block][q] with release semantics; the receiver spins
// (acquire) until that word is >= tag(e, i). Once every receiver warp of the
// block is done with the slot, the receiver stores tag(e, i) into the
// sender's credit[receiver][block][q]; a sender writes chunk i >= depth only
// after every peer's credit for chunk i - depth arrived. Receivers drain
// chunks in block order, every peer's chunk i before any chunk i + 1, so a
// sender waiting for credit never waits on a receiver that waits for it.
// Staging is double-buffered by epoch parity: call e on rank a can only start
// after call e-1 on a finished, which waited for every peer's call e-1 data,
// which peers only send after finishing call e-2 (and so after draining
// parity e%2). Tags grow with the epoch, so no barrier, ack or reset is
// needed between calls. tests/test_ring_protocol.py models this protocol
// under random interleavings (no deadlock, no slot rewritten while read).
#pragma once

#include <cuda_runtime.h>

#include "common/sync.cuh"
#include "intranode/ring_layout.h"
#include "runtime/runtime.h"
#include "transport/peer.cuh"

namespace jax_ep {

// Epoch of this call of a ring op: one more than the last finished one.
__device__ __forceinline__ unsigned int current_epoch(const OpCtrl* ctrl) {
  return ld_volatile(&ctrl->epoch) + 1u;
}

// Every block calls this once at its end; the last one publishes the epoch.
__device__ __forceinline__ void finish_call(OpCtrl* ctrl, unsigned int epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned int prev = atomicAdd(&ctrl->done, 1u);
    if (prev == gridDim.x - 1) {
      ctrl->done = 0;
      *reinterpret_cast<volatile unsigned int*>(&ctrl->epoch) = epoch;
      __threadfence();
    }
  }
}

// Sender warps of a block publish their i-th chunk (slot q) to every peer:
// its rows (written by any sender thread of the block) are visible before
// the ready word reads tag. The sender warps meet at a barrier and one thread
// does a system-scope release (cumulative over the block's writes, per the
// PTX memory model). (A form where every sender thread fenced first was
// measured no faster and deleted: bench/results/history.)
__device__ __forceinline__ void publish_chunk(const PeerTable& p, size_t ctrl_off, int q,
                                              unsigned long long tag, int send_warps) {
  named_barrier(1, 32 * send_warps);
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int r = 0; r < p.num_ranks; ++r) {
      if (r == p.rank) continue;
      OpCtrl* rc = reinterpret_cast<OpCtrl*>(peer_ptr(p, r, ctrl_off));
      st_release_sys64(&rc->ready[p.rank][blockIdx.x][q], tag);
    }
  }
  if (threadIdx.x < 32) __syncwarp();
}

// Sender warps of a block wait until every peer returned the credit of slot
// q for tag (the chunk that used the slot before). Lanes of warp 0 poll one
// peer each; the others wait at the sender barrier. False on timeout (the
// error is raised; the call's data is then garbage).
__device__ __forceinline__ bool wait_credits(const PeerTable& p, const OpCtrl* ctrl, int q,
                                             unsigned long long tag, int send_warps,
                                             int* host_err, unsigned long long timeout_ns) {
  bool ok = true;
  if (threadIdx.x < p.num_ranks && threadIdx.x != p.rank)
    ok = wait_tag(&ctrl->credit[threadIdx.x][blockIdx.x][q], tag, host_err, timeout_ns);
  if (threadIdx.x < 32) __syncwarp();  // warp 0 whole again before the aligned barrier
  named_barrier(1, 32 * send_warps);
  return ok;
}

// The sender warps of a block walk its chunks j = blockIdx.x, blockIdx.x +
// gridDim.x, ... (the ci-th one in ring slot q = ci % depth): wait until every
// peer returned the slot's previous credit, let items(j, q) write the chunk's
// rows, then publish the chunk. The one sender loop of every ring kernel.
template <typename Items>
__device__ __forceinline__ void send_ring_chunks(const PeerTable& p, const OpCtrl* ctrl,
                                                 size_t ctrl_off, int num_chunks, int depth,
                                                 unsigned int epoch, int send_warps,
                                                 int* host_err, unsigned long long timeout_ns,
                                                 Items&& items) {
  for (int j = blockIdx.x, ci = 0; j < num_chunks; j += gridDim.x, ++ci) {
    const int q = ci % depth;
    if (ci >= depth)
      wait_credits(p, ctrl, q, chunk_tag(epoch, ci - depth), send_warps, host_err, timeout_ns);
    items(j, q);
    publish_chunk(p, ctrl_off, q, chunk_tag(epoch, ci), send_warps);
  }
}

// A receiver warp is done with slot q of source s's ring (s < 0: of every
// peer's ring) for the block's chunk `tag`. The last of `expect` warps to
// finish returns the credit (all warps' reads of the slot happen before it:
// fence + shared counter); `needed`: some sender will wait for it (else a no-op).
// counter: this block's shared-memory word for (s, q), back at 0 afterwards.
__device__ __forceinline__ void drain_slot(const PeerTable& p, size_t ctrl_off, int s, int q,
                                           unsigned long long tag, unsigned int* counter,
                                           int expect, bool needed, int lane) {
  // No sender will wait for this slot (the ring does not wrap there): nothing
  // to count, no fence (needed is the same for every warp of a slot use).
  if (!needed) return;
  __threadfence();
  __syncwarp();
  if (lane == 0) {
    const unsigned int prev = atomicAdd(counter, 1u);
    if (prev + 1 == static_cast<unsigned int>(expect)) {
      *counter = 0u;
      __threadfence();
      for (int r = 0; r < p.num_ranks; ++r) {
        if (r == p.rank || (s >= 0 && r != s)) continue;
        OpCtrl* sc = reinterpret_cast<OpCtrl*>(peer_ptr(p, r, ctrl_off));
        st_release_sys64(&sc->credit[p.rank][blockIdx.x][q], tag);
      }
    }
  }
  __syncwarp();
}

}  // namespace jax_ep
