// See loopback_internode.h.
#include "testing/loopback_internode.h"

#include <cuda_runtime.h>

#include <iterator>

#include "internode/kernels.h"
#include "testing/loopback.h"
#include "testing/loopback_put.h"

namespace jax_ep {

namespace {

// ints' tail past the loopback_dispatch / loopback_combine layout: nodes,
// put, layout_T.
struct InterTail {
  int nodes = 1;
  bool put = false;
  int layout_T = 0;  // > 0: the runtime's fixed-T layout (InterDispatchArgs::layout_T)
};

// Rank r's network leg by puts (put mode): every rank of its local index, its
// own included, as NetPutMask's "put" (internode/ffi_handlers.cc).
unsigned int loopback_net_put_mask(int R, int nodes, int r) {
  const int G = R / nodes;
  unsigned int m = 0;
  for (int i = 0; i < R; ++i)
    if (i % G == r % G) m |= 1u << i;
  return m;
}

// Fills the put fields of rank r's peer table and mask (put mode); "" or why not.
template <typename Args>
std::string apply_put(const InterTail& tail, size_t sym_bytes, int R, int r, Args* ia) {
  if (!tail.put) return "";
  if (std::string e = loopback_put_peers(&ia->a.peers, sym_bytes); !e.empty()) return e;
  ia->put_mask = loopback_net_put_mask(R, tail.nodes, r);
  return "";
}

}  // namespace

std::string loopback_inter_dispatch(const std::vector<uint64_t>& ptrs,
                                    const std::vector<int64_t>& ints, size_t sym_bytes, int R,
                                    int iters, double* seconds) {
  constexpr int kPtrs = int(std::size(kLoopbackDispatchPtrs));
  constexpr int kInts = int(std::size(kLoopbackDispatchInts));
  if (R < 1 || R > kMaxRanks || ptrs.size() != size_t(kPtrs * R) || ints.size() != size_t(kInts + 3))
    return "loopback_inter_dispatch: bad arguments";
  const InterTail tail{int(ints[kInts]), ints[kInts + 1] != 0, int(ints[kInts + 2])};
  if (std::string e = check_resident(R, int(ints[9])); !e.empty()) return e;
  if (ints[11] != kFp8ScaleIeee && ints[11] != kFp8ScaleXlaGpu && ints[11] != kFp8ScaleUe8m0)
    return "loopback_inter_dispatch: fp8_scale_mode must be an Fp8ScaleMode";
  std::vector<InterDispatchArgs> args(R);
  for (int r = 0; r < R; ++r) {
    args[r].a = loopback_dispatch_args(ptrs, ints, R, r);
    args[r].nodes = tail.nodes;
    args[r].sym_bytes = sym_bytes;
    args[r].layout_T = tail.layout_T;
    if (std::string e = apply_put(tail, sym_bytes, R, r, &args[r]); !e.empty()) return e;
  }
  if (const char* e = inter_dispatch_check(args[0]); *e) return e;
  const InterLaunch lc =
      make_inter_launch(int(ints[0]), tail.layout_T, int(ints[9]), int(ints[10]));
  return run_ranks(R, iters, seconds, [&](int r, cudaStream_t st) {
    return launch_inter_dispatch(args[r], lc, st);
  });
}

std::string loopback_inter_combine(const std::vector<uint64_t>& ptrs,
                                   const std::vector<int64_t>& ints, size_t sym_bytes, int R,
                                   int iters, double* seconds) {
  constexpr int kPtrs = int(std::size(kLoopbackCombinePtrs));
  constexpr int kInts = int(std::size(kLoopbackCombineInts));
  if (R < 1 || R > kMaxRanks || ptrs.size() != size_t(kPtrs * R) || ints.size() != size_t(kInts + 3))
    return "loopback_inter_combine: bad arguments";
  const InterTail tail{int(ints[kInts]), ints[kInts + 1] != 0, int(ints[kInts + 2])};
  if (std::string e = check_resident(R, int(ints[7])); !e.empty()) return e;
  std::vector<InterCombineArgs> args(R);
  for (int r = 0; r < R; ++r) {
    args[r].a = loopback_combine_args(ptrs, ints, R, r);
    args[r].nodes = tail.nodes;
    args[r].sym_bytes = sym_bytes;
    args[r].layout_T = tail.layout_T;
    if (std::string e = apply_put(tail, sym_bytes, R, r, &args[r]); !e.empty()) return e;
  }
  if (const char* e = inter_combine_check(args[0]); *e) return e;
  const InterLaunch lc = make_inter_launch(int(ints[0]), tail.layout_T, int(ints[7]), int(ints[8]));
  return run_ranks(R, iters, seconds, [&](int r, cudaStream_t st) {
    return launch_inter_combine(args[r], lc, st);
  });
}

}  // namespace jax_ep
