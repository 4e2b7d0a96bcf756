// The fp8 dw kernel's operands cast per column per 128 regrouped rows and
// transposed (quant/kernels.h): one pass over the rows, where XLA's path
// gathers, dequantizes, reduces, casts and transposes in several.
//
// One CTA per 128-row block b of the regrouped rows and 128 columns, 256
// threads (quant/block_t.cuh: which thread holds what, the transposed tile).
// A column's amax is over its 128 rows: per thread over its 8 rows, then the
// two lanes of a warp that share the column, then the 8 warps.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/fp8_cast.cuh"
#include "quant/block_t.cuh"
#include "quant/kernels.h"

namespace jax_ep {

namespace {

using namespace block_t;

// Row r's 8 values of this thread's columns, as f32 (e4m3: times the row's
// scale of this column block, one rounding, as XLA's dequantize).
template <int Kind>
__device__ __forceinline__ void load_row(const QuantColumnsArgs& a, long long r, int cb,
                                         float* f) {
  const long long at = r * a.c + cb * kBlock + 8 * chunk();
  if constexpr (Kind == kColumnsE4m3) {
    const uint2 v = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(a.rows) + at);
    const float s = a.row_scales[r * (a.c / kBlock) + cb];
    const __nv_fp8x2_storage_t* p = reinterpret_cast<const __nv_fp8x2_storage_t*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(p[i], __NV_E4M3)));
      f[2 * i] = __fmul_rn(t.x, s);
      f[2 * i + 1] = __fmul_rn(t.y, s);
    }
  } else if constexpr (Kind == kColumnsBf16) {
    Load8<__nv_bfloat16>::run(static_cast<const __nv_bfloat16*>(a.rows) + at, f);
  } else {
    Load8<float>::run(static_cast<const float*>(a.rows) + at, f);
  }
}

template <int Kind>
__global__ void __launch_bounds__(kThreads) quant_columns_kernel(QuantColumnsArgs a) {
  __shared__ uint32_t tile[kTileWords];
  __shared__ float col_max[kThreads / 32][kBlock];
  const int cb_n = a.c / kBlock;
  const int b = static_cast<int>(blockIdx.x / cb_n), cb = static_cast<int>(blockIdx.x % cb_n);
  const int src = a.block_src[b], n = a.block_rows[b];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c = chunk();

  float f[2][4][8];
  float amax[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) amax[j] = 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = row_of(h, i);
      if (r < n) {
        load_row<Kind>(a, static_cast<long long>(src) + r, cb, f[h][i]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) f[h][i][j] = 0.f;   // the regrouped gaps
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) amax[j] = fmaxf(amax[j], fabsf(f[h][i][j]));
    }
  // lanes l and l ^ 16 hold the same columns; then the 8 warps
#pragma unroll
  for (int j = 0; j < 8; ++j) amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], 16));
  if (lane < 16) {
#pragma unroll
    for (int j = 0; j < 8; ++j) col_max[warp][8 * c + j] = amax[j];
  }
  __syncthreads();
  float scale[8], inv[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float m = col_max[0][8 * c + j];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, col_max[w][8 * c + j]);
    fp8_block_scale(m, a.scale_mode, &scale[j], &inv[j]);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint2 q[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = cast8(f[h][i], inv);
    put_t_words(tile, q, h);
  }
  if (threadIdx.x < 16) {   // warp 0's first 16 lanes: every column once
    float4* s = reinterpret_cast<float4*>(a.scales + static_cast<long long>(b) * a.c +
                                          cb * kBlock + 8 * c);
    s[0] = make_float4(scale[0], scale[1], scale[2], scale[3]);
    s[1] = make_float4(scale[4], scale[5], scale[6], scale[7]);
  }
  __syncthreads();
  // q_t rows cb * 128 + n (n < 128), columns b * 128 .. b * 128 + 127
  store_t_tile(tile,
               static_cast<char*>(a.q_t) + static_cast<long long>(cb) * kBlock * a.p + b * kBlock,
               a.p);
}

}  // namespace

const char* quant_columns_shape_error(const QuantColumnsArgs& a) {
  if (a.c <= 0 || a.c % kBlock) return "the rows' width must be a positive multiple of 128";
  if (a.p <= 0 || a.p % kBlock) return "P must be a positive multiple of 128";
  if (a.m <= 0) return "there must be at least one row";
  if (static_cast<long long>(a.p / kBlock) * (a.c / kBlock) >= (1LL << 31))
    return "the 128 x 128 blocks must fit in int32";
  if (a.rows_dtype != kColumnsE4m3 && a.rows_dtype != kColumnsBf16 && a.rows_dtype != kColumnsF32)
    return "the rows must be float8_e4m3fn, bfloat16 or float32";
  return "";
}

cudaError_t launch_quant_columns(const QuantColumnsArgs& a, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((a.p / kBlock) * (a.c / kBlock));
  switch (a.rows_dtype) {
    case kColumnsE4m3: quant_columns_kernel<kColumnsE4m3><<<blocks, kThreads, 0, stream>>>(a); break;
    case kColumnsBf16: quant_columns_kernel<kColumnsBf16><<<blocks, kThreads, 0, stream>>>(a); break;
    default: quant_columns_kernel<kColumnsF32><<<blocks, kThreads, 0, stream>>>(a); break;
  }
  return cudaGetLastError();
}

}  // namespace jax_ep
