// XLA FFI targets of the internode (hierarchical) kernels, docs/internode.md:
//   "jax_ep_internode_dispatch"  the inputs, outputs and modes of
//                                "jax_ep_dispatch" (copy with or without
//                                scales, the fp8 casts), plus `nodes`
//   "jax_ep_internode_combine"   those of "jax_ep_combine", plus `nodes`
// The EP group is `nodes` consecutive blocks of R / nodes ranks. Both run in
// the runtime's internode region (Runtime::inter_off; sized by
// jax_ep.initialize(config=...) for configs with num_nodes > 1), laid out
// with the region's fixed T so calls of any T <= it share it. There is no
// fused combine backward here: jax_ep/native.py does it as this dispatch plus
// XLA. All enqueue on XLA's stream and never synchronise the host.
#include <algorithm>
#include <string>

#include "ffi_common.h"
#include "kernels/internode.h"

namespace jax_ep {

namespace {

// The caller's view of the internode region: `peers` rebased to the region's
// first byte on every rank (the kernels address it from 0), its size and
// layout T; a clear error when there is none or it cannot hold this call
// (per call parity, `need` bytes of op data).
ffi::Error InterRegion(const std::string& op, PeerTable* peers, int nodes, int T,
                       size_t (*need)(int N, int G, int LT, const void* ctx), const void* ctx,
                       size_t* sym_bytes, int* layout_T) {
  const Runtime* rt = runtime();
  const int R = peers->num_ranks;
  if (nodes < 2 || R % nodes != 0)
    return InvalidArgument(op + ": nodes (" + std::to_string(nodes) +
                           ") must be >= 2 and divide the EP group size (" + std::to_string(R) +
                           ")");
  if (rt->inter_bytes == 0)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_ep: " + op + ": the runtime has no internode region: pass the "
                      "EpConfig with num_nodes > 1 to jax_ep.initialize(config=...)");
  const InterShape& s = rt->inter_shape;
  if (T > s.T)
    return InvalidArgument(op + ": " + std::to_string(T) + " tokens per rank, but the internode "
                           "region was laid out for T <= " + std::to_string(s.T) +
                           " (max_tokens_per_rank of the configs given to jax_ep.initialize)");
  const int G = R / nodes;
  const InterLayout lay = inter_layout(rt->inter_bytes, nodes, G, T, s.T);
  const size_t want = need(nodes, G, s.T, ctx), have = lay.op_bytes / 2;
  if (want > have)
    return InvalidArgument(op + ": " + std::to_string(nodes) + " nodes x " + std::to_string(G) +
                           " ranks need " + std::to_string(want) + " bytes per call parity, the "
                           "internode region (" + std::to_string(rt->inter_bytes) +
                           " bytes, sized for " + std::to_string(s.nodes) + " nodes, " +
                           std::to_string(s.ranks) + " ranks, T " + std::to_string(s.T) +
                           ", hidden " + std::to_string(s.hidden) + ") has " +
                           std::to_string(have) + ": pass this config to jax_ep.initialize");
  for (int r = 0; r < R; ++r) peers->peers[r] = static_cast<char*>(peers->peers[r]) + rt->inter_off;
  *sym_bytes = rt->inter_bytes;
  *layout_T = s.T;
  return ffi::Error::Success();
}

// Blocks of the grid: the SM budget (num_sms, 0: every SM) capped by the
// device, as the intranode kernels (one resident 512-thread block per SM).
int InterBlocks(int num_sms, int32_t device) {
  const int dev = runtime()->sms_of(device);
  int sms = num_sms > 0 ? std::min(num_sms, dev) : dev;
  return std::max(1, std::min(sms, kMaxBlocks));
}

struct RowSizes {
  long long row, srow;
};
size_t DispatchNeed(int N, int G, int LT, const void* ctx) {
  const RowSizes* r = static_cast<const RowSizes*>(ctx);
  return inter_dispatch_areas(0, N, G, LT, r->row, r->srow).end;
}
size_t CombineNeed(int N, int G, int LT, const void* ctx) {
  return inter_combine_areas(0, N, G, LT, static_cast<const RowSizes*>(ctx)->row).end;
}

ffi::Error InterDispatchImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                             ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> row_src,
                             ffi::Buffer<ffi::S32> slot_row, ffi::Buffer<ffi::PRED> send_mask,
                             ffi::Span<const int32_t> ep_groups, int32_t num_ranks, int32_t nodes,
                             int32_t mode, int32_t rank_major, int32_t align, int32_t zero_tail,
                             int32_t num_sms, int32_t chunk, int32_t fp8_scale_mode,
                             ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::F32>> out_scales) {
  const std::string o = "internode dispatch";
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  InterDispatchArgs ia;
  DispatchArgs& a = ia.a;
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &a.peers));
  const int R = a.peers.num_ranks;

  auto xd = x.dimensions(), od = out->dimensions();
  if (xd.size() != 2) return InvalidArgument(o + ": x must be [T, W]");
  const int T = static_cast<int>(xd[0]);
  const long long W = xd[1];
  if (od.size() != 2 || od[1] != W) return InvalidArgument(o + ": out must be [C, W]");
  const int C = static_cast<int>(od[0]);
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
  if (mode != kDispatchCopy && mode != kDispatchCastBf16 && mode != kDispatchCastF32)
    return InvalidArgument(o + ": unknown mode");
  if (fp8_scale_mode != kFp8ScaleIeee && fp8_scale_mode != kFp8ScaleXlaGpu &&
      fp8_scale_mode != kFp8ScaleUe8m0)
    return InvalidArgument(o + ": fp8_scale_mode must be an Fp8ScaleMode (jax_ep/abi.py)");

  a.x = x.untyped_data();
  a.x_row_bytes = static_cast<long long>(x.size_bytes() / (T > 0 ? T : 1));
  a.row_bytes = static_cast<long long>(out->size_bytes() / (C > 0 ? C : 1));
  a.out = out->untyped_data();
  a.hidden = static_cast<int>(W);
  a.mode = mode;
  a.rank_major = rank_major != 0;
  a.scale_mode = fp8_scale_mode;
  a.s_row_bytes = C > 0 ? static_cast<long long>(out_scales->element_count() / C) * 4 : 0;
  a.out_scales = out_scales->untyped_data();
  if (mode == kDispatchCopy) {
    if (a.x_row_bytes != a.row_bytes) return InvalidArgument(o + ": x and out row sizes differ");
    if (a.s_row_bytes) {
      if (scales.element_count() != static_cast<size_t>(T) * (a.s_row_bytes / 4))
        return InvalidArgument(o + ": scales must be [T, S] matching out_scales [C, S]");
      a.scales = scales.typed_data();
    }
  } else {
    if (W % 128 != 0) return InvalidArgument(o + ": fp8 cast needs hidden % 128 == 0");
    if (out->element_type() != ffi::DataType::F8E4M3FN)
      return InvalidArgument(o + ": fp8 cast output must be float8_e4m3fn");
    const ffi::DataType want = mode == kDispatchCastBf16 ? ffi::DataType::BF16 : ffi::DataType::F32;
    if (x.element_type() != want) return InvalidArgument(o + ": x dtype does not match the cast mode");
    if (a.s_row_bytes != (W / 128) * 4) return InvalidArgument(o + ": out_scales must be [C, H/128]");
  }
  a.row_src = row_src.typed_data();
  a.slot_row = slot_row.typed_data();
  a.send_mask = send_mask.typed_data();
  a.T = T;
  a.K = K;
  a.C = C;
  a.align = align;
  a.zero_tail = zero_tail != 0;
  a.host_err = device_error_word();
  ia.nodes = nodes;
  if (T == 0) {  // every rank has T = 0 (one shape): no kernel anywhere; rows have no source
    if (out->size_bytes()) JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out, 0, out->size_bytes(), stream));
    if (out_scales->size_bytes())
      JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out_scales, 0, out_scales->size_bytes(), stream));
    return ffi::Error::Success();
  }
  const RowSizes rs{a.row_bytes, a.s_row_bytes};
  JAX_EP_RETURN_IF_ERROR(
      InterRegion(o, &a.peers, nodes, T, DispatchNeed, &rs, &ia.sym_bytes, &ia.layout_T));
  if (const char* e = inter_dispatch_check(ia); *e) return InvalidArgument(e);
  const InterLaunch lc = make_inter_launch(T, InterBlocks(num_sms, device), chunk);
  if (debug_poison()) {  // tests: a row the kernel forgets to write shows as NaN
    JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out, 0xFF, out->size_bytes(), stream));
    JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out_scales, 0xFF, out_scales->size_bytes(), stream));
  }
  JAX_EP_CUDA_RETURN(launch_inter_dispatch(ia, lc, stream));
  return ffi::Error::Success();
}

ffi::Error InterCombineImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y,
                            ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::S32> slot_row,
                            ffi::Buffer<ffi::S32> recv_local_idx, ffi::Buffer<ffi::PRED> send_mask,
                            ffi::Span<const int32_t> ep_groups, int32_t num_ranks, int32_t nodes,
                            int32_t rank_major, int32_t weighted, int32_t num_sms, int32_t chunk,
                            ffi::Result<ffi::AnyBuffer> out) {
  const std::string o = "internode combine";
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  InterCombineArgs ia;
  CombineArgs& a = ia.a;
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &a.peers));
  const int R = a.peers.num_ranks;

  auto yd = y.dimensions(), od = out->dimensions();
  if (yd.size() != 2 || od.size() != 2 || yd[1] != od[1])
    return InvalidArgument(o + ": y must be [C, W] and out [T, W]");
  if (y.element_type() != out->element_type())
    return InvalidArgument(o + ": out dtype must equal y dtype");
  const int C = static_cast<int>(yd[0]);
  const int T = static_cast<int>(od[0]);
  auto sd = slot_row.dimensions();
  if (sd.size() != 3 || sd[0] != R || sd[1] != T)
    return InvalidArgument(o + ": slot_row must be [R, T, K] with R = EP group size");
  const int K = static_cast<int>(sd[2]);
  if (K > 32) return InvalidArgument(o + ": top-k above 32 is not supported natively");
  if (recv_local_idx.element_count() != slot_row.element_count())
    return InvalidArgument(o + ": recv_local_idx must be [R, T, K]");
  if (send_mask.element_count() != static_cast<size_t>(T) * R)
    return InvalidArgument(o + ": send_mask must be [T, R]");
  if (weighted && row_weights.element_count() != static_cast<size_t>(C))
    return InvalidArgument(o + ": row_weights must be [C]");
  if (chunk < 0) return InvalidArgument(o + ": chunk must be >= 0 (0: the kernel default)");
  switch (y.element_type()) {
    case ffi::DataType::BF16: a.dtype = kBf16; break;
    case ffi::DataType::F16: a.dtype = kF16; break;
    case ffi::DataType::F32: a.dtype = kF32; break;
    default: return InvalidArgument(o + ": y must be bf16, f16 or f32");
  }
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
  ia.nodes = nodes;
  if (T == 0) return ffi::Error::Success();
  const RowSizes rs{a.row_bytes, 0};
  JAX_EP_RETURN_IF_ERROR(
      InterRegion(o, &a.peers, nodes, T, CombineNeed, &rs, &ia.sym_bytes, &ia.layout_T));
  if (const char* e = inter_combine_check(ia); *e) return InvalidArgument(e);
  const InterLaunch lc = make_inter_launch(T, InterBlocks(num_sms, device), chunk);
  if (debug_poison()) JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out, 0xFF, out->size_bytes(), stream));
  JAX_EP_CUDA_RETURN(launch_inter_combine(ia, lc, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpInternodeDispatch, jax_ep::InterDispatchImpl,
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
                                  .Attr<int32_t>("nodes")      // EpConfig.num_nodes (>= 2)
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("rank_major")
                                  .Attr<int32_t>("align")
                                  .Attr<int32_t>("zero_tail")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int32_t>("chunk")      // tokens per flag (0: default)
                                  .Attr<int32_t>("fp8_scale_mode")
                                  .Ret<xla::ffi::AnyBuffer>()                      // out [C, W]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());        // out_scales [C, S]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpInternodeCombine, jax_ep::InterCombineImpl,
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
                                  .Attr<int32_t>("nodes")
                                  .Attr<int32_t>("rank_major")
                                  .Attr<int32_t>("weighted")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int32_t>("chunk")
                                  .Ret<xla::ffi::AnyBuffer>());                // out [T, W]
