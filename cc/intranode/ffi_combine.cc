// XLA FFI target "jax_ep_combine": expert-side partial sums go back to their
// source ranks and are reduced there (see intranode/combine.cu).
#include <string>

#include "common/ffi_common.h"
#include "intranode/ffi_args.h"
#include "intranode/ffi_launch.h"
#include "intranode/kernels.h"

namespace jax_ep {


namespace {

ffi::Error CombineImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y,
                       ffi::Buffer<ffi::F32> row_weights,
                       ffi::Buffer<ffi::S32> slot_row, ffi::Buffer<ffi::S32> recv_local_idx,
                       ffi::Buffer<ffi::PRED> send_mask, ffi::Span<const int32_t> ep_groups,
                       int32_t num_ranks, int32_t rank_major, int32_t weighted, int32_t num_sms,
                       int32_t chunk, int64_t timeout_ns, ffi::Result<ffi::AnyBuffer> out) {
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  PeerTable peers;
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &peers));
  Runtime* rt = runtime();
  const int R = peers.num_ranks;

  CombineArgs a;
  JAX_EP_RETURN_IF_ERROR(CombineArgsOf("combine", R, y, row_weights, slot_row, recv_local_idx,
                                       send_mask, *out, rank_major, weighted, chunk, timeout_ns,
                                       &a));
  const int T = a.T;
  a.peers = peers;
  a.ctrl_off = ctrl_offset(rt->region(kRegionNormal).bytes, kOpCombine);
  a.skip = debug_skip();  // bench breakdown, test build only (testing_hooks.h); 0 otherwise

  LaunchConfig lc;
  JAX_EP_RETURN_IF_ERROR(PlanLaunch("combine", kOpCombine, R, T, num_sms, chunk, a.row_bytes, 0,
                                    device, &lc));
  a.stage_off[0] = stage_offset(rt->region(kRegionNormal).bytes, kOpCombine, 0);
  a.stage_off[1] = stage_offset(rt->region(kRegionNormal).bytes, kOpCombine, 1);

  if (T == 0) return ffi::Error::Success();
  if (debug_poison()) JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out, 0xFF, out->size_bytes(), stream));
  JAX_EP_CUDA_RETURN(launch_combine(a, lc, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombine, jax_ep::CombineImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::AnyBuffer>()                  // y [C, W]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // row_weights [C] / [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // slot_row [R, T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // recv_local_idx [R, T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()     // send_mask [T, R]
                                  .Attr<xla::ffi::Span<const int32_t>>("ep_groups")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("rank_major")
                                  .Attr<int32_t>("weighted")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int32_t>("chunk")       // tokens per ring slot (0: default)
                                  .Attr<int64_t>("timeout_ns")  // peer wait bound (ffi_common.h)
                                  .Ret<xla::ffi::AnyBuffer>());                // out [T, W]
