// XLA FFI target "jax_ep_ping": runtime self-test (tests/gpu/test_runtime.py).
// Also the smallest example of a handler that needs the runtime and peers.
#include "common/ffi_common.h"
#include "testing/ping.h"

namespace jax_ep {
namespace {

ffi::Error PingImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> x,
                    ffi::Span<const int32_t> ep_groups, int32_t num_ranks,
                    ffi::ResultBuffer<ffi::S32> y) {
  PeerTable peers;
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &peers));
  if (runtime()->transport != Transport::kNvshmem)
    return InvalidArgument("ping: an NVSHMEM barrier test (the NVSHMEM transport only)");
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (static_cast<size_t>(n) * sizeof(int32_t) > runtime()->region(kRegionNormal).bytes)
    return InvalidArgument("ping: input larger than the symmetric buffer");
  JAX_EP_CUDA_RETURN(launch_ping(peers, x.typed_data(), y->typed_data(), n, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

// Not command-buffer compatible: NVSHMEM's on-stream barrier is kept out of graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpPing, jax_ep::PingImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<xla::ffi::Span<const int32_t>>("ep_groups")
                                  .Attr<int32_t>("num_ranks")
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());
