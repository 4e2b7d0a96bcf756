// How a kernel's blocks and warps share out rows, and the grid-wide "last
// block" step: helpers of every kernel that spreads a variable number of rows
// over a fixed grid (the low-latency and ragged kernels).
#pragma once

#include <cuda_runtime.h>

namespace jax_ep {

// Every block calls this once, after its stores; true (block-uniform) in the
// last block to arrive, which is then ordered after every block's stores
// (fence before each arrival, fence after the last). *done is back at 0 after.
__device__ __forceinline__ bool last_block(unsigned int* done) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(done, 1u) == gridDim.x - 1;
    if (last) *done = 0u;
  }
  __syncthreads();
  if (last) __threadfence_system();
  return last;
}

// In place over sm[0..n): sm[i] = sum of the inputs before i, sm[n] = total.
// One warp scans (n is a few thousand at most); the block waits at the barriers.
template <typename T>
__device__ __forceinline__ void block_exclusive_scan(T* sm, int n) {
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    T carry = 0;
    for (int base = 0; base < n; base += 32) {
      const int i = base + lane;
      const T v = i < n ? sm[i] : T(0);
      T incl = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const T u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
      }
      if (i < n) sm[i] = carry + incl - v;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) sm[n] = carry;
  }
  __syncthreads();
}

// The block b with pre[b] <= v < pre[b + 1] (pre[0] = 0 <= v < pre[n]).
template <typename T>
__device__ __forceinline__ int locate(const T* pre, int n, T v) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (pre[mid] <= v) lo = mid;
    else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ int global_warp() {
  return blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
}
__device__ __forceinline__ int num_warps() { return gridDim.x * (blockDim.x / 32); }

// Column slices per row so that n rows fill the grid's warps (when there are
// fewer rows than warps), at most `units` (a row's 128-vector units).
__device__ __forceinline__ int warp_slices(long long n, long long units) {
  const long long per = num_warps() / (n > 1 ? n : 1);
  return static_cast<int>(max(1LL, min(per, units)));
}

// Bytes [*b0, *b1) of slice sl of `slices` of a row of nvec vectors of v
// bytes, cut at multiples of 128 vectors.
__device__ __forceinline__ void vec_slice(long long nvec, int v, int sl, int slices, long long* b0,
                                          long long* b1) {
  const long long units = (nvec + 127) / 128;
  *b0 = 128 * (units * sl / slices) * v;
  *b1 = min(128 * (units * (sl + 1) / slices), nvec) * v;
}

}  // namespace jax_ep
