// XLA FFI target "jax_ep_layout" (see intranode/layout.h). Needs no runtime:
// it only reads this rank's routing.
#include "common/ffi_common.h"
#include "intranode/layout.h"

namespace jax_ep {
namespace {

ffi::Error LayoutImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx, int32_t num_experts,
                      int32_t num_ranks, ffi::ResultBuffer<ffi::S32> per_rank,
                      ffi::ResultBuffer<ffi::S32> per_expert,
                      ffi::ResultBuffer<ffi::PRED> in_rank) {
  auto dims = topk_idx.dimensions();
  if (dims.size() != 2) return InvalidArgument("layout: topk_idx must be [T, K]");
  if (num_experts < 1 || num_ranks < 1 || num_experts % num_ranks != 0)
    return InvalidArgument("layout: num_experts must be a positive multiple of num_ranks");
  const int64_t T = dims[0], K = dims[1];
  if (per_rank->element_count() != static_cast<size_t>(num_ranks) ||
      per_expert->element_count() != static_cast<size_t>(num_experts) ||
      in_rank->element_count() != static_cast<size_t>(T * num_ranks))
    return InvalidArgument("layout: result shapes do not match [R], [E], [T, R]");
  JAX_EP_CUDA_RETURN(launch_layout(topk_idx.typed_data(), T, K, num_experts, num_ranks,
                                   per_rank->typed_data(), per_expert->typed_data(),
                                   in_rank->typed_data(), stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLayout, jax_ep::LayoutImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<int32_t>("num_experts")
                                  .Attr<int32_t>("num_ranks")
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
