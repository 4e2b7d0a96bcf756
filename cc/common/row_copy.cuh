// Row movement helpers of the kernels: element conversions and warp-wide
// vector copies of a row to several destinations (local or peer rows).
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>

namespace jax_ep {

// Byte range [off, off + len) of slice `sl` of `slices` of a row of `nvec`
// vectors of `vec` bytes (slices differ by at most one vector).
__host__ __device__ inline void row_slice(long long nvec, int vec, int sl, int slices,
                                          long long* off, long long* len) {
  const long long b = nvec * sl / slices, e = nvec * (sl + 1) / slices;
  *off = b * vec;
  *len = (e - b) * vec;
}

// Element type <-> f32 (round to nearest even).
template <typename T> struct Cvt;
template <> struct Cvt<__nv_bfloat16> {
  __device__ __forceinline__ static float f(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 t(float v) { return __float2bfloat16_rn(v); }
};
template <> struct Cvt<__half> {
  __device__ __forceinline__ static float f(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half t(float v) { return __float2half_rn(v); }
};
template <> struct Cvt<float> {
  __device__ __forceinline__ static float f(float v) { return v; }
  __device__ __forceinline__ static float t(float v) { return v; }
};

// Vector type and count for copying rows of `bytes` bytes (all rows of a
// stream share the alignment of their row size; buffers are 256-B aligned).
template <int V> struct VecT;
template <> struct VecT<16> { using type = int4; };
template <> struct VecT<8> { using type = int2; };
template <> struct VecT<4> { using type = int; };
template <> struct VecT<2> { using type = short; };
template <> struct VecT<1> { using type = char; };

__host__ __device__ inline int row_vec_bytes(long long bytes) {
  return (bytes % 16 == 0) ? 16 : (bytes % 8 == 0) ? 8 : (bytes % 4 == 0) ? 4 : (bytes % 2 == 0) ? 2 : 1;
}

// Warp copies bytes [off, off + bytes) of a row to the same range of up to
// `n` destination rows (dst[i] may be remote); off and bytes are multiples of
// V. UNROLL independent loads in flight per lane.
template <int V, int UNROLL = 4>
__device__ __forceinline__ void warp_copy_row_multi(const void* __restrict__ src, void* const* dst,
                                                    int n, long long off, long long bytes,
                                                    int lane) {
  using T = typename VecT<V>::type;
  const T* s = reinterpret_cast<const T*>(static_cast<const char*>(src) + off);
  const long long nv = bytes / V;
  long long i = lane;
  for (; i + 32 * (UNROLL - 1) < nv; i += 32 * UNROLL) {
    T v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = s[i + 32 * u];
    for (int d = 0; d < n; ++d) {
      T* o = reinterpret_cast<T*>(static_cast<char*>(dst[d]) + off);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) o[i + 32 * u] = v[u];
    }
  }
  for (; i < nv; i += 32) {
    T v = s[i];
    for (int d = 0; d < n; ++d) reinterpret_cast<T*>(static_cast<char*>(dst[d]) + off)[i] = v;
  }
}

// A lane's share of a row reduction (the combine kernels of both families):
// kU vectors of V bytes in flight per lane, at vectors i0 + 32u (u < kU) of
// a row of nv vectors.
constexpr int kU = 4;  // vectors in flight per lane per row (latency hiding)

// Loads the lane's kU vectors at i0 + 32u of row r (bytes from off).
template <int V>
__device__ __forceinline__ void load_vecs(const char* r, long long i0, long long nv,
                                          typename VecT<V>::type (&v)[kU]) {
  const auto* p = reinterpret_cast<const typename VecT<V>::type*>(r);
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (i0 + 32 * u < nv) v[u] = p[i0 + 32 * u];
}

// Casts the lane's accumulators to T and stores them at vectors i0 + 32u of dst.
template <typename T, int V>
__device__ __forceinline__ void store_acc(const float (&acc)[kU][V / sizeof(T)], char* dst,
                                          long long i0, long long nv) {
  using Vec = typename VecT<V>::type;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    if (i0 + 32 * u >= nv) continue;
    Vec o;
    T* to = reinterpret_cast<T*>(&o);
#pragma unroll
    for (int e = 0; e < int(V / sizeof(T)); ++e) to[e] = Cvt<T>::t(acc[u][e]);
    reinterpret_cast<Vec*>(dst)[i0 + 32 * u] = o;
  }
}

template <int V>
__device__ __forceinline__ void warp_zero_row(void* dst, long long bytes, int lane) {
  using T = typename VecT<V>::type;
  T z;
  memset(&z, 0, sizeof(T));
  T* o = reinterpret_cast<T*>(dst);
  for (long long i = lane; i < bytes / V; i += 32) o[i] = z;
}

// Runtime-dispatched wrappers: v = the stream's vector width (row_vec_bytes of
// its row size), which off and bytes are multiples of.
__device__ __forceinline__ void warp_copy_row_any(const void* src, void* const* dst, int n,
                                                  long long off, long long bytes, int v, int lane) {
  switch (v) {
    case 16: warp_copy_row_multi<16>(src, dst, n, off, bytes, lane); break;
    case 8: warp_copy_row_multi<8>(src, dst, n, off, bytes, lane); break;
    case 4: warp_copy_row_multi<4>(src, dst, n, off, bytes, lane); break;
    case 2: warp_copy_row_multi<2>(src, dst, n, off, bytes, lane); break;
    default: warp_copy_row_multi<1>(src, dst, n, off, bytes, lane); break;
  }
}
__device__ __forceinline__ void warp_zero_row_any(void* dst, long long bytes, int lane) {
  switch (row_vec_bytes(bytes)) {
    case 16: warp_zero_row<16>(dst, bytes, lane); break;
    case 8: warp_zero_row<8>(dst, bytes, lane); break;
    case 4: warp_zero_row<4>(dst, bytes, lane); break;
    case 2: warp_zero_row<2>(dst, bytes, lane); break;
    default: warp_zero_row<1>(dst, bytes, lane); break;
  }
}

}  // namespace jax_ep
