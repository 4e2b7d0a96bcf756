// The per-token, per-128-channel fp8-e4m3 cast of a row inside one warp
// (jax_ep.fp8_cast's bits in every Fp8ScaleMode), shared by the intranode
// dispatch and the low-latency dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/row_copy.cuh"
#include "jax_ep_abi.h"

namespace jax_ep {

// Loads 8 consecutive input elements as f32.
template <typename Tin> struct Load8;
template <> struct Load8<__nv_bfloat16> {
  __device__ __forceinline__ static void run(const void* p, float* f) {
    int4 v = *reinterpret_cast<const int4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
};
template <> struct Load8<float> {
  __device__ __forceinline__ static void run(const void* p, float* f) {
    const float4* q = reinterpret_cast<const float4*>(p);
    float4 a = q[0], b = q[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  }
};

// a / b as XLA:GPU divides f32 (the approximate div.full.f32)
__device__ __forceinline__ float div_full(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// 448 / amax, rounded as the scale mode says (kFp8ScaleXlaGpu: as XLA:GPU's
// f32 division; kFp8ScaleIeee: IEEE).
__device__ __forceinline__ float fp8_inv(float amax, int scale_mode) {
  return scale_mode == kFp8ScaleXlaGpu ? div_full(448.0f, amax) : __fdiv_rn(448.0f, amax);
}

// The scale of a block whose largest magnitude is `amax` and the multiplier
// its values are cast with, as the scale mode says, with am = max(amax, 1e-4)
// (the floor keeps an all-zero block finite): UE8M0: the smallest 2^k with
// 448 * 2^k >= am (448 = 1.75 * 2^8; am = m * 2^p, m in [0.5, 1)), exact like
// jax_ep.fp8_cast(scale_format="ue8m0"); else am * fl(1/448) (XLA turns the
// division by a constant into this product) and 448 / am (fp8_inv).
__device__ __forceinline__ void fp8_block_scale(float amax, int scale_mode, float* scale,
                                                float* inv) {
  const float am = fmaxf(amax, 1e-4f);
  if (scale_mode == kFp8ScaleUe8m0) {
    int p;
    const float m = frexpf(am, &p);
    const int k = m <= 0.875f ? p - 9 : p - 8;
    *scale = ldexpf(1.0f, k);
    *inv = ldexpf(1.0f, -k);
  } else {
    const float kInv448 = 1.0f / 448.0f;  // folded in f32 at compile time, = fl(1/448)
    *scale = __fmul_rn(am, kInv448);
    *inv = fp8_inv(am, scale_mode);
  }
}

constexpr int kSmScales = 128;  // scales a warp collects before one coalesced store

// Warp casts the 128-channel groups [g0, g1) of one row to fp8-e4m3 with one
// f32 scale per group and stores them to n destinations. Lane l owns EPL
// consecutive elements of a 32*EPL-element step, so 128/EPL lanes hold one
// group. The arithmetic is jax_ep.reference.fp8_cast as XLA compiles it:
// amax = max(max|x|, 1e-4); scale = amax * fl(1/448) (XLA turns the division
// by a constant into this product); q = satfinite_rn(x * (448 / amax)).
// Scales are collected in shared memory (sm, one slot per warp) and written as
// one contiguous run per row: one 4-byte store per group would cost a whole
// NVLink packet each.
// `load` reads 8 elements at src + e as f32 (Load8: the row as stored; the
// SwiGLU cast's loader computes them from two halves of a wider row).
template <typename Tin, int EPL, typename Load = Load8<Tin>>
__device__ __forceinline__ void warp_cast_row(const Tin* __restrict__ src, char* const* dst,
                                              char* const* dst_scales, int n, int g0, int g1,
                                              int lane, int scale_mode, float* sm,
                                              const Load& load = Load()) {
  constexpr int LPG = 128 / EPL;  // lanes per group
  constexpr int STEP = 32 * EPL;  // elements per warp step
  static_assert(EPL == 16, "the fp8 cast moves 16 elements per lane");
  constexpr int U = 2;  // steps in flight per lane (latency hiding)
  using Q = typename VecT<EPL>::type;  // EPL fp8 values
  const int e_end = 128 * g1;
  const bool gather = g1 - g0 <= kSmScales;
  for (int base = 128 * g0; base < e_end; base += STEP * U) {
    float f[U][EPL];
    float amax[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e0 = base + STEP * u + EPL * lane;
      amax[u] = 0.f;
      if (e0 < e_end) {
#pragma unroll
        for (int h = 0; h < EPL; h += 8) load.run(src + e0 + h, f[u] + h);
#pragma unroll
        for (int i = 0; i < EPL; ++i) amax[u] = fmaxf(amax[u], fabsf(f[u][i]));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int o = LPG / 2; o >= 1; o >>= 1)
        amax[u] = fmaxf(amax[u], __shfl_xor_sync(0xffffffffu, amax[u], o));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e0 = base + STEP * u + EPL * lane;
      if (e0 >= e_end) continue;
      float scale, inv;
      fp8_block_scale(amax[u], scale_mode, &scale, &inv);
      Q q;
      unsigned short* qs = reinterpret_cast<unsigned short*>(&q);
#pragma unroll
      for (int i = 0; i < EPL / 2; ++i) {
        float2 v = make_float2(__fmul_rn(f[u][2 * i], inv), __fmul_rn(f[u][2 * i + 1], inv));
        qs[i] = __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);
      }
      for (int d = 0; d < n; ++d) *reinterpret_cast<Q*>(dst[d] + e0) = q;
      if (lane % LPG == 0) {
        if (gather) {
          sm[e0 / 128 - g0] = scale;
        } else {
          for (int d = 0; d < n; ++d) reinterpret_cast<float*>(dst_scales[d])[e0 / 128] = scale;
        }
      }
    }
  }
  if (gather) {
    __syncwarp();
    for (int d = 0; d < n; ++d)
      for (int i = lane; i < g1 - g0; i += 32)
        reinterpret_cast<float*>(dst_scales[d])[g0 + i] = sm[i];
    __syncwarp();
  }
}

}  // namespace jax_ep
