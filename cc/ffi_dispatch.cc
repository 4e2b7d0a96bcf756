// XLA FFI targets of the intranode (normal) dispatch:
//   "jax_ep_dispatch"        rows of x (+ optional scale rows) -> out rows
//   "jax_ep_combine_bwd"     backward of expert_major combine: d_out rows are
//                            dispatched and, on the expert side, turned into
//                            dy = w * g and dw = <g, y> (kDispatchCombineBwd)
// All enqueue on XLA's stream and never synchronise the host.
#include <string>

#include "ffi_common.h"
#include "kernels/intranode.h"

namespace jax_ep {

namespace {

// Checks the handle arrays (slot_row [R, T, K], row_src [C], send_mask [T, R]),
// picks the grid and fits the staging rings (*lc); fills the fields of `a`
// every dispatch-kernel call shares. `a->row_bytes` / `s_row_bytes` must be set.
ffi::Error SetupDispatch(const char* op, int R, int T, int C, ffi::Buffer<ffi::S32> row_src,
                         ffi::Buffer<ffi::S32> slot_row, ffi::Buffer<ffi::PRED> send_mask,
                         int32_t align, int32_t zero_tail, int32_t num_sms, int32_t chunk,
                         int32_t debug_skip, int32_t device, DispatchArgs* a, LaunchConfig* lc) {
  const std::string o(op);
  auto sd = slot_row.dimensions();
  if (sd.size() != 3 || sd[0] != R || sd[1] != T)
    return InvalidArgument(o + ": slot_row must be [R, T, K] with R = EP group size");
  const int K = static_cast<int>(sd[2]);
  if (K > 32) return InvalidArgument(o + ": top-k above 32 is not supported natively");
  if (row_src.element_count() != static_cast<size_t>(C))
    return InvalidArgument(o + ": row_src must be [C]");
  if (send_mask.element_count() != static_cast<size_t>(T) * R)
    return InvalidArgument(o + ": send_mask must be [T, R]");
  if (align < 1) return InvalidArgument(o + ": align must be >= 1");
  if (chunk < 0) return InvalidArgument(o + ": chunk must be >= 0 (0: the kernel default)");
  if (debug_skip < 0 || debug_skip > 3) return InvalidArgument(o + ": debug_skip must be in [0, 3]");
  Runtime* rt = runtime();
  JAX_EP_RETURN_IF_ERROR(PlanLaunch(o, kOpDispatch, R, T, num_sms, chunk, a->row_bytes,
                                    a->s_row_bytes, device, lc));
  size_t scales_off = 0;
  ring_bytes(R, lc->num_blocks, lc->depth, lc->chunk, a->row_bytes, a->s_row_bytes, &scales_off);
  a->ctrl_off = ctrl_offset(rt->sym_bytes, kOpDispatch);
  a->stage_off[0] = stage_offset(rt->sym_bytes, kOpDispatch, 0);
  a->stage_off[1] = stage_offset(rt->sym_bytes, kOpDispatch, 1);
  a->stage_scales_off = scales_off;
  a->row_src = row_src.typed_data();
  a->slot_row = slot_row.typed_data();
  a->send_mask = send_mask.typed_data();
  a->T = T;
  a->K = K;
  a->C = C;
  a->align = align;
  a->zero_tail = zero_tail != 0;
  a->host_err = device_error_word();
  a->skip = debug_skip;  // bench breakdown only (DispatchArgs::skip); 0 in production
  return ffi::Error::Success();
}

ffi::Error DispatchImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scales,
                        ffi::Buffer<ffi::S32> row_src, ffi::Buffer<ffi::S32> slot_row,
                        ffi::Buffer<ffi::PRED> send_mask, ffi::Span<const int32_t> ep_groups,
                        int32_t num_ranks, int32_t mode, int32_t rank_major, int32_t align,
                        int32_t zero_tail, int32_t num_sms, int32_t chunk, int32_t fp8_scale_mode,
                        int32_t debug_skip, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::Buffer<ffi::F32>> out_scales) {
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  PeerTable peers;
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &peers));
  const int R = peers.num_ranks;

  auto xd = x.dimensions();
  if (xd.size() != 2) return InvalidArgument("dispatch: x must be [T, W]");
  const int T = static_cast<int>(xd[0]);
  const long long W = xd[1];
  auto od = out->dimensions();
  if (od.size() != 2 || od[1] != W) return InvalidArgument("dispatch: out must be [C, W]");
  const int C = static_cast<int>(od[0]);
  if (mode != kDispatchCopy && mode != kDispatchCastBf16 && mode != kDispatchCastF32)
    return InvalidArgument("dispatch: unknown mode");

  DispatchArgs a;
  LaunchConfig lc;
  a.peers = peers;
  a.x = x.untyped_data();
  a.x_row_bytes = static_cast<long long>(x.size_bytes() / (T > 0 ? T : 1));
  a.row_bytes = static_cast<long long>(out->size_bytes() / (C > 0 ? C : 1));
  a.out = out->untyped_data();
  a.hidden = static_cast<int>(W);
  a.mode = mode;
  a.rank_major = rank_major != 0;
  // XLA:GPU's rounding of 448/amax (the default), IEEE division, or UE8M0 scales.
  if (fp8_scale_mode != kFp8ScaleIeee && fp8_scale_mode != kFp8ScaleXlaGpu &&
      fp8_scale_mode != kFp8ScaleUe8m0)
    return InvalidArgument("dispatch: fp8_scale_mode must be an Fp8ScaleMode (jax_ep/abi.py)");
  a.scale_mode = fp8_scale_mode;

  const size_t so_rows = out_scales->element_count();
  a.s_row_bytes = C > 0 ? static_cast<long long>(so_rows / C) * 4 : 0;
  a.out_scales = out_scales->untyped_data();
  if (mode == kDispatchCopy) {
    if (a.x_row_bytes != a.row_bytes) return InvalidArgument("dispatch: x and out row sizes differ");
    if (a.s_row_bytes) {
      if (scales.element_count() != static_cast<size_t>(T) * (a.s_row_bytes / 4))
        return InvalidArgument("dispatch: scales must be [T, S] matching out_scales [C, S]");
      a.scales = scales.typed_data();
    }
  } else {
    if (W % 128 != 0) return InvalidArgument("dispatch: fp8 cast needs hidden % 128 == 0");
    if (out->element_type() != ffi::DataType::F8E4M3FN)
      return InvalidArgument("dispatch: fp8 cast output must be float8_e4m3fn");
    const ffi::DataType want = mode == kDispatchCastBf16 ? ffi::DataType::BF16 : ffi::DataType::F32;
    if (x.element_type() != want) return InvalidArgument("dispatch: x dtype does not match the cast mode");
    if (a.s_row_bytes != (W / 128) * 4) return InvalidArgument("dispatch: out_scales must be [C, H/128]");
  }
  JAX_EP_RETURN_IF_ERROR(
      SetupDispatch("dispatch", R, T, C, row_src, slot_row, send_mask, align, zero_tail, num_sms,
                    chunk, debug_skip, device, &a, &lc));

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
                          int32_t zero_tail, int32_t num_sms, int32_t chunk, int32_t debug_skip,
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
  switch (y.element_type()) {
    case ffi::DataType::BF16: a.dtype = kBf16; break;
    case ffi::DataType::F16: a.dtype = kF16; break;
    case ffi::DataType::F32: a.dtype = kF32; break;
    default: return InvalidArgument("combine_bwd: y must be bf16, f16 or f32");
  }
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
                    num_sms, chunk, debug_skip, device, &a, &lc));

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
                                  .Attr<int32_t>("debug_skip")    // bench breakdown only (0)
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
                                  .Attr<int32_t>("debug_skip")  // bench breakdown only (0)
                                  .Ret<xla::ffi::AnyBuffer>()                      // dy [C, W]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());        // dw [C]
