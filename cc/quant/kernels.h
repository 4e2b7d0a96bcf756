// Host interface of the fp8 quantization kernels (jax_ep.quantize_weights_pair).
//
// Expert weights to fp8-e4m3 with one f32 scale per 128 x 128 block, in both
// layouts at once: w [G, K, N] (bf16 or f32) -> q [G, K, N], scales
// [G, K/128, N/128] ("gkn") and q_t [G, N, K], scales_t [G, N/128, K/128]
// ("gnk", the fp8 grouped matmul forward's K-major copy). One read of w, one
// write of each copy; the bits of jax_ep.quantize_weights in each layout
// (common/fp8_cast.cuh: fp8_block_scale, the scale mode as the FFI attribute).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep {

struct QuantWeightsArgs {
  const void* w = nullptr;      // [groups, k, n]
  bool w_f32 = false;           // else bf16
  void* q = nullptr;            // [groups, k, n] e4m3
  float* scales = nullptr;      // [groups, k/128, n/128]
  void* q_t = nullptr;          // [groups, n, k] e4m3
  float* scales_t = nullptr;    // [groups, n/128, k/128]
  int groups = 0, k = 0, n = 0;
  int scale_mode = 0;           // Fp8ScaleMode (jax_ep_abi.h)
};

// Why the kernel cannot run these shapes ("" if it can).
const char* quant_weights_shape_error(const QuantWeightsArgs& a);

cudaError_t launch_quant_weights(const QuantWeightsArgs& a, cudaStream_t stream);

}  // namespace jax_ep
