// See loopback_internode.h.
#include "testing/loopback_internode.h"

#include <cuda_runtime.h>

#include <iterator>

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
  auto args = [&](int r) {
    InterDispatchArgs ia;
    ia.a = loopback_dispatch_args(ptrs, ints, R, r);
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
  if (R < 1 || R > kMaxRanks || ptrs.size() != size_t(kPtrs * R) || ints.size() != size_t(kInts + 1))
    return "loopback_inter_combine: bad arguments";
  if (std::string e = check_resident(R, int(ints[7])); !e.empty()) return e;
  auto args = [&](int r) {
    InterCombineArgs ia;
    ia.a = loopback_combine_args(ptrs, ints, R, r);
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
