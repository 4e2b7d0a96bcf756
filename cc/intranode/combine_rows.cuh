// Row reductions of the combine kernels (intranode and internode): the
// expert-side weighted sum of a token's rows, the source-side sum of staged
// partials, and the rows / weights of a received slot. f32 arithmetic op for op
// as jax_ep.reference (__fmul_rn / __fadd_rn: no FMA contraction).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/row_copy.cuh"
#include "intranode/kernels.h"

namespace jax_ep {

// Internal linkage, as when these lived in each kernel file: each kernel
// compiles its own copy under its own launch bounds (a shared out-of-line
// copy would not be held to the caller's register limit).
namespace {

// pa += wk * f32(v) (or f32(v) unweighted), element by element.
template <typename T, int V>
__device__ __forceinline__ void add_vecs(const typename VecT<V>::type (&v)[kU], float wk,
                                         bool weighted, float (&pa)[kU][V / sizeof(T)]) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const T* tv = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
    for (int e = 0; e < int(V / sizeof(T)); ++e) {
      const float f = Cvt<T>::f(tv[e]);
      pa[u][e] = __fadd_rn(pa[u][e], weighted ? __fmul_rn(wk, f) : f);
    }
  }
}

// Adds sum_k w_k * f32(y[rows[k]]) (k ascending) for the lane's kU vectors at
// i0 + 32u into pa. PAIR: two rows' loads are in flight before either is
// added, for the expert-side reduce (sender, and the source's own partial),
// which is load-latency bound (one row at a time it waited n times per kU
// vectors). The sum is k ascending, element by element, either way. Without
// PAIR where the registers are short (inside warp_combine_token).
template <typename T, int V, bool PAIR>
__device__ __forceinline__ void accum_rows(const char* y, long long row_bytes, long long off,
                                           const int* rows, const float* w, int n, bool weighted,
                                           long long i0, long long nv,
                                           float (&pa)[kU][V / sizeof(T)]) {
  using Vec = typename VecT<V>::type;
  for (int k = 0; k < n; k += PAIR ? 2 : 1) {
    const bool two = PAIR && k + 1 < n;
    Vec v0[kU], v1[kU];
    load_vecs<V>(y + static_cast<long long>(rows[k]) * row_bytes + off, i0, nv, v0);
    if (two) load_vecs<V>(y + static_cast<long long>(rows[k + 1]) * row_bytes + off, i0, nv, v1);
    add_vecs<T, V>(v0, w[k], weighted, pa);
    if (two) add_vecs<T, V>(v1, w[k + 1], weighted, pa);
  }
}

// f32 accumulators of a lane: kU vectors of E elements.
template <int E>
__device__ __forceinline__ void zero_acc(float (&acc)[kU][E]) {
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int e = 0; e < E; ++e) acc[u][e] = 0.f;
}


// Warp reduces bytes [off, off + len) of n rows (weights w or 1) into the
// same range of dst (may be remote), cast to T.
template <typename T, int V>
__device__ __forceinline__ void warp_reduce_rows(const char* y, long long row_bytes,
                                                 const int* rows, const float* w, int n,
                                                 bool weighted, char* dst, long long off,
                                                 long long len, int lane) {
  constexpr int E = V / sizeof(T);
  const long long nv = len / V;
  dst += off;
  for (long long i0 = lane; i0 < nv; i0 += 32 * kU) {
    float pa[kU][E];
    zero_acc(pa);
    accum_rows<T, V, true>(y, row_bytes, off, rows, w, n, weighted, i0, nv, pa);
    store_acc<T, V>(pa, dst, i0, nv);
  }
}

// Warp forms out[t] = cast(sum over the partials q = 0..n-1 in order of
// f32(partial_q)), where partial q is the staged row src[q] of a peer, or, at
// q == local_pos, this rank's own partial cast(sum_k w_k * f32(y[rows[k]]))
// formed here from y (it never goes through the staging buffer). Only bytes
// [off, off + len) of the rows.
template <typename T, int V>
__device__ __forceinline__ void warp_combine_token(const char* const* src, int n, int local_pos,
                                                   const char* y, long long row_bytes,
                                                   const int* rows, const float* w, int n_rows,
                                                   bool weighted, char* out, long long off,
                                                   long long len, int lane) {
  using Vec = typename VecT<V>::type;
  constexpr int E = V / sizeof(T);
  const long long nv = len / V;
  out += off;
  for (long long i0 = lane; i0 < nv; i0 += 32 * kU) {
    float acc[kU][E];
    zero_acc(acc);
    for (int q = 0; q < n; ++q) {
      if (q == local_pos) {
        float pa[kU][E];
        zero_acc(pa);
        accum_rows<T, V, false>(y, row_bytes, off, rows, w, n_rows, weighted, i0, nv, pa);
#pragma unroll
        for (int u = 0; u < kU; ++u)
#pragma unroll
          for (int e = 0; e < E; ++e)
            acc[u][e] = __fadd_rn(acc[u][e], Cvt<T>::f(Cvt<T>::t(pa[u][e])));
      } else {
        // (two staged partials in flight at once here spilled 356 B at bf16)
        Vec v[kU];
        load_vecs<V>(src[q] + off, i0, nv, v);
        add_vecs<T, V>(v, 1.f, false, acc);
      }
    }
    store_acc<T, V>(acc, out, i0, nv);
  }
}

constexpr int kMaxK = 32;

// Rows (and weights) of this rank's slots for received (s, t), k ascending;
// *received = whether (s, t) was sent here at all (then a partial is owed,
// maybe zero). Warp-wide: lane k loads slot k (one load round, not 2-3K
// dependent ones; K <= 32).
__device__ __forceinline__ int slot_rows(const CombineArgs& a, int s, int t, int* rows, float* w,
                                         bool* received, int lane) {
  const long long st = static_cast<long long>(s) * a.T + t;
  const int li = lane < a.K ? __ldg(a.recv_local_idx + st * a.K + lane) : -1;
  const int row = li >= 0 ? __ldg(a.slot_row + st * a.K + lane) : -1;
  const bool ok = row >= 0 && row < a.C;
  *received = __any_sync(0xffffffffu, li >= 0);
  unsigned m = __ballot_sync(0xffffffffu, ok);
  if (a.rank_major) {  // one row per (s, t): the same for every k
    if (!m) return 0;
    rows[0] = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
    w[0] = 1.f;
    return 1;
  }
  const float wv = ok && a.row_weights ? __ldg(a.row_weights + row) : 1.f;
  int n = 0;
  for (; m; m &= m - 1, ++n) {
    rows[n] = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
    w[n] = __shfl_sync(0xffffffffu, wv, __ffs(m) - 1);
  }
  return n;
}

}  // namespace
}  // namespace jax_ep
