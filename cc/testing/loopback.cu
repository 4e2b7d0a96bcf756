// See loopback.h.
#include "testing/loopback.h"

#include <cuda_runtime.h>

#include <chrono>
#include <functional>
#include <iterator>

#include "common/device_error.h"
#include "intranode/kernels.h"

namespace jax_ep {

PeerTable loopback_peers(const std::vector<uint64_t>& ptrs, int stride, int sym_index, int R,
                         int r) {
  PeerTable p;
  p.rank = r;
  p.num_ranks = R;
  for (int i = 0; i < R; ++i) p.peers[i] = reinterpret_cast<void*>(ptrs[stride * i + sym_index]);
  return p;
}

DispatchArgs loopback_dispatch_args(const std::vector<uint64_t>& ptrs,
                                    const std::vector<int64_t>& ints, int R, int r) {
  constexpr int kPtrs = int(std::size(kLoopbackDispatchPtrs));
  static_assert(kPtrs == 11, "pointer layout below");
  auto P = [&](int i) { return reinterpret_cast<void*>(ptrs[kPtrs * r + i]); };
  DispatchArgs a;
  a.peers = loopback_peers(ptrs, kPtrs, 7, R, r);
  a.x = P(0);
  a.scales = ints[6] && ints[7] == kDispatchCopy ? P(1) : nullptr;
  a.out = P(2);
  a.out_scales = P(3);
  a.row_src = static_cast<const int32_t*>(P(4));
  a.slot_row = static_cast<const int32_t*>(P(5));
  a.send_mask = static_cast<const bool*>(P(6));
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
  a.host_err = device_error_word(ErrorOp::kDispatch);
  a.timeout_ns = kLoopbackTimeoutNs;
  return a;
}

CombineArgs loopback_combine_args(const std::vector<uint64_t>& ptrs,
                                  const std::vector<int64_t>& ints, int R, int r) {
  constexpr int kPtrs = int(std::size(kLoopbackCombinePtrs));
  static_assert(kPtrs == 7, "pointer layout below");
  auto P = [&](int i) { return reinterpret_cast<void*>(ptrs[kPtrs * r + i]); };
  CombineArgs a;
  a.peers = loopback_peers(ptrs, kPtrs, 6, R, r);
  a.y = P(0);
  a.row_weights = static_cast<const float*>(P(1));
  a.slot_row = static_cast<const int32_t*>(P(2));
  a.recv_local_idx = static_cast<const int32_t*>(P(3));
  a.send_mask = static_cast<const bool*>(P(4));
  a.out = P(5);
  a.T = int(ints[0]);
  a.K = int(ints[1]);
  a.C = int(ints[2]);
  a.W = int(ints[3]);
  a.dtype = int(ints[4]);
  a.row_bytes = ints[5];
  a.rank_major = ints[6] != 0;
  a.host_err = device_error_word(ErrorOp::kCombine);
  a.timeout_ns = kLoopbackTimeoutNs;
  return a;
}

// Every rank's blocks spin on each other's flags: all must be resident at once.
std::string check_resident(int R, int num_blocks) {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return "loopback: no CUDA device";
  if (num_blocks < 1 || R * num_blocks > sms)
    return "loopback: R * num_blocks must be in [R, " + std::to_string(sms) + "] (one block per SM)";
  return "";
}

// Launches fn(r, stream_r) for every rank on its own stream, `iters` times
// back to back, then waits. *seconds: wall time per iteration (host clock
// around the whole queue: meaningful for iters >> 1 only).
std::string run_ranks(int R, int iters, double* seconds,
                      const std::function<cudaError_t(int, cudaStream_t)>& fn) {
  std::vector<cudaStream_t> streams(R, nullptr);
  std::string err;
  for (auto& s : streams)
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) err = "stream creation failed";
  cudaDeviceSynchronize();
  clear_device_error();  // a stale timeout from before this run is not ours
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters && err.empty(); ++i) {
    for (int r = 0; r < R && err.empty(); ++r) {
      cudaError_t e = fn(r, streams[r]);
      if (e != cudaSuccess) err = std::string("launch: ") + cudaGetErrorString(e);
    }
  }
  cudaError_t e = cudaDeviceSynchronize();
  const auto t1 = std::chrono::steady_clock::now();
  *seconds = std::chrono::duration<double>(t1 - t0).count() / (iters > 0 ? iters : 1);
  if (err.empty() && e != cudaSuccess) err = std::string("sync: ") + cudaGetErrorString(e);
  for (auto& s : streams)
    if (s) cudaStreamDestroy(s);
  const int timeout = take_device_error();
  if (err.empty() && timeout) err = "device-side timeout";
  // A rank that launched while another failed has moved its epoch on: the
  // caller must start from fresh (zeroed) buffers after any error.
  return err;
}

std::string loopback_dispatch(const std::vector<uint64_t>& ptrs, const std::vector<int64_t>& ints,
                              size_t sym_bytes, int R, int iters, double* seconds) {
  constexpr int kPtrs = int(std::size(kLoopbackDispatchPtrs));
  if (R < 1 || R > kMaxRanks || ptrs.size() != size_t(kPtrs * R) ||
      ints.size() != std::size(kLoopbackDispatchInts))
    return "loopback_dispatch: bad arguments";
  if (ints[1] > 32) return "loopback_dispatch: top-k above 32";
  const bool cast = ints[7] == kDispatchCastBf16 || ints[7] == kDispatchCastF32;
  if (cast && ints[3] % 128 != 0) return "loopback_dispatch: hidden % 128";
  if (std::string e = check_resident(R, int(ints[9])); !e.empty()) return e;
  if (sym_bytes <= kCtrlBytes) return "loopback_dispatch: sym_bytes must exceed the control region";
  if (ints[11] != kFp8ScaleIeee && ints[11] != kFp8ScaleXlaGpu && ints[11] != kFp8ScaleUe8m0)
    return "loopback_dispatch: fp8_scale_mode must be an Fp8ScaleMode";
  static_assert(std::size(kLoopbackDispatchPtrs) == 11, "pointer layout below");
  auto P = [&](int r, int i) { return reinterpret_cast<void*>(ptrs[kPtrs * r + i]); };
  return run_ranks(R, iters, seconds, [&](int r, cudaStream_t st) {
    DispatchArgs a = loopback_dispatch_args(ptrs, ints, R, r);
    a.ctrl_off = ctrl_offset(sym_bytes, kOpDispatch);
    if (a.mode == kDispatchCombineBwd) {
      a.y = P(r, 8);
      a.row_w = static_cast<const float*>(P(r, 9));
      a.dw = static_cast<float*>(P(r, 10));
    }
    LaunchConfig lc = make_launch_config(kOpDispatch, a.T > 0 ? a.T : 1, int(ints[9]),
                                         int(ints[9]), int(ints[10]));
    if (!fit_ring(&lc, R, a.T, a.row_bytes, a.s_row_bytes, stage_half_bytes(sym_bytes)))
      return cudaErrorInvalidValue;
    a.stage_off[0] = stage_offset(sym_bytes, kOpDispatch, 0);
    a.stage_off[1] = stage_offset(sym_bytes, kOpDispatch, 1);
    ring_bytes(R, lc.num_blocks, lc.depth, lc.chunk, a.row_bytes, a.s_row_bytes,
               &a.stage_scales_off);
    return launch_dispatch(a, lc, st);
  });
}

std::string loopback_combine(const std::vector<uint64_t>& ptrs, const std::vector<int64_t>& ints,
                             size_t sym_bytes, int R, int iters, double* seconds) {
  static_assert(std::size(kLoopbackCombinePtrs) == 7, "pointer layout below");
  if (R < 1 || R > kMaxRanks || ptrs.size() != size_t(7 * R) ||
      ints.size() != std::size(kLoopbackCombineInts))
    return "loopback_combine: bad arguments";
  if (ints[1] > 32) return "loopback_combine: top-k above 32";
  if (std::string e = check_resident(R, int(ints[7])); !e.empty()) return e;
  if (sym_bytes <= kCtrlBytes) return "loopback_combine: sym_bytes must exceed the control region";
  return run_ranks(R, iters, seconds, [&](int r, cudaStream_t st) {
    CombineArgs a = loopback_combine_args(ptrs, ints, R, r);
    a.ctrl_off = ctrl_offset(sym_bytes, kOpCombine);
    LaunchConfig lc = make_launch_config(kOpCombine, a.T > 0 ? a.T : 1, int(ints[7]),
                                         int(ints[7]), int(ints[8]));
    if (!fit_ring(&lc, R, a.T, a.row_bytes, 0, stage_half_bytes(sym_bytes)))
      return cudaErrorInvalidValue;
    a.stage_off[0] = stage_offset(sym_bytes, kOpCombine, 0);
    a.stage_off[1] = stage_offset(sym_bytes, kOpCombine, 1);
    return launch_combine(a, lc, st);
  });
}

}  // namespace jax_ep
