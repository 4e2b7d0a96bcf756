// See loopback_ll.h.
#include "testing/loopback_ll.h"

#include <cuda_runtime.h>

#include <iterator>

#include "common/device_error.h"
#include "low_latency/kernels.h"
#include "low_latency/region_layout.h"
#include "testing/loopback.h"
#include "testing/loopback_put.h"

namespace jax_ep {

namespace {

// Indices into kLoopbackLlPtrs / kLoopbackLlInts.
enum Ptr : int {
  kX, kIdx, kSlot, kExpertCount, kOut, kOutScales, kOutInfo, kSrcCount, kCount, kY, kCInfo,
  kCSrcCount, kWeights, kCOut, kSym, kNumPtrs
};
enum Int : int {
  kT, kK, kE, kTmax, kHidden, kXRowBytes, kRowBytes, kSRowBytes, kYRowBytes, kMode,
  kScaleMode, kYDtype, kNumBlocks, kWarps, kPut, kNumInts
};
static_assert(std::size(kLoopbackLlPtrs) == kNumPtrs, "pointer names and indices");
static_assert(std::size(kLoopbackLlInts) == kNumInts, "int names and indices");

}  // namespace

std::string loopback_ll(const std::vector<uint64_t>& ptrs, const std::vector<int64_t>& ints,
                        size_t sym_bytes, int R, int iters, int ops, double* seconds) {
  if (R < 1 || R > kMaxRanks || ptrs.size() != size_t(kNumPtrs) * R || ints.size() != kNumInts)
    return "loopback_ll: bad arguments";
  const int T = int(ints[kT]), K = int(ints[kK]), E = int(ints[kE]), Tmax = int(ints[kTmax]);
  if (E % R != 0 || K < 1 || K > kLlMaxTopk || T < 0 || T > Tmax)
    return "loopback_ll: need E % R == 0, 1 <= K <= 32, 0 <= T <= max_tokens";
  if (std::string e = check_resident(R, int(ints[kNumBlocks])); !e.empty()) return e;
  const int L = E / R;
  const int put_mode = int(ints[kPut]);  // 0 P2P, 1 every rank by puts, 2 odd ranks by puts
  const bool put = put_mode != 0;
  const LlLayout lay = ll_layout(0, R, L, Tmax, K, ints[kRowBytes], ints[kSRowBytes],
                                 ints[kYRowBytes], put);
  if (sym_bytes < lay.end)
    return "loopback_ll: sym_bytes below ll_region_bytes (" + std::to_string(lay.end) + ")";
  const LlGrid grid{int(ints[kNumBlocks]), int(ints[kWarps])};
  if (cudaError_t e = preload_ll_kernels(); e != cudaSuccess)
    return std::string("loopback_ll: loading the kernels: ") + cudaGetErrorString(e);
  auto P = [&](int r, int i) { return reinterpret_cast<void*>(ptrs[kNumPtrs * r + i]); };
  auto I32 = [&](int r, int i) { return static_cast<int32_t*>(P(r, i)); };
  std::vector<PeerTable> tables(R);
  for (int r = 0; r < R; ++r) {
    tables[r] = loopback_peers(ptrs, kNumPtrs, kSym, R, r);
    if (put)
      if (std::string e = loopback_put_peers(&tables[r], sym_bytes); !e.empty()) return e;
  }
  // mode 1: every rank (this one too) by puts, as EpConfig.ll_transport="put";
  // mode 2: the odd ranks by puts, the even ones by P2P stores, as "auto" on
  // a cluster where NVSHMEM maps some PEs and not others (mixed destination
  // lists in one kernel). A receive kernel's mask only needs to be non-zero
  // when some rank puts to it: the same mask serves.
  const unsigned int all = (1u << R) - 1u;
  const unsigned int put_mask = put_mode == 1 ? all : put_mode == 2 ? (0xAAAAAAAAu & all) : 0u;
  return run_ranks(R, iters, seconds, [&](int r, cudaStream_t st) -> cudaError_t {
    const PeerTable& peers = tables[r];
    if (ops & kLlOpDispatch) {
      LlDispatchSendArgs s;
      s.peers = peers;
      s.lay = lay;
      s.x = P(r, kX);
      s.x_row_bytes = ints[kXRowBytes];
      s.topk_idx = I32(r, kIdx);
      s.slot = I32(r, kSlot);
      s.expert_count = I32(r, kExpertCount);
      s.T = T;
      s.hidden = int(ints[kHidden]);
      s.mode = int(ints[kMode]);
      s.scale_mode = int(ints[kScaleMode]);
      s.put_mask = put_mask;
      s.host_err = device_error_word(ErrorOp::kLowLatencyDispatch);
      if (cudaError_t e = launch_ll_dispatch_send(s, grid, st); e != cudaSuccess) return e;
      LlDispatchRecvArgs v;
      v.peers = peers;
      v.lay = lay;
      v.out = P(r, kOut);
      v.out_scales = P(r, kOutScales);
      v.out_info = I32(r, kOutInfo);
      v.src_count = I32(r, kSrcCount);
      v.count = I32(r, kCount);
      v.put_mask = put_mask;
      v.host_err = device_error_word(ErrorOp::kLowLatencyDispatch);
      v.timeout_ns = kLoopbackTimeoutNs;
      if (cudaError_t e = launch_ll_dispatch_recv(v, grid, st); e != cudaSuccess) return e;
    }
    if (ops & kLlOpCombine) {
      LlCombineSendArgs s;
      s.peers = peers;
      s.lay = lay;
      s.y = P(r, kY);
      s.info = I32(r, kCInfo);
      s.src_count = I32(r, kCSrcCount);
      s.put_mask = put_mask;
      s.host_err = device_error_word(ErrorOp::kLowLatencyCombine);
      if (cudaError_t e = launch_ll_combine_send(s, grid, st); e != cudaSuccess) return e;
      LlCombineRecvArgs v;
      v.peers = peers;
      v.lay = lay;
      v.T = T;
      v.slot = I32(r, kSlot);
      v.weights = static_cast<const float*>(P(r, kWeights));
      v.dtype = int(ints[kYDtype]);
      v.out = P(r, kCOut);
      v.put_mask = put_mask;
      v.host_err = device_error_word(ErrorOp::kLowLatencyCombine);
      v.timeout_ns = kLoopbackTimeoutNs;
      if (cudaError_t e = launch_ll_combine_recv(v, grid, st); e != cudaSuccess) return e;
    }
    return cudaSuccess;
  });
}

}  // namespace jax_ep
