// XLA FFI target "jax_ep_bench_transfer": the link ceilings of bench/ep_bench.py.
#include "common/ffi_common.h"
#include "intranode/ring_layout.h"
#include "testing/bench_transfer.h"

namespace jax_ep {
namespace {

ffi::Error BenchTransferImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::U8> src,
                             ffi::Buffer<ffi::S32> token, ffi::Span<const int32_t> ep_groups,
                             int32_t num_ranks, int32_t mode, int32_t num_sms,
                             ffi::Result<ffi::Buffer<ffi::S32>> token_out) {
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  PeerTable peers;
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &peers));
  Runtime* rt = runtime();
  const size_t normal_bytes = rt->region(kRegionNormal).bytes;
  const size_t bytes = src.element_count() & ~size_t(15);
  if (bytes > stage_half_bytes(normal_bytes))
    return InvalidArgument("bench_transfer: larger than a staging half");
  const int blocks = num_sms > 0 ? num_sms : 2 * rt->sms_of(device);
  JAX_EP_CUDA_RETURN(launch_bench_transfer(peers, normal_bytes, src.untyped_data(), bytes, mode,
                                           blocks, device_error_word(ErrorOp::kTesting), stream));
  JAX_EP_CUDA_RETURN(cudaMemcpyAsync(token_out->untyped_data(), token.untyped_data(),
                                     token.size_bytes(), cudaMemcpyDeviceToDevice, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpBenchTransfer, jax_ep::BenchTransferImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<xla::ffi::Span<const int32_t>>("ep_groups")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("num_sms")
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());
