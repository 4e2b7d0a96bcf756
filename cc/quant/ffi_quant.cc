// XLA FFI target of the fp8 quantization kernels (jax_ep/gmm/cuda_quant.py),
// one kernel on XLA's stream; no runtime needed (no jax_ep.initialize()).
//
// jax_ep_quantize_weights (quant/weights.cu): w [G, K, N] bf16 or f32 ->
// q [G, K, N] e4m3, scales [G, K/128, N/128] f32, q_t [G, N, K] e4m3,
// scales_t [G, N/128, K/128] f32. Attribute scale_mode: the Fp8ScaleMode.
//
// jax_ep_quantize_columns (quant/columns.cu): rows [M, C] e4m3 (with
// row_scales [M, C/128] f32) or bf16 / f32 (row_scales [0]), block_src and
// block_rows [P/128] int32 -> q_t [C, P] e4m3, scales [P/128, C] f32.
// Attribute scale_mode: the Fp8ScaleMode.
//
// jax_ep_quantize_rows (quant/rows.cu): x [M, H] bf16 or f32 -> q [M, H] e4m3,
// scales [M, H/128] f32. Attribute scale_mode: the Fp8ScaleMode.
// jax_ep_quantize_swiglu_rows: the same of silu(gate) * up for x = [gate | up]
// [M, 2H].
#include <string>

#include "common/ffi_common.h"
#include "quant/kernels.h"

namespace jax_ep {

namespace {

constexpr const char* kOp = "quantize_weights";

// The kernel's own shape check (`why`, "" if none) and the scale mode.
ffi::Error CheckKernelArgs(const std::string& op, const char* why, int32_t scale_mode) {
  if (why[0] != '\0') return InvalidArgument(op + ": " + why);
  if (scale_mode != kFp8ScaleXlaGpu && scale_mode != kFp8ScaleIeee && scale_mode != kFp8ScaleUe8m0)
    return InvalidArgument(op + ": unknown scale_mode " + std::to_string(scale_mode));
  return ffi::Error::Success();
}

ffi::Error QuantWeightsImpl(cudaStream_t stream, ffi::AnyBuffer w, int32_t scale_mode,
                            ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::Buffer<ffi::F32>> s,
                            ffi::Result<ffi::AnyBuffer> q_t,
                            ffi::Result<ffi::Buffer<ffi::F32>> s_t) {
  const std::string op = kOp;
  if (w.element_type() != ffi::BF16 && w.element_type() != ffi::F32)
    return InvalidArgument(op + ": w must be bfloat16 or float32");
  if (q->element_type() != ffi::F8E4M3FN || q_t->element_type() != ffi::F8E4M3FN)
    return InvalidArgument(op + ": q and q_t must be float8_e4m3fn");
  auto wd = w.dimensions(), qd = q->dimensions(), sd = s->dimensions(),
       td = q_t->dimensions(), ud = s_t->dimensions();
  if (wd.size() != 3 || qd.size() != 3 || sd.size() != 3 || td.size() != 3 || ud.size() != 3)
    return InvalidArgument(op + ": expected w, q [G, K, N], scales [G, K/128, N/128], "
                           "q_t [G, N, K], scales_t [G, N/128, K/128]");
  const int64_t kMax = int64_t(1) << 30;
  if (wd[0] >= kMax || wd[1] >= kMax || wd[2] >= kMax)
    return InvalidArgument(op + ": G, K and N must each be below 2^30");
  QuantWeightsArgs a;
  a.groups = static_cast<int>(wd[0]);
  a.k = static_cast<int>(wd[1]);
  a.n = static_cast<int>(wd[2]);
  if (qd[0] != wd[0] || qd[1] != wd[1] || qd[2] != wd[2] || td[0] != wd[0] ||
      td[1] != wd[2] || td[2] != wd[1] || sd[0] != wd[0] || sd[1] * 128 != wd[1] ||
      sd[2] * 128 != wd[2] || ud[0] != wd[0] || ud[1] != sd[2] || ud[2] != sd[1])
    return InvalidArgument(op + ": result shapes disagree with w [G, K, N] (q [G, K, N], "
                           "scales [G, K/128, N/128], q_t [G, N, K], scales_t [G, N/128, K/128])");
  JAX_EP_RETURN_IF_ERROR(CheckKernelArgs(op, quant_weights_shape_error(a), scale_mode));
  a.w = w.untyped_data();
  a.w_f32 = w.element_type() == ffi::F32;
  a.q = q->untyped_data();
  a.scales = s->typed_data();
  a.q_t = q_t->untyped_data();
  a.scales_t = s_t->typed_data();
  a.scale_mode = scale_mode;
  JAX_EP_CUDA_RETURN(launch_quant_weights(a, stream));
  return ffi::Error::Success();
}

ffi::Error QuantColumnsImpl(cudaStream_t stream, ffi::AnyBuffer rows,
                            ffi::Buffer<ffi::F32> row_scales, ffi::Buffer<ffi::S32> block_src,
                            ffi::Buffer<ffi::S32> block_rows, int32_t scale_mode,
                            ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::Buffer<ffi::F32>> s) {
  const std::string op = "quantize_columns";
  QuantColumnsArgs a;
  switch (rows.element_type()) {
    case ffi::F8E4M3FN: a.rows_dtype = kColumnsE4m3; break;
    case ffi::BF16: a.rows_dtype = kColumnsBf16; break;
    case ffi::F32: a.rows_dtype = kColumnsF32; break;
    default: return InvalidArgument(op + ": rows must be float8_e4m3fn, bfloat16 or float32");
  }
  if (q_t->element_type() != ffi::F8E4M3FN) return InvalidArgument(op + ": q_t must be e4m3");
  auto rd = rows.dimensions(), qd = q_t->dimensions(), sd = s->dimensions();
  auto xd = row_scales.dimensions();
  if (rd.size() != 2 || qd.size() != 2 || sd.size() != 2 || block_src.element_count() !=
      block_rows.element_count())
    return InvalidArgument(op + ": expected rows [M, C], q_t [C, P], scales [P/128, C] and "
                           "block_src, block_rows [P/128]");
  const int64_t kMax = int64_t(1) << 30;
  if (rd[0] >= kMax || rd[1] >= kMax || qd[1] >= kMax)
    return InvalidArgument(op + ": M, C and P must each be below 2^30");
  a.m = static_cast<int>(rd[0]);
  a.c = static_cast<int>(rd[1]);
  a.p = static_cast<int>(qd[1]);
  if (qd[0] != rd[1] || sd[1] != rd[1] || sd[0] * 128 != qd[1] ||
      static_cast<int64_t>(block_src.element_count()) * 128 != qd[1])
    return InvalidArgument(op + ": q_t [C, P], scales [P/128, C] and the block tables [P/128] "
                           "disagree with rows [M, C]");
  const bool scaled = a.rows_dtype == kColumnsE4m3;
  if (scaled ? (xd.size() != 2 || xd[0] != rd[0] || xd[1] * 128 != rd[1])
             : row_scales.element_count() != 0)
    return InvalidArgument(op + ": e4m3 rows take row_scales [M, C/128]; bf16 and f32 rows "
                           "take an empty row_scales");
  JAX_EP_RETURN_IF_ERROR(CheckKernelArgs(op, quant_columns_shape_error(a), scale_mode));
  a.rows = rows.untyped_data();
  a.row_scales = scaled ? row_scales.typed_data() : nullptr;
  a.block_src = block_src.typed_data();
  a.block_rows = block_rows.typed_data();
  a.q_t = q_t->untyped_data();
  a.scales = s->typed_data();
  a.scale_mode = scale_mode;
  JAX_EP_CUDA_RETURN(launch_quant_columns(a, stream));
  return ffi::Error::Success();
}

template <bool Swiglu>
ffi::Error QuantRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, int32_t scale_mode,
                         ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::Buffer<ffi::F32>> s) {
  const std::string op = Swiglu ? "quantize_swiglu_rows" : "quantize_rows";
  const int64_t width = Swiglu ? 2 : 1;   // x's columns per q column
  if (x.element_type() != ffi::BF16 && x.element_type() != ffi::F32)
    return InvalidArgument(op + ": x must be bfloat16 or float32");
  if (q->element_type() != ffi::F8E4M3FN) return InvalidArgument(op + ": q must be e4m3");
  auto xd = x.dimensions(), qd = q->dimensions(), sd = s->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || qd[0] != xd[0] ||
      qd[1] * width != xd[1] || sd[0] != xd[0] || sd[1] * 128 != qd[1])
    return InvalidArgument(op + (Swiglu ? ": expected x [M, 2H], q [M, H] and scales [M, H/128]"
                                        : ": expected x, q [M, H] and scales [M, H/128]"));
  if (xd[1] >= (int64_t(1) << 30)) return InvalidArgument(op + ": x's width must be below 2^30");
  QuantRowsArgs a;
  a.m = xd[0];
  a.h = static_cast<int>(qd[1]);
  a.swiglu = Swiglu;
  JAX_EP_RETURN_IF_ERROR(CheckKernelArgs(op, quant_rows_shape_error(a), scale_mode));
  a.x = x.untyped_data();
  a.x_f32 = x.element_type() == ffi::F32;
  a.q = q->untyped_data();
  a.scales = s->typed_data();
  a.scale_mode = scale_mode;
  JAX_EP_CUDA_RETURN(launch_quant_rows(a, stream));
  return ffi::Error::Success();
}

}  // namespace

}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpQuantizeWeights, jax_ep::QuantWeightsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()               // w [G, K, N]
                                  .Attr<int32_t>("scale_mode")              // Fp8ScaleMode
                                  .Ret<xla::ffi::AnyBuffer>()               // q [G, K, N] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // scales
                                  .Ret<xla::ffi::AnyBuffer>()               // q_t [G, N, K] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()); // scales_t

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpQuantizeColumns, jax_ep::QuantColumnsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()               // rows [M, C]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // row_scales
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // block_src
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // block_rows
                                  .Attr<int32_t>("scale_mode")              // Fp8ScaleMode
                                  .Ret<xla::ffi::AnyBuffer>()               // q_t [C, P] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()); // scales

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpQuantizeRows, jax_ep::QuantRowsImpl<false>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()               // x [M, H]
                                  .Attr<int32_t>("scale_mode")              // Fp8ScaleMode
                                  .Ret<xla::ffi::AnyBuffer>()               // q [M, H] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()); // scales [M, H/128]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpQuantizeSwigluRows, jax_ep::QuantRowsImpl<true>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Arg<xla::ffi::AnyBuffer>()               // x [M, 2H]
                                  .Attr<int32_t>("scale_mode")              // Fp8ScaleMode
                                  .Ret<xla::ffi::AnyBuffer>()               // q [M, H] e4m3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()); // scales [M, H/128]
