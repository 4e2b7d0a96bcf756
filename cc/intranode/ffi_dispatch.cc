// XLA FFI targets of the intranode (normal) dispatch:
//   "jax_ep_dispatch"        rows of x (+ optional scale rows) -> out rows
//   "jax_ep_combine_bwd"     backward of expert_major combine: d_out rows are
//                            dispatched and, on the expert side, turned into
//                            dy = w * g and dw = <g, y> (kDispatchCombineBwd)
// All enqueue on XLA's stream and never synchronise the host.
#include <string>

#include "common/ffi_common.h"
#include "intranode/ffi_args.h"
#include "intranode/ffi_launch.h"
#include "intranode/kernels.h"

namespace jax_ep {

namespace {

// Checks the handle arrays and the peer timeout (ffi_args.h), picks the grid
// and fits the staging rings (*lc); fills the fields of `a` every
// dispatch-kernel call shares. `a->row_bytes` / `s_row_bytes` must be set.
ffi::Error SetupDispatch(const char* op, int R, int T, int C, ffi::Buffer<ffi::S32> row_src,
                         ffi::Buffer<ffi::S32> slot_row, ffi::Buffer<ffi::PRED> send_mask,
                         int32_t align, int32_t zero_tail, int32_t num_sms, int32_t chunk,
                         int64_t timeout_ns, int32_t device, DispatchArgs* a, LaunchConfig* lc) {
  const std::string o(op);
  JAX_EP_RETURN_IF_ERROR(DispatchHandleArgs(o, R, T, C, row_src, slot_row, send_mask, align,
                                            zero_tail, chunk, timeout_ns, a));
  Runtime* rt = runtime();
  JAX_EP_RETURN_IF_ERROR(PlanLaunch(o, kOpDispatch, R, T, num_sms, chunk, a->row_bytes,
                                    a->s_row_bytes, device, lc));
  size_t scales_off = 0;
  ring_bytes(R, lc->num_blocks, lc->depth, lc->chunk, a->row_bytes, a->s_row_bytes, &scales_off);
  a->ctrl_off = ctrl_offset(rt->region(kRegionNormal).bytes, kOpDispatch);
  a->stage_off[0] = stage_offset(rt->region(kRegionNormal).bytes, kOpDispatch, 0);
  a->stage_off[1] = stage_offset(rt->region(kRegionNormal).bytes, kOpDispatch, 1);
  a->stage_scales_off = scales_off;
  a->skip = debug_skip();  // bench breakdown, test build only (testing_hooks.h); 0 otherwise
  return ffi::Error::Success();
}

ffi::Error DispatchImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scales,
                        ffi::Buffer<ffi::S32> row_src, ffi::Buffer<ffi::S32> slot_row,
                        ffi::Buffer<ffi::PRED> send_mask, ffi::Span<const int32_t> ep_groups,
                        int32_t num_ranks, int32_t mode, int32_t rank_major, int32_t align,
                        int32_t zero_tail, int32_t num_sms, int32_t chunk, int32_t fp8_scale_mode,
                        int64_t timeout_ns, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::Buffer<ffi::F32>> out_scales) {
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  PeerTable peers;
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &peers));
  const int R = peers.num_ranks;

  DispatchArgs a;
  LaunchConfig lc;
  a.peers = peers;
  JAX_EP_RETURN_IF_ERROR(DispatchRowArgs("dispatch", x, scales, *out, *out_scales, mode,
                                         rank_major, fp8_scale_mode, &a));
  const int T = static_cast<int>(x.dimensions()[0]);
  const int C = static_cast<int>(out->dimensions()[0]);
  JAX_EP_RETURN_IF_ERROR(
      SetupDispatch("dispatch", R, T, C, row_src, slot_row, send_mask, align, zero_tail, num_sms,
                    chunk, timeout_ns, device, &a, &lc));

  if (T == 0 && C == 0) return ffi::Error::Success();
  if (debug_poison()) {
    JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out, 0xFF, out->size_bytes(), stream));
    JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out_scales, 0xFF, out_scales->size_bytes(), stream));
  }
  JAX_EP_CUDA_RETURN(launch_dispatch(a, lc, stream));
  return ffi::Error::Success();
}

ffi::Error CombineBwdImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer g, ffi::AnyBuffer y,
                          ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> row_src,
                          ffi::Buffer<ffi::S32> slot_row, ffi::Buffer<ffi::PRED> send_mask,
                          ffi::Span<const int32_t> ep_groups, int32_t num_ranks, int32_t align,
                          int32_t zero_tail, int32_t num_sms, int32_t chunk, int64_t timeout_ns,
                          ffi::Result<ffi::AnyBuffer> dy,
                          ffi::Result<ffi::Buffer<ffi::F32>> dw) {
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  PeerTable peers;
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &peers));
  const int R = peers.num_ranks;

  auto gd = g.dimensions(), yd = y.dimensions(), od = dy->dimensions();
  if (gd.size() != 2 || yd.size() != 2 || od.size() != 2 || gd[1] != yd[1] || od[0] != yd[0] ||
      od[1] != yd[1])
    return InvalidArgument("combine_bwd: g must be [T, W], y and dy [C, W]");
  if (g.element_type() != y.element_type() || dy->element_type() != y.element_type())
    return InvalidArgument("combine_bwd: g, y and dy must have one dtype");
  const int T = static_cast<int>(gd[0]);
  const int C = static_cast<int>(yd[0]);
  if (w.element_count() != static_cast<size_t>(C) || dw->element_count() != static_cast<size_t>(C))
    return InvalidArgument("combine_bwd: w and dw must be [C]");

  DispatchArgs a;
  LaunchConfig lc;
  if (!RowDtypeOf(y.element_type(), &a.dtype))
    return InvalidArgument("combine_bwd: y must be bf16, f16 or f32");
  a.peers = peers;
  a.mode = kDispatchCombineBwd;
  a.x = g.untyped_data();
  a.row_bytes = a.x_row_bytes =
      static_cast<long long>(yd[1]) * static_cast<long long>(ffi::ByteWidth(y.element_type()));
  a.hidden = static_cast<int>(yd[1]);
  a.out = dy->untyped_data();
  a.y = y.untyped_data();
  a.row_w = w.typed_data();
  a.dw = dw->typed_data();
  JAX_EP_RETURN_IF_ERROR(
      SetupDispatch("combine_bwd", R, T, C, row_src, slot_row, send_mask, align, zero_tail,
                    num_sms, chunk, timeout_ns, device, &a, &lc));
  a.host_err = device_error_word(ErrorOp::kCombine);   // the combine's backward: named as combine

  if (T == 0 && C == 0) return ffi::Error::Success();
  if (debug_poison()) {
    JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out, 0xFF, dy->size_bytes(), stream));
    JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.dw, 0xFF, dw->size_bytes(), stream));
  }
  JAX_EP_CUDA_RETURN(launch_dispatch(a, lc, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

// Not marked command-buffer compatible (the default): safe either way, since
// epochs live on the device, but kept out of graphs until measured there.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatch, jax_ep::DispatchImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::AnyBuffer>()                      // x [T, W]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()          // scales [T, S]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // row_src [C]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // slot_row [R, T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()         // send_mask [T, R]
                                  .Attr<xla::ffi::Span<const int32_t>>("ep_groups")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("rank_major")
                                  .Attr<int32_t>("align")      // expert_alignment (1: rank_major)
                                  .Attr<int32_t>("zero_tail")  // zero rows past the last group
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int32_t>("chunk")         // tokens per ring slot (0: default)
                                  .Attr<int32_t>("fp8_scale_mode")  // Fp8ScaleMode
                                  .Attr<int64_t>("timeout_ns")  // peer wait bound (ffi_common.h)
                                  .Ret<xla::ffi::AnyBuffer>()                      // out [C, W]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());        // out_scales [C, S]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineBwd, jax_ep::CombineBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::AnyBuffer>()                      // g = d_out [T, W]
                                  .Arg<xla::ffi::AnyBuffer>()                      // y [C, W]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()          // w [C]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // row_src [C]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()          // slot_row [R, T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()         // send_mask [T, R]
                                  .Attr<xla::ffi::Span<const int32_t>>("ep_groups")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("align")
                                  .Attr<int32_t>("zero_tail")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int32_t>("chunk")       // tokens per ring slot (0: default)
                                  .Attr<int64_t>("timeout_ns")  // peer wait bound (ffi_common.h)
                                  .Ret<xla::ffi::AnyBuffer>()                      // dy [C, W]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());        // dw [C]
