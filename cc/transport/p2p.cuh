// The transport seam: how a kernel reaches another rank. Kernels touch peer
// memory only through peer_ptr (a byte offset in rank r's symmetric buffer,
// mapped into this process) and publish_chunk (make rows visible, then raise
// the flag); nothing else in a kernel knows where PeerTable's pointers come
// from. Today the runtime fills PeerTable with NVSHMEM P2P mappings
// (nvshmem_ptr over NVLink, cc/runtime.cu); a peer-memory transport (one
// process driving several GPUs) fills the same table with peer-access
// pointers. A transport that cannot map remote memory (NVSHMEM puts, RDMA)
// provides its own pair of these functions in a file next to this one and the
// kernels that use it are instantiated for it.
//
// Protocol (every op): each call has an epoch e (a device-side counter, so the
// kernels are safe to replay in CUDA graphs). A sender writes its rows for
// rank r straight into r's staging buffer (stores through peer_ptr), then
// stores e into r's flag [sender][chunk] with release semantics. The
// receiver spins (acquire) until that flag is >= e. Staging is double-buffered
// by epoch parity: call e on rank a can only start after call e-1 on a
// finished, which waited for every peer's call e-1 flags, which peers only
// raise after finishing call e-2 (and so after consuming parity e%2). So no
// barrier, ack or reset is needed between calls.
#pragma once

#include <cuda_runtime.h>

#include "buffer_layout.h"
#include "kernels/sync.cuh"
#include "runtime.h"

namespace jax_ep {

// Byte `off` of rank r's symmetric buffer (r == p.rank: the local one).
__device__ __forceinline__ char* peer_ptr(const PeerTable& p, int r, size_t off) {
  return static_cast<char*>(p.peers[r]) + off;
}

// Sender warps of a block publish chunk j to every peer: its rows (written by
// any sender thread of the block) are visible before the flag reads epoch.
// The sender warps meet at a barrier and one thread does a system-scope
// release (cumulative over the block's writes, per the PTX memory model). (A
// form where every sender thread fenced first was measured no faster and
// deleted: bench/results/history.)
__device__ __forceinline__ void publish_chunk(const PeerTable& p, size_t ctrl_off, int j,
                                              unsigned int epoch, int send_warps) {
  named_barrier(1, 32 * send_warps);
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int r = 0; r < p.num_ranks; ++r) {
      if (r == p.rank) continue;
      OpCtrl* rc = reinterpret_cast<OpCtrl*>(peer_ptr(p, r, ctrl_off));
      st_release_sys(&rc->flags[p.rank][j], epoch);
    }
  }
}

}  // namespace jax_ep
