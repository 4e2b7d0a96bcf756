// Host interface of the fp8 quantization kernels (jax_ep.quantize_weights_pair;
// the fp8 dw kernel's operands, jax_ep.gmm.fp8_columns; activation rows,
// jax_ep.gmm.cuda_quant.quantize_rows).
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

// The fp8 dw kernel's operands (jax_ep.gmm.fp8_columns): rows [m, c] regrouped
// into P rows (block b of 128 takes block_rows[b] rows from row block_src[b]
// on, the rest zeros), cast per column per 128 of them and transposed:
// q_t [c, P] e4m3, scales [P/128, c] f32. e4m3 rows are dequantized by their
// per-row scales [m, c/128] first (one f32 product); bf16 and f32 rows have
// none. The bits of fp8_columns' XLA path (common/fp8_cast.cuh).
struct QuantColumnsArgs {
  const void* rows = nullptr;          // [m, c]
  int rows_dtype = 0;                  // kColumnsE4m3 / kColumnsBf16 / kColumnsF32
  const float* row_scales = nullptr;   // [m, c/128] (e4m3 rows only)
  // block b: rows block_src[b] .. + block_rows[b] - 1 of `rows`, zeros after;
  // the caller keeps them in [0, m) (not checked on the device)
  const int32_t* block_src = nullptr;  // [p/128]
  const int32_t* block_rows = nullptr; // [p/128], each in [0, 128]
  void* q_t = nullptr;                 // [c, p] e4m3
  float* scales = nullptr;             // [p/128, c]
  int m = 0, c = 0, p = 0;
  int scale_mode = 0;                  // Fp8ScaleMode (jax_ep_abi.h)
};
constexpr int kColumnsE4m3 = 0, kColumnsBf16 = 1, kColumnsF32 = 2;

const char* quant_columns_shape_error(const QuantColumnsArgs& a);

cudaError_t launch_quant_columns(const QuantColumnsArgs& a, cudaStream_t stream);

// Activation rows to fp8-e4m3 with one f32 scale per row and 128 columns:
// x [m, h] (bf16 or f32) -> q [m, h] e4m3, scales [m, h/128]; the bits of
// dispatch's cast (common/fp8_cast.cuh) and of jax_ep.fp8_cast on the same GPU.
struct QuantRowsArgs {
  const void* x = nullptr;      // [m, h], or [m, 2h] with swiglu
  bool x_f32 = false;           // else bf16
  bool swiglu = false;          // x = [gate | up]: cast silu(gate) * up
  void* q = nullptr;            // [m, h] e4m3
  float* scales = nullptr;      // [m, h/128]
  long long m = 0;
  int h = 0;
  int scale_mode = 0;           // Fp8ScaleMode (jax_ep_abi.h)
};

const char* quant_rows_shape_error(const QuantRowsArgs& a);

cudaError_t launch_quant_rows(const QuantRowsArgs& a, cudaStream_t stream);

}  // namespace jax_ep
