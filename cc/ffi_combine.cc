// XLA FFI target "jax_ep_combine": expert-side partial sums go back to their
// source ranks and are reduced there (see cc/kernels/intranode_combine.cu).
#include <string>

#include "ffi_common.h"
#include "kernels/intranode.h"

namespace jax_ep {


namespace {

ffi::Error CombineImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y,
                       ffi::Buffer<ffi::F32> row_weights,
                       ffi::Buffer<ffi::S32> slot_row, ffi::Buffer<ffi::S32> recv_local_idx,
                       ffi::Buffer<ffi::PRED> send_mask, ffi::Span<const int32_t> ep_groups,
                       int32_t num_ranks, int32_t rank_major, int32_t weighted, int32_t num_sms,
                       int32_t chunk, int32_t debug_skip, ffi::Result<ffi::AnyBuffer> out) {
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  PeerTable peers;
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &peers));
  Runtime* rt = runtime();
  const int R = peers.num_ranks;

  auto yd = y.dimensions();
  auto od = out->dimensions();
  if (yd.size() != 2 || od.size() != 2 || yd[1] != od[1])
    return InvalidArgument("combine: y must be [C, W] and out [T, W]");
  if (y.element_type() != out->element_type())
    return InvalidArgument("combine: out dtype must equal y dtype");
  const int C = static_cast<int>(yd[0]);
  const int T = static_cast<int>(od[0]);
  auto sd = slot_row.dimensions();
  if (sd.size() != 3 || sd[0] != R || sd[1] != T)
    return InvalidArgument("combine: slot_row must be [R, T, K] with R = EP group size");
  const int K = static_cast<int>(sd[2]);
  if (K > 32) return InvalidArgument("combine: top-k above 32 is not supported natively");
  if (recv_local_idx.element_count() != slot_row.element_count())
    return InvalidArgument("combine: recv_local_idx must be [R, T, K]");
  if (send_mask.element_count() != static_cast<size_t>(T) * R)
    return InvalidArgument("combine: send_mask must be [T, R]");
  if (weighted && row_weights.element_count() != static_cast<size_t>(C))
    return InvalidArgument("combine: row_weights must be [C]");
  if (chunk < 0) return InvalidArgument("combine: chunk must be >= 0 (0: the kernel default)");
  if (debug_skip < 0 || debug_skip > 3) return InvalidArgument("combine: debug_skip must be in [0, 3]");

  CombineArgs a;
  switch (y.element_type()) {
    case ffi::DataType::BF16: a.dtype = kBf16; break;
    case ffi::DataType::F16: a.dtype = kF16; break;
    case ffi::DataType::F32: a.dtype = kF32; break;
    default: return InvalidArgument("combine: y must be bf16, f16 or f32");
  }
  a.peers = peers;
  a.ctrl_off = ctrl_offset(rt->sym_bytes, kOpCombine);
  a.y = y.untyped_data();
  a.W = static_cast<int>(yd[1]);
  a.row_bytes = static_cast<long long>(yd[1]) * static_cast<long long>(ffi::ByteWidth(y.element_type()));
  a.row_weights = weighted ? row_weights.typed_data() : nullptr;
  a.slot_row = slot_row.typed_data();
  a.recv_local_idx = recv_local_idx.typed_data();
  a.send_mask = send_mask.typed_data();
  a.out = out->untyped_data();
  a.T = T;
  a.K = K;
  a.C = C;
  a.rank_major = rank_major != 0;
  a.host_err = device_error_word();
  a.skip = debug_skip;  // bench breakdown only (DispatchArgs::skip); 0 in production

  LaunchConfig lc;
  JAX_EP_RETURN_IF_ERROR(PlanLaunch("combine", kOpCombine, R, T, num_sms, chunk, a.row_bytes, 0,
                                    device, &lc));
  a.stage_off[0] = stage_offset(rt->sym_bytes, kOpCombine, 0);
  a.stage_off[1] = stage_offset(rt->sym_bytes, kOpCombine, 1);

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
                                  .Attr<int32_t>("debug_skip")  // bench breakdown only (0)
                                  .Ret<xla::ffi::AnyBuffer>());                // out [T, W]
