// Host interface of the internode (hierarchical) dispatch and combine kernels
// (docs/internode.md): R = N nodes x G ranks; a token crosses the network
// once per destination node, to the rank of its own local index there (the
// forwarder), which forwards it over NVLink to the node's ranks that want it.
// Combine reverses it: the partials of a node's ranks are summed on the
// forwarder, one row per (token, node) crosses the network, the source sums
// the node partials. Outputs use the intranode handle (slot_row, row_src,
// send_mask): dispatch is bit-identical to the intranode kernels.
#pragma once

#include <cuda_runtime.h>

#include "internode/region_layout.h"
#include "intranode/kernels.h"

namespace jax_ep {

// Warp roles of a block (every block has all three; each role's items are
// strided over the role's warps of the whole grid). Blocks spin on flags of
// other ranks, so the grid must be resident, like the intranode kernels'.
struct InterLaunch {
  int num_blocks = 0;
  int send_warps = 4;  // dispatch: network leg out; combine: expert-side partials (NVLink)
  int fwd_warps = 6;   // forwarders (both ops)
  int recv_warps = 6;  // dispatch: gather into out; combine: final sum at the source
  int chunk = 4;       // tokens per flag (one warp moves a whole chunk)
  __host__ __device__ int threads() const { return 32 * (send_warps + fwd_warps + recv_warps); }
};

// Token windows of a call of T tokens on a region laid out for layout_T (0:
// for T): one kernel per window, each a call of its own (its own epoch and
// parity: docs/internode.md, "Reuse across calls"), so the region is bounded
// by layout_T whatever T.
inline int inter_window(int T, int layout_T) { return layout_T > 0 && layout_T < T ? layout_T : T; }

// Launch `launch(window args)` once per window of the call in `a` (the
// windows' t0 / tw set), in order on one stream; stops at the first error.
// A failure after earlier windows ran (and moved this rank's epoch) would be
// the same on every rank (same shapes); a peer left waiting ends in the
// device-side timeout, not a hang.
template <typename Args, typename Launch>
cudaError_t for_each_inter_window(const Args& a, Launch&& launch) {
  const int T = a.a.T, W = inter_window(T, a.layout_T);
  for (int t0 = 0; t0 < T; t0 += W) {
    Args w = a;
    w.t0 = t0;
    w.tw = T - t0 < W ? T - t0 : W;
    if (cudaError_t e = launch(w); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// num_blocks blocks; chunk <= 0: the default for the tokens one kernel moves
// (a window of the call's T on a region laid out for layout_T): 4, fewer
// when that is small.
InterLaunch make_inter_launch(int T, int layout_T, int num_blocks, int chunk);

// The DispatchArgs / CombineArgs fields used: everything but ctrl_off,
// stage_off, stage_scales_off (the internode region replaces them) and skip.
// Modes: copy (with or without given scales) and the fp8 casts; the fused
// combine backward (kDispatchCombineBwd) is not implemented here (rejected).
struct InterDispatchArgs {
  DispatchArgs a;
  int nodes = 1;   // N; G = a.peers.num_ranks / N
  size_t sym_bytes = 0;  // the region: byte 0 of every rank's buffer (same size everywhere)
  // > 0: the region is laid out for this T whatever the call's T:
  // inter_layout's fixed_T (the runtime's region); a call of more tokens runs
  // as windows of layout_T tokens (launch_inter_dispatch). 0: laid out for a.T.
  int layout_T = 0;
  // The window one kernel moves: tokens [t0, t0 + tw) of the call's a.T (the
  // areas and flags are indexed by t - t0). Set by launch_inter_dispatch.
  int t0 = 0, tw = 0;
  // Bit r: rank r's network leg goes by NVSHMEM puts (only ranks of this
  // rank's local index; internode/ffi_handlers.cc NetPutMask). 0: P2P stores only,
  // the kernels without any NVSHMEM call (the loopback harness).
  unsigned int put_mask = 0;
};
struct InterCombineArgs {
  CombineArgs a;
  int nodes = 1;
  size_t sym_bytes = 0;
  int layout_T = 0;  // as InterDispatchArgs::layout_T (windows of it)
  int t0 = 0, tw = 0;  // as InterDispatchArgs::t0, tw
  unsigned int put_mask = 0;  // as InterDispatchArgs::put_mask
};

// "" or why the shape does not fit (checked before launching).
const char* inter_dispatch_check(const InterDispatchArgs& a);
const char* inter_combine_check(const InterCombineArgs& a);

cudaError_t launch_inter_dispatch(const InterDispatchArgs& a, const InterLaunch& lc,
                                  cudaStream_t stream);
cudaError_t launch_inter_combine(const InterCombineArgs& a, const InterLaunch& lc,
                                 cudaStream_t stream);

}  // namespace jax_ep
