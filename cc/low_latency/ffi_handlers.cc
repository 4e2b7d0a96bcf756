// XLA FFI targets of the low-latency (decode) mode: each op is a send half and
// a receive half (low_latency/kernels.cu), two custom calls linked by a
// token (the send's output, the receive's input), so XLA can run independent
// work between them while no SM waits on the transfer (the "hook").
// A send also takes any number of `after` operands (the previous receive's
// outputs) that no kernel reads: a real buffer read, so a command buffer that
// XLA turns into a graph ordered by buffer uses still runs the send after that
// receive (an optimization barrier leaves no buffer use, and the two-parity
// rule, low_latency/kernels.cu, needs the order).
//
// The region: the runtime's low-latency region (jax_ep.initialize(low_latency=
// config)), laid out once for its shape (low_latency/region_layout.h, ll_region_layout);
// a call must have that shape's E, K, H and at most its Tmax tokens.
//
// Transport: the int32 attribute ll_transport (LlTransport, EpConfig.
// ll_transport) decides per rank of the group whether the kernels reach it by
// P2P stores or by NVSHMEM puts (put_mask, low_latency/kernels.h): "p2p" every
// rank by stores (each must be mapped), "put" every rank by puts (this one
// too: a put to the own PE is valid, which tests the path on one GPU),
// "auto" puts exactly where nvshmem_ptr gave no mapping (a PE across a
// network). The receive handlers take it too: their kernels add NVSHMEM's
// consistency step when some rank reaches them by puts.
//
// Peer timeout: the receive handlers take the int64 attribute timeout_ns
// (common/ffi_common.h PeerTimeoutNs), how long their kernels wait for a
// rank's signal. The send kernels never wait, so the sends take none.
//
// Command buffers: these handlers keep no host state and enqueue only on
// XLA's stream (epochs live in the region), so they are registered as
// command-buffer compatible. Inside a captured graph the host-side checks
// (the previous kernel's timeout word) run at capture only: a timeout then
// surfaces at the next call made outside a graph.
#include <string>

#include "common/ffi_common.h"
#include "common/graph_capture.h"
#include "common/launch.h"
#include "low_latency/kernels.h"

namespace jax_ep {

namespace {

constexpr int kLlWarps = 16;  // warps per block (a row or a column slice of one per warp)

bool SameDims(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// The region's layout for this call's group, after checking the call's shape
// against the region's.
ffi::Error LlLayoutFor(const char* op, const PeerTable& peers, int E, int K, int hidden, int T,
                       long long row_bytes, long long s_row_bytes, long long comb_row_bytes,
                       LlLayout* lay) {
  const Runtime* rt = runtime();
  const BufferRegion& region = rt->region(kRegionLowLatency);
  const LlShape s = ll_region_shape(*rt);
  if (s.E == 0 || region.bytes == 0)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string("jax_ep: ") + op +
                          ": no low-latency region: call jax_ep.initialize(low_latency=config) "
                          "with the decode EpConfig");
  if (E != s.E || K != s.K || hidden != s.hidden || T > s.Tmax)
    return InvalidArgument(std::string(op) + ": the low-latency region was laid out for E=" +
                           std::to_string(s.E) + ", K=" + std::to_string(s.K) + ", H=" +
                           std::to_string(s.hidden) + ", T <= " + std::to_string(s.Tmax) +
                           "; this call has E=" + std::to_string(E) + ", K=" + std::to_string(K) +
                           ", H=" + std::to_string(hidden) + ", T=" + std::to_string(T));
  if (E % peers.num_ranks != 0) return InvalidArgument(std::string(op) + ": E % R != 0");
  if (static_cast<long long>(E) > kLlMaxBlocksLR)
    return InvalidArgument(std::string(op) + ": more than " + std::to_string(kLlMaxBlocksLR) +
                           " experts");
  if (K < 1 || K > kLlMaxTopk)
    return InvalidArgument(std::string(op) + ": top-k must be in [1, " +
                           std::to_string(kLlMaxTopk) + "]");
  *lay = ll_region_layout(region.off, peers.num_ranks, s, row_bytes, s_row_bytes, comb_row_bytes);
  if (const char* e = ll_rows_error(*lay); *e) return InvalidArgument(std::string(op) + ": " + e);
  return ffi::Error::Success();
}

// An expert-major buffer [L, R*Tmax, H] (`what`: "<op>: <name>") of the
// region's Tmax: checked, its L and H.
ffi::Error ExpertRows(const char* what, ffi::Span<const int64_t> d, int R, int* L, int* H) {
  if (d.size() != 3) return InvalidArgument(std::string(what) + " must be [L, R*Tmax, H]");
  *L = static_cast<int>(d[0]);
  *H = static_cast<int>(d[2]);
  if (d[1] != static_cast<int64_t>(R) * ll_region_shape(*runtime()).Tmax)
    return InvalidArgument(std::string(what) + " must be [L, R*Tmax, H] with the region's Tmax");
  return ffi::Error::Success();
}

// What every low-latency handler does first: surface an earlier kernel error,
// count a graph capture, find the caller's EP group, how to reach each rank
// (put_mask) and pick the grid (the SM budget num_sms, 0: every SM, capped by
// the device).
ffi::Error LlBegin(cudaStream_t stream, int32_t device, ffi::Span<const int32_t> ep_groups,
                   int32_t num_ranks, int32_t transport, int32_t num_sms, PeerTable* peers,
                   unsigned int* put_mask, LlGrid* g) {
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  note_graph_capture(stream);
  // unmapped members are kept (null peers[]) unless every rank must be by P2P
  JAX_EP_RETURN_IF_ERROR(
      GetPeerTable(ep_groups, num_ranks, device, peers, transport != kLlTransportP2p));
  JAX_EP_RETURN_IF_ERROR(TransportPutMask("low-latency", "ll_transport", transport, *peers,
                                          put_mask));
  if (num_sms < 0) return InvalidArgument("low-latency: num_sms must be >= 0 (0: every SM)");
  g->num_blocks = sm_budget(num_sms, runtime()->sms_of(device));
  g->warps = kLlWarps;
  return ffi::Error::Success();
}

ffi::Error LlDispatchSendImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::S32> slot,
                              ffi::Buffer<ffi::S32> expert_count, ffi::RemainingArgs after,
                              ffi::Span<const int32_t> ep_groups, int32_t num_ranks, int32_t mode,
                              int32_t fp8_scale_mode, int32_t ll_transport, int32_t num_sms,
                              ffi::Result<ffi::Buffer<ffi::U32>> token) {
  (void)token;  // carries no data: it orders the receive after this send
  (void)after;  // read by no kernel: XLA orders this send after their producers
  PeerTable peers;
  LlGrid g;
  LlDispatchSendArgs a;
  JAX_EP_RETURN_IF_ERROR(LlBegin(stream, device, ep_groups, num_ranks, ll_transport, num_sms,
                                 &peers, &a.put_mask, &g));
  auto xd = x.dimensions();
  auto id = topk_idx.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0])
    return InvalidArgument("low_latency_dispatch: x must be [T, H] and topk_idx [T, K]");
  if (!SameDims(slot.dimensions(), id)) return InvalidArgument("low_latency_dispatch: slot must be [T, K]");
  const int T = static_cast<int>(xd[0]), K = static_cast<int>(id[1]);
  const int H = static_cast<int>(xd[1]);
  const int E = static_cast<int>(expert_count.element_count());
  const bool cast = mode == kDispatchCastBf16 || mode == kDispatchCastF32;
  if (cast) {
    const ffi::DataType want = mode == kDispatchCastBf16 ? ffi::DataType::BF16 : ffi::DataType::F32;
    if (x.element_type() != want)
      return InvalidArgument("low_latency_dispatch: x dtype does not match the cast mode");
    if (H % 128) return InvalidArgument("low_latency_dispatch: fp8 needs H % 128 == 0");
    if (!IsFp8ScaleMode(fp8_scale_mode))
      return InvalidArgument("low_latency_dispatch: fp8_scale_mode must be an Fp8ScaleMode");
  } else if (mode != kDispatchCopy) {
    return InvalidArgument("low_latency_dispatch: unknown mode");
  }
  const long long x_row = static_cast<long long>(ffi::ByteWidth(x.element_type())) * H;
  const long long row_bytes = cast ? H : x_row;
  const long long s_row_bytes = cast ? (H / 128) * 4 : 0;
  JAX_EP_RETURN_IF_ERROR(LlLayoutFor("low_latency_dispatch", peers, E, K, H, T, row_bytes,
                                     s_row_bytes, 0, &a.lay));
  a.peers = peers;
  a.x = x.untyped_data();
  a.x_row_bytes = x_row;
  a.topk_idx = topk_idx.typed_data();
  a.slot = slot.typed_data();
  a.expert_count = expert_count.typed_data();
  a.T = T;
  a.hidden = H;
  a.mode = mode;
  a.scale_mode = fp8_scale_mode;
  a.host_err = device_error_word(ErrorOp::kLowLatencyDispatch);
  // T == 0 still runs: its count words (all 0) are what the receivers wait for.
  JAX_EP_CUDA_RETURN(launch_ll_dispatch_send(a, g, stream));
  return ffi::Error::Success();
}

ffi::Error LlDispatchRecvImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::U32> token,
                              ffi::Span<const int32_t> ep_groups, int32_t num_ranks, int32_t topk,
                              int32_t ll_transport, int32_t num_sms, int64_t timeout_ns,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::Buffer<ffi::F32>> out_scales,
                              ffi::Result<ffi::Buffer<ffi::S32>> out_info,
                              ffi::Result<ffi::Buffer<ffi::S32>> src_count,
                              ffi::Result<ffi::Buffer<ffi::S32>> count) {
  (void)token;
  PeerTable peers;
  LlGrid g;
  LlDispatchRecvArgs a;
  JAX_EP_RETURN_IF_ERROR(LlBegin(stream, device, ep_groups, num_ranks, ll_transport, num_sms,
                                 &peers, &a.put_mask, &g));
  JAX_EP_RETURN_IF_ERROR(PeerTimeoutNs("low_latency_dispatch", timeout_ns, &a.timeout_ns));
  const int R = peers.num_ranks;
  auto od = out->dimensions();
  int L = 0, H = 0;
  JAX_EP_RETURN_IF_ERROR(ExpertRows("low_latency_dispatch: out", od, R, &L, &H));
  const long long row_bytes = static_cast<long long>(ffi::ByteWidth(out->element_type())) * H;
  const long long s_row_bytes =
      static_cast<long long>(out_scales->element_count() / (od[0] * od[1] > 0 ? od[0] * od[1] : 1)) * 4;
  if (src_count->element_count() != static_cast<size_t>(L) * R ||
      count->element_count() != static_cast<size_t>(L) ||
      out_info->element_count() != static_cast<size_t>(od[0] * od[1]))
    return InvalidArgument("low_latency_dispatch: bad output shapes");
  JAX_EP_RETURN_IF_ERROR(LlLayoutFor("low_latency_dispatch", peers, L * R, topk, H, 0, row_bytes,
                                     s_row_bytes, 0, &a.lay));
  a.peers = peers;
  a.out = out->untyped_data();
  a.out_scales = out_scales->untyped_data();
  a.out_info = out_info->typed_data();
  a.src_count = src_count->typed_data();
  a.count = count->typed_data();
  a.host_err = device_error_word(ErrorOp::kLowLatencyDispatch);
  if (debug_poison()) {
    JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out, 0xFF, out->size_bytes(), stream));
    JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out_scales, 0xFF, out_scales->size_bytes(), stream));
    JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out_info, 0xFF, out_info->size_bytes(), stream));
  }
  JAX_EP_CUDA_RETURN(launch_ll_dispatch_recv(a, g, stream));
  return ffi::Error::Success();
}

ffi::Error LlCombineSendImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y,
                             ffi::Buffer<ffi::S32> info, ffi::Buffer<ffi::S32> src_count,
                             ffi::RemainingArgs after, ffi::Span<const int32_t> ep_groups,
                             int32_t num_ranks, int32_t topk,
                             int32_t ll_transport, int32_t num_sms,
                             ffi::Result<ffi::Buffer<ffi::U32>> token) {
  (void)token;
  (void)after;
  PeerTable peers;
  LlGrid g;
  LlCombineSendArgs a;
  JAX_EP_RETURN_IF_ERROR(LlBegin(stream, device, ep_groups, num_ranks, ll_transport, num_sms,
                                 &peers, &a.put_mask, &g));
  const int R = peers.num_ranks;
  auto yd = y.dimensions();
  int L = 0, H = 0;
  JAX_EP_RETURN_IF_ERROR(ExpertRows("low_latency_combine: y", yd, R, &L, &H));
  if (info.element_count() != static_cast<size_t>(yd[0] * yd[1]) ||
      src_count.element_count() != static_cast<size_t>(L) * R)
    return InvalidArgument("low_latency_combine: info must be [L, R*Tmax] and src_count [L, R]");
  int dtype = 0;
  if (!RowDtypeOf(y.element_type(), &dtype))
    return InvalidArgument("low_latency_combine: y must be bf16, f16 or f32");
  const long long comb_row = static_cast<long long>(ffi::ByteWidth(y.element_type())) * H;
  JAX_EP_RETURN_IF_ERROR(LlLayoutFor("low_latency_combine", peers, L * R, topk, H, 0, 0, 0,
                                     comb_row, &a.lay));
  a.peers = peers;
  a.y = y.untyped_data();
  a.info = info.typed_data();
  a.src_count = src_count.typed_data();
  a.host_err = device_error_word(ErrorOp::kLowLatencyCombine);
  JAX_EP_CUDA_RETURN(launch_ll_combine_send(a, g, stream));
  return ffi::Error::Success();
}

ffi::Error LlCombineRecvImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::U32> token,
                             ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::F32> weights,
                             ffi::Span<const int32_t> ep_groups, int32_t num_ranks,
                             int32_t num_experts, int32_t ll_transport, int32_t num_sms,
                             int64_t timeout_ns, ffi::Result<ffi::AnyBuffer> out) {
  (void)token;
  PeerTable peers;
  LlGrid g;
  LlCombineRecvArgs a;
  JAX_EP_RETURN_IF_ERROR(LlBegin(stream, device, ep_groups, num_ranks, ll_transport, num_sms,
                                 &peers, &a.put_mask, &g));
  JAX_EP_RETURN_IF_ERROR(PeerTimeoutNs("low_latency_combine", timeout_ns, &a.timeout_ns));
  auto sd = slot.dimensions();
  auto od = out->dimensions();
  if (sd.size() != 2 || od.size() != 2 || od[0] != sd[0] || !SameDims(weights.dimensions(), sd))
    return InvalidArgument("low_latency_combine: slot / weights must be [T, K] and out [T, H]");
  const int T = static_cast<int>(sd[0]), K = static_cast<int>(sd[1]);
  const int H = static_cast<int>(od[1]);
  if (!RowDtypeOf(out->element_type(), &a.dtype))
    return InvalidArgument("low_latency_combine: out must be bf16, f16 or f32");
  const long long comb_row = static_cast<long long>(ffi::ByteWidth(out->element_type())) * H;
  JAX_EP_RETURN_IF_ERROR(LlLayoutFor("low_latency_combine", peers, num_experts, K, H, T, 0, 0,
                                     comb_row, &a.lay));
  a.peers = peers;
  a.T = T;
  a.slot = slot.typed_data();
  a.weights = weights.typed_data();
  a.out = out->untyped_data();
  a.host_err = device_error_word(ErrorOp::kLowLatencyCombine);
  if (debug_poison()) JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out, 0xFF, out->size_bytes(), stream));
  JAX_EP_CUDA_RETURN(launch_ll_combine_recv(a, g, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlDispatchSend, jax_ep::LlDispatchSendImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::AnyBuffer>()                  // x [T, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // topk_idx [T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // slot [T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // expert_count [E]
                                  .RemainingArgs()                             // `after` leaves
                                  .Attr<xla::ffi::Span<const int32_t>>("ep_groups")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("mode")            // DispatchMode
                                  .Attr<int32_t>("fp8_scale_mode")  // Fp8ScaleMode
                                  .Attr<int32_t>("ll_transport")    // LlTransport
                                  .Attr<int32_t>("num_sms")         // blocks (0: every SM)
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>());  // token [1]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlDispatchRecv, jax_ep::LlDispatchRecvImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // token [1]
                                  .Attr<xla::ffi::Span<const int32_t>>("ep_groups")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("topk")
                                  .Attr<int32_t>("ll_transport")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns")  // peer wait bound (ffi_common.h)
                                  .Ret<xla::ffi::AnyBuffer>()                // x [L, R*Tmax, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()    // scales [L, R*Tmax, H/128] / [.., 0]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()    // info [L, R*Tmax]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()    // src_count [L, R]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());  // count [L]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlCombineSend, jax_ep::LlCombineSendImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::AnyBuffer>()                // y [L, R*Tmax, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // info [L, R*Tmax]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // src_count [L, R]
                                  .RemainingArgs()                           // `after` leaves
                                  .Attr<xla::ffi::Span<const int32_t>>("ep_groups")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("topk")
                                  .Attr<int32_t>("ll_transport")
                                  .Attr<int32_t>("num_sms")
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>());  // token [1]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlCombineRecv, jax_ep::LlCombineRecvImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // token [1]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // slot [T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // merged weights [T, K]
                                  .Attr<xla::ffi::Span<const int32_t>>("ep_groups")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("num_experts")
                                  .Attr<int32_t>("ll_transport")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns")  // peer wait bound (ffi_common.h)
                                  .Ret<xla::ffi::AnyBuffer>());            // out [T, H]
