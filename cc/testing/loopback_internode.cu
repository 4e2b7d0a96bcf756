// See loopback_internode.h.
#include "testing/loopback_internode.h"

#include <cuda_runtime.h>

#include <iterator>

#include "device_error.h"
#include "kernels/internode.h"
#include "testing/loopback.h"

namespace jax_ep {

std::string loopback_inter_dispatch(const std::vector<uint64_t>& ptrs,
                                    const std::vector<int64_t>& ints, size_t sym_bytes, int R,
                                    int iters, double* seconds) {
  constexpr int kPtrs = int(std::size(kLoopbackDispatchPtrs));
  constexpr int kInts = int(std::size(kLoopbackDispatchInts));
  if (R < 1 || R > kMaxRanks || ptrs.size() != size_t(kPtrs * R) || ints.size() != size_t(kInts + 1))
    return "loopback_inter_dispatch: bad arguments";
  if (std::string e = check_resident(R, int(ints[9])); !e.empty()) return e;
  if (ints[11] != kFp8ScaleIeee && ints[11] != kFp8ScaleXlaGpu && ints[11] != kFp8ScaleUe8m0)
    return "loopback_inter_dispatch: fp8_scale_mode must be an Fp8ScaleMode";
  static_assert(std::size(kLoopbackDispatchPtrs) == 11, "pointer layout below");
  auto P = [&](int r, int i) { return reinterpret_cast<void*>(ptrs[kPtrs * r + i]); };
  auto args = [&](int r) {
    InterDispatchArgs ia;
    DispatchArgs& a = ia.a;
    a.peers = loopback_peers(ptrs, kPtrs, 7, R, r);
    a.x = P(r, 0);
    a.scales = ints[6] && ints[7] == kDispatchCopy ? P(r, 1) : nullptr;
    a.out = P(r, 2);
    a.out_scales = P(r, 3);
    a.row_src = static_cast<const int32_t*>(P(r, 4));
    a.slot_row = static_cast<const int32_t*>(P(r, 5));
    a.send_mask = static_cast<const bool*>(P(r, 6));
    a.T = int(ints[0]);
    a.K = int(ints[1]);
    a.C = int(ints[2]);
    a.hidden = int(ints[3]);
    a.x_row_bytes = ints[4];
    a.row_bytes = ints[5];
    a.s_row_bytes = ints[6];
    a.mode = int(ints[7]);
    a.rank_major = ints[8] != 0;
    a.scale_mode = int(ints[11]);
    a.zero_tail = ints[12] != 0;
    a.align = int(ints[13]);
    a.dtype = int(ints[14]);
    a.host_err = device_error_word();
    a.timeout_ns = kLoopbackTimeoutNs;
    ia.nodes = int(ints[kInts]);
    ia.sym_bytes = sym_bytes;
    return ia;
  };
  if (const char* e = inter_dispatch_check(args(0)); *e) return e;
  const InterLaunch lc = make_inter_launch(int(ints[0]), int(ints[9]), int(ints[10]));
  return run_ranks(R, iters, seconds, [&](int r, cudaStream_t st) {
    return launch_inter_dispatch(args(r), lc, st);
  });
}

std::string loopback_inter_combine(const std::vector<uint64_t>& ptrs,
                                   const std::vector<int64_t>& ints, size_t sym_bytes, int R,
                                   int iters, double* seconds) {
  constexpr int kPtrs = int(std::size(kLoopbackCombinePtrs));
  constexpr int kInts = int(std::size(kLoopbackCombineInts));
  static_assert(kPtrs == 7, "pointer layout below");
  if (R < 1 || R > kMaxRanks || ptrs.size() != size_t(kPtrs * R) || ints.size() != size_t(kInts + 1))
    return "loopback_inter_combine: bad arguments";
  if (std::string e = check_resident(R, int(ints[7])); !e.empty()) return e;
  auto P = [&](int r, int i) { return reinterpret_cast<void*>(ptrs[kPtrs * r + i]); };
  auto args = [&](int r) {
    InterCombineArgs ia;
    CombineArgs& a = ia.a;
    a.peers = loopback_peers(ptrs, kPtrs, 6, R, r);
    a.y = P(r, 0);
    a.row_weights = static_cast<const float*>(P(r, 1));
    a.slot_row = static_cast<const int32_t*>(P(r, 2));
    a.recv_local_idx = static_cast<const int32_t*>(P(r, 3));
    a.send_mask = static_cast<const bool*>(P(r, 4));
    a.out = P(r, 5);
    a.T = int(ints[0]);
    a.K = int(ints[1]);
    a.C = int(ints[2]);
    a.W = int(ints[3]);
    a.dtype = int(ints[4]);
    a.row_bytes = ints[5];
    a.rank_major = ints[6] != 0;
    a.host_err = device_error_word();
    a.timeout_ns = kLoopbackTimeoutNs;
    ia.nodes = int(ints[kInts]);
    ia.sym_bytes = sym_bytes;
    return ia;
  };
  if (const char* e = inter_combine_check(args(0)); *e) return e;
  const InterLaunch lc = make_inter_launch(int(ints[0]), int(ints[7]), int(ints[8]));
  return run_ranks(R, iters, seconds, [&](int r, cudaStream_t st) {
    return launch_inter_combine(args(r), lc, st);
  });
}

}  // namespace jax_ep
