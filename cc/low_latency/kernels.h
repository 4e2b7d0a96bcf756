// Host interface of the low-latency (decode) dispatch and combine kernels
// (docs/semantics.md §12, docs/low_latency.md). Each op is two kernels, a
// send half that only issues stores and signals (it never waits for a peer,
// so it can return at once: the future send/receive "hook") and a receive
// half that waits for the signals and writes the XLA outputs. One args struct
// per kernel; the low-latency region's offsets (LlLayout, low_latency/region_layout.h)
// are the same on every rank.
//
// Transports (put_mask in every args struct, filled by the FFI handler from
// the ll_transport attribute): bit r clear, rank r is reached by P2P stores
// through peers.peers[r]; set, by NVSHMEM puts to PE peers.pe[r] (from this
// rank's staging areas, LlLayout). 0 (the loopback harness, the peer-memory
// transport, "p2p"): P2P only, no NVSHMEM call. Receive kernels read their
// own region either way; a non-zero mask there adds NVSHMEM's consistency
// step after the waits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_error.h"
#include "jax_ep_abi.h"
#include "low_latency/region_layout.h"
#include "runtime/runtime.h"

namespace jax_ep {

// Grid of one low-latency kernel: blocks x warps (a warp per row or row slice).
struct LlGrid {
  int num_blocks = 0;  // blocks of the grid (no residency needed: only the
                       // receive kernels spin, on flags of other ranks' sends)
  int warps = 16;      // warps per block, 1..kLlMaxWarps
};
constexpr int kLlMaxWarps = 16;
constexpr int kLlMaxTopk = 32;       // lane k holds pair k of a token
constexpr int kLlMaxBlocksLR = 8192; // L * R bound (count words staged in shared memory)

// Dispatch, send half: row t of x (cast to fp8 + scales, or as is) is stored
// once per rank r that holds one of its pairs (t, k) with slot[t, k] >= 0, at
// token row me*Tmax + t of r's receive area; each such pair writes t*K + k to
// the area's info word (l, me, slot) on rank e / L (l = e % L, e =
// topk_idx[t, k]). Then, after every block's stores, the last block raises
// one tagged count word per expert on its rank.
struct LlDispatchSendArgs {
  PeerTable peers;
  LlLayout lay;
  const void* x = nullptr;            // [T, H] bf16 / f32
  long long x_row_bytes = 0;
  const int32_t* topk_idx = nullptr;  // [T, K]
  const int32_t* slot = nullptr;      // [T, K]: the reference's handle (-1: not sent)
  const int32_t* expert_count = nullptr;  // [E]: this rank's pairs per expert (slots 0..n-1)
  int T = 0;                          // tokens of this call (<= lay.Tmax)
  int hidden = 0;                     // elements per row (cast modes)
  int mode = kDispatchCopy;           // kDispatchCopy / kDispatchCastBf16 / kDispatchCastF32
  int scale_mode = kFp8ScaleXlaGpu;   // Fp8ScaleMode of the cast
  unsigned int put_mask = 0;          // bit r: rank r by puts (top of file)
  int* host_err = nullptr;            // kErrLlOrder: a send before the previous receive
};

// Dispatch, receive half: waits for every (l, s) count word (device-side
// timeout -> host_err), then fills expert l's output rows packed by source
// (row sum_{s'<s} n[l, s'] + j for pair (s, j), j < n[l, s]) with token row
// (s, info / K) of the receive area (one copy per expert of a row that
// crossed the link once) and copies the info word to out_info at that row;
// rows past count[l] are not written.
struct LlDispatchRecvArgs {
  PeerTable peers;
  LlLayout lay;
  void* out = nullptr;                // [L, R*Tmax, lay.row_bytes]
  void* out_scales = nullptr;         // [L, R*Tmax, lay.s_row_bytes] (cast modes)
  int32_t* out_info = nullptr;        // [L, R*Tmax]: t*K + k at the source (combine's input)
  int32_t* src_count = nullptr;       // [L, R]
  int32_t* count = nullptr;           // [L]
  unsigned int put_mask = 0;          // bit s: rank s reaches this one by puts
  int* host_err = nullptr;
  unsigned long long timeout_ns = kDefaultTimeoutNs;
};

// Combine, send half (expert side): every valid row of y (expert l's packed
// row of pair (s, j), j < src_count[l, s]: the dispatch's layout) goes to
// source s's combine area at row info[that row]; the last block then raises
// one tagged word on every rank.
struct LlCombineSendArgs {
  PeerTable peers;
  LlLayout lay;
  const void* y = nullptr;            // [L, R*Tmax, lay.comb_row_bytes]
  const int32_t* info = nullptr;      // [L, R*Tmax]: the dispatch's out_info
  const int32_t* src_count = nullptr; // [L, R]: the dispatch's src_count
  unsigned int put_mask = 0;          // bit s: rank s by puts
  int* host_err = nullptr;            // kErrLlOrder: a send before the previous receive
};

// Combine, receive half (source side): waits for every rank's word, then
// out[t] = cast(sum_k w_k * f32(row(t, k))) over the pairs with slot >= 0, k
// ascending, in the reference's exact f32 operation order.
struct LlCombineRecvArgs {
  PeerTable peers;
  LlLayout lay;
  int T = 0;                          // tokens of this call (<= lay.Tmax)
  const int32_t* slot = nullptr;      // [T, K]: dispatch's handle
  const float* weights = nullptr;     // [T, K]: merged weights (routing.merge_duplicate_weights)
  int dtype = kBf16;                  // RowDtype of y and out
  void* out = nullptr;                // [T, lay.comb_row_bytes]
  unsigned int put_mask = 0;          // bit r: rank r reaches this one by puts
  int* host_err = nullptr;
  unsigned long long timeout_ns = kDefaultTimeoutNs;
};

// Load every low-latency kernel on the current device now (CUDA loads them
// lazily; a load behind a spinning receive can stall the sender it waits for:
// low_latency/kernels.cu). Call before the first launch on a device: the runtime does
// at attach, the loopback harness before its ranks start. Once per device.
cudaError_t preload_ll_kernels();

cudaError_t launch_ll_dispatch_send(const LlDispatchSendArgs& a, const LlGrid& g, cudaStream_t s);
cudaError_t launch_ll_dispatch_recv(const LlDispatchRecvArgs& a, const LlGrid& g, cudaStream_t s);
cudaError_t launch_ll_combine_send(const LlCombineSendArgs& a, const LlGrid& g, cudaStream_t s);
cudaError_t launch_ll_combine_recv(const LlCombineRecvArgs& a, const LlGrid& g, cudaStream_t s);

}  // namespace jax_ep
