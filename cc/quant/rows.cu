// Activation rows to fp8 per row and 128 columns (quant/kernels.h): dispatch's
// cast (common/fp8_cast.cuh warp_cast_row), so the bits are dispatch's. One
// warp per row, eight rows per CTA: x is read once (XLA's cast reads it twice,
// once for the blocks' maxima and once for the cast). With swiglu the rows
// cast are silu(gate) * up of [gate | up] rows, computed as they are read.
#include <cuda_bf16.h>

#include "common/fp8_cast.cuh"
#include "quant/kernels.h"

namespace jax_ep {

namespace {

constexpr int kRowWarps = 8;

__device__ __forceinline__ float round_to(float v, const float*) { return v; }
__device__ __forceinline__ float round_to(float v, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// silu(gate) * up of a [gate | up] row: g / (1 + exp(-g)) * u in f32, rounded
// once to the input dtype (jax_ep.quantize_swiglu's contract; XLA:GPU computes
// it in the same ops, its division div.full.f32)
template <typename Tin>
struct SwigluLoad8 {
  int up;   // elements from a gate element to its up element
  __device__ __forceinline__ void run(const Tin* p, float* f) const {
    float u[8];
    Load8<Tin>::run(p, f);
    Load8<Tin>::run(p + up, u);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      f[i] = round_to(div_full(f[i], 1.0f + expf(-f[i])) * u[i], p);
  }
};

template <typename Tin, bool Swiglu>
__global__ void __launch_bounds__(32 * kRowWarps) quant_rows_kernel(QuantRowsArgs a) {
  __shared__ float gathered[kRowWarps][kSmScales];   // a row's scales, stored as one run
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long row = static_cast<long long>(blockIdx.x) * kRowWarps + warp;
  if (row >= a.m) return;
  const int groups = a.h / 128;
  char* q = static_cast<char*>(a.q) + row * a.h;
  char* s = reinterpret_cast<char*>(a.scales + row * groups);
  const Tin* x = static_cast<const Tin*>(a.x) + row * a.h * (Swiglu ? 2 : 1);
  if constexpr (Swiglu)
    warp_cast_row<Tin, 16>(x, &q, &s, 1, 0, groups, lane, a.scale_mode, gathered[warp],
                           SwigluLoad8<Tin>{a.h});
  else
    warp_cast_row<Tin, 16>(x, &q, &s, 1, 0, groups, lane, a.scale_mode, gathered[warp]);
}

}  // namespace

const char* quant_rows_shape_error(const QuantRowsArgs& a) {
  if (a.h <= 0 || a.h % 128) return "H must be a positive multiple of 128";
  if (a.m <= 0) return "there must be at least one row";
  if ((a.m + kRowWarps - 1) / kRowWarps >= (1LL << 31)) return "too many rows for one grid";
  return "";
}

cudaError_t launch_quant_rows(const QuantRowsArgs& a, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((a.m + kRowWarps - 1) / kRowWarps);
  using Bf16 = __nv_bfloat16;
  auto kernel = a.x_f32 ? (a.swiglu ? quant_rows_kernel<float, true>
                                    : quant_rows_kernel<float, false>)
                        : (a.swiglu ? quant_rows_kernel<Bf16, true>
                                    : quant_rows_kernel<Bf16, false>);
  kernel<<<blocks, 32 * kRowWarps, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace jax_ep
