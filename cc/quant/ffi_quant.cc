// XLA FFI target of the fp8 quantization kernels (jax_ep/gmm/cuda_quant.py),
// one kernel on XLA's stream; no runtime needed (no jax_ep.initialize()).
//
// jax_ep_quantize_weights (quant/weights.cu): w [G, K, N] bf16 or f32 ->
// q [G, K, N] e4m3, scales [G, K/128, N/128] f32, q_t [G, N, K] e4m3,
// scales_t [G, N/128, K/128] f32. Attribute scale_mode: the Fp8ScaleMode.
#include <string>

#include "common/ffi_common.h"
#include "quant/kernels.h"

namespace jax_ep {

namespace {

constexpr const char* kOp = "quantize_weights";

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
  const char* why = quant_weights_shape_error(a);
  if (why[0] != '\0') return InvalidArgument(op + ": " + why);
  if (scale_mode != kFp8ScaleXlaGpu && scale_mode != kFp8ScaleIeee && scale_mode != kFp8ScaleUe8m0)
    return InvalidArgument(op + ": unknown scale_mode " + std::to_string(scale_mode));
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
