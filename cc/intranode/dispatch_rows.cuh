// Row helpers of the dispatch kernels (intranode and internode): the output
// rows of a received slot, the copy / fp8 cast of a row slice to several
// destinations, and the cursor over the rows a receiver must zero.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/fp8_cast.cuh"
#include "common/row_copy.cuh"
#include "intranode/kernels.h"
#include "intranode/launch_config.h"

namespace jax_ep {

// Internal linkage, as when these lived in each kernel file: each kernel
// compiles its own copy under its own launch bounds (a shared out-of-line
// copy would not be held to the caller's register limit).
namespace {

// Output rows of received slot (s, t), k ascending: expert_major has one per
// k (distinct), rank_major one row shared by every k. Warp-wide: lane k loads
// slot k (one load round, not K dependent ones; K <= 32).
__device__ __forceinline__ int gather_rows(const DispatchArgs& a, int s, int t, char** rows,
                                           char** srows, int lane) {
  const int32_t* sr = a.slot_row + (static_cast<long long>(s) * a.T + t) * a.K;
  const int kmax = a.rank_major ? 1 : a.K;
  const int mine = lane < kmax ? __ldg(sr + lane) : -1;
  int n = 0;
  for (int k = 0; k < kmax; ++k) {  // (a ballot loop here spilled ~300 B in the copy kernel)
    const int row = __shfl_sync(0xffffffffu, mine, k);
    if (row < 0 || row >= a.C) continue;
    rows[n] = static_cast<char*>(a.out) + static_cast<long long>(row) * a.row_bytes;
    if (a.s_row_bytes) srows[n] = static_cast<char*>(a.out_scales) + static_cast<long long>(row) * a.s_row_bytes;
    ++n;
  }
  return n;
}

constexpr int kMaxDst = 32;  // K bound for one gather (checked on the host)

// The f32 -> fp8 cast is rare: out of line, so it adds no register pressure.
template <int EPL>
__device__ __noinline__ void cast_row_f32(const DispatchArgs& a, const void* src, char* const* dst,
                                          char* const* dst_scales, int n, int g0, int g1, int lane,
                                          float* sm) {
  warp_cast_row<float, EPL>(static_cast<const float*>(src), dst, dst_scales, n, g0, g1, lane,
                            a.scale_mode, sm);
}

// Moves groups [g0, g1) / bytes [off, off + len) of token row t (source xr) to
// the n rows dst (+ its scale row to dsts when slice sl is 0): a copy, or the
// fp8 cast (EPL elements per lane; only in the EPL = 16 kernel).
template <int EPL>
__device__ __forceinline__ void move_row_slice(const DispatchArgs& a, int t, const char* xr,
                                               char* const* dst, char* const* dsts, int n, int sl,
                                               int slices, int v, int sv, int lane, float* sm) {
  if (EPL != 16 || a.mode == kDispatchCopy || a.mode == kDispatchCombineBwd) {  // bwd: sent as a copy
    long long off, len;
    row_slice(a.row_bytes / v, v, sl, slices, &off, &len);
    warp_copy_row_any(xr, reinterpret_cast<void* const*>(dst), n, off, len, v, lane);
    if (a.s_row_bytes && sl == 0)
      warp_copy_row_any(static_cast<const char*>(a.scales) + t * a.s_row_bytes,
                        reinterpret_cast<void* const*>(dsts), n, 0, a.s_row_bytes, sv, lane);
  } else if constexpr (EPL == 16) {
    const int G = a.hidden / 128;
    const int g0 = G * sl / slices, g1 = G * (sl + 1) / slices;
    if (a.mode == kDispatchCastBf16)
      warp_cast_row<__nv_bfloat16, EPL>(reinterpret_cast<const __nv_bfloat16*>(xr), dst, dsts, n,
                                        g0, g1, lane, a.scale_mode, sm);
    else
      cast_row_f32<EPL>(a, xr, dst, dsts, n, g0, g1, lane, sm);
  }
}

// The rows c = c0, c0 + stride, ... a receiver warp must zero: row_src[c] == -1
// and (zero_tail, or c pads a group: the align-block holding c starts with a
// valid row). 32 candidates per ballot, one load per lane, so passing over
// valid and tail rows costs no chain of dependent loads. It also sets dw[c] = 0
// for every row_src -1 row it passes (combine backward: dw is [C], cheap).
struct ZeroCursor {
  int next, stride, base = 0;
  unsigned mask = 0;
  __device__ ZeroCursor(int c0, int stride_) : next(c0), stride(stride_) {}
  __device__ int pop(const DispatchArgs& a, int lane) {
    while (mask == 0 && next < a.C) {
      const int c = next + stride * lane;
      bool z = false;
      if (c < a.C && __ldg(a.row_src + c) < 0) {
        if (a.dw) a.dw[c] = 0.f;
        z = a.zero_tail || (a.align > 1 && __ldg(a.row_src + (c - c % a.align)) >= 0);
      }
      mask = __ballot_sync(0xffffffffu, z);
      base = next;
      next = min(a.C, next + 32 * stride);
    }
    if (mask == 0) return -1;
    const int i = __ffs(mask) - 1;
    mask &= mask - 1;
    return base + stride * i;
  }
};

}  // namespace
}  // namespace jax_ep
