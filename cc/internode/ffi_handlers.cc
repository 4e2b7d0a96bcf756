// XLA FFI targets of the internode (hierarchical) kernels, docs/internode.md:
//   "jax_ep_internode_dispatch"  the inputs, outputs and modes of
//                                "jax_ep_dispatch" (copy with or without
//                                scales, the fp8 casts), plus `nodes`
//   "jax_ep_internode_combine"   those of "jax_ep_combine", plus `nodes`
// The EP group is `nodes` consecutive blocks of R / nodes ranks. Both run in
// the runtime's internode region (its RegionKind kRegionInternode; sized by
// jax_ep.initialize(config=...) for configs with num_nodes > 1), laid out
// with the region's fixed T (its window: at most EpConfig.internode_bytes) so
// calls of any T share it; a call of more tokens runs as windows of it
// (launch_inter_dispatch / _combine). There is no
// fused combine backward here: jax_ep/internode/native.py does it as this dispatch plus
// XLA. All enqueue on XLA's stream and never synchronise the host.
//
// Transport: the int32 attribute net_transport (NetTransport, EpConfig.
// net_transport) decides how the network leg reaches each network peer (the
// ranks of this rank's local index, one per node): "p2p" stores (each must be
// mapped), "put" NVSHMEM puts to all of them (this rank too: a put to the own
// PE is valid, which tests the path on emulated nodes), "auto" puts exactly
// where nvshmem_ptr gave no mapping (a PE on another host). The NVLink leg
// (the ranks of this node) is P2P stores in every mode.
#include <algorithm>
#include <string>

#include "common/ffi_common.h"
#include "common/launch.h"
#include "internode/kernels.h"
#include "intranode/ffi_args.h"

namespace jax_ep {

namespace {

// Bit r set: rank r's network leg goes by puts, under transport (see the
// top). Ranks outside this rank's node and local index are never touched by
// the kernels, mapped or not; an unmapped rank of this node is an error.
ffi::Error NetPutMask(const std::string& op, int32_t transport, const PeerTable& p, int nodes,
                      unsigned int* mask) {
  *mask = 0;
  if (transport < kNetTransportAuto || transport > kNetTransportPut)
    return InvalidArgument(op + ": net_transport must be a NetTransport (0 auto, 1 p2p, 2 put), "
                           "got " + std::to_string(transport));
  if (transport == kNetTransportPut && runtime()->transport != Transport::kNvshmem)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_ep: " + op + ", net_transport='put' needs the NVSHMEM transport (the "
                      "peer-memory transport has no PEs to put to); use 'auto' or 'p2p'");
  const int G = p.num_ranks / nodes, my_node = p.rank / G, my_g = p.rank % G;
  for (int r = 0; r < p.num_ranks; ++r) {
    const bool mapped = p.peers[r] != nullptr;
    if (r / G == my_node && !mapped)  // NVLink leg
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "jax_ep: " + op + ": rank " + std::to_string(r) + " is in this rank's "
                        "node (nodes of " + std::to_string(G) + " ranks) but not mapped into "
                        "this process (NVSHMEM gave no P2P pointer); the NVLink leg needs P2P: "
                        "check EpConfig.num_nodes against the hosts");
    if (r % G != my_g) continue;  // not a network peer
    if (transport == kNetTransportPut || (transport == kNetTransportAuto && !mapped))
      *mask |= 1u << r;
    else if (!mapped)
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "jax_ep: " + op + ", net_transport='p2p': network peer rank " +
                            std::to_string(r) + " is not mapped into this process (NVSHMEM gave "
                            "no P2P pointer: a PE across a network); use 'auto' or 'put'");
  }
  if (*mask && runtime()->transport != Transport::kNvshmem)  // "auto", an unmapped GPU
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_ep: " + op + ": a network peer is not reachable by CUDA P2P and the "
                      "peer-memory transport has no PEs to put to");
  return ffi::Error::Success();
}

// The caller's view of the internode region: `peers` rebased to the region's
// first byte on every mapped rank (the kernels address it from 0; unmapped
// ranks stay null: reached by puts, which name this rank's own address), its size and
// layout T (the window); a clear error when there is none or it cannot hold
// a window of this call (per call parity, the op's data areas: dispatch rows
// of row_bytes + scale rows of s_row_bytes, or combine rows of row_bytes).
ffi::Error InterRegion(const std::string& op, bool combine, long long row_bytes,
                       long long s_row_bytes, PeerTable* peers, int nodes, size_t* sym_bytes,
                       int* layout_T) {
  const Runtime* rt = runtime();
  const int R = peers->num_ranks;
  if (nodes < 2 || R % nodes != 0)
    return InvalidArgument(op + ": nodes (" + std::to_string(nodes) +
                           ") must be >= 2 and divide the EP group size (" + std::to_string(R) +
                           ")");
  const BufferRegion& region = rt->region(kRegionInternode);
  if (region.bytes == 0)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_ep: " + op + ": the runtime has no internode region: pass the "
                      "EpConfig with num_nodes > 1 to jax_ep.initialize(config=...)");
  const InterShape s = InterShape::of(region.shape);
  const int G = R / nodes;
  const InterLayout lay = inter_layout(region.bytes, nodes, G, s.T, s.T);
  const size_t want = combine ? inter_combine_areas(0, nodes, G, s.T, row_bytes).end
                              : inter_dispatch_areas(0, nodes, G, s.T, row_bytes, s_row_bytes).end;
  const size_t have = lay.op_bytes / 2;
  if (want > have)
    return InvalidArgument(op + ": " + std::to_string(nodes) + " nodes x " + std::to_string(G) +
                           " ranks need " + std::to_string(want) + " bytes per call parity, the "
                           "internode region (" + std::to_string(region.bytes) +
                           " bytes, sized for " + std::to_string(s.nodes) + " nodes, " +
                           std::to_string(s.ranks) + " ranks, T " + std::to_string(s.T) +
                           " (window), hidden " + std::to_string(s.hidden) + ") has " +
                           std::to_string(have) + ": pass this config to jax_ep.initialize");
  for (int r = 0; r < R; ++r)
    if (peers->peers[r]) peers->peers[r] = static_cast<char*>(peers->peers[r]) + region.off;
  *sym_bytes = region.bytes;
  *layout_T = s.T;
  return ffi::Error::Success();
}

// Blocks of the grid: the SM budget (num_sms, 0: every SM) capped by the
// device, as the intranode kernels (one resident 512-thread block per SM).
int InterBlocks(int num_sms, int32_t device) {
  return std::max(1, std::min(sm_budget(num_sms, runtime()->sms_of(device)), kMaxBlocks));
}

ffi::Error InterDispatchImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                             ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> row_src,
                             ffi::Buffer<ffi::S32> slot_row, ffi::Buffer<ffi::PRED> send_mask,
                             ffi::Span<const int32_t> ep_groups, int32_t num_ranks, int32_t nodes,
                             int32_t net_transport, int32_t mode, int32_t rank_major, int32_t align, int32_t zero_tail,
                             int32_t num_sms, int32_t chunk, int32_t fp8_scale_mode,
                             int64_t timeout_ns, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::F32>> out_scales) {
  const std::string o = "internode dispatch";
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  InterDispatchArgs ia;
  DispatchArgs& a = ia.a;
  // unmapped members kept (null peers[]): NetPutMask says which may be
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &a.peers, true));
  const int R = a.peers.num_ranks;

  JAX_EP_RETURN_IF_ERROR(DispatchRowArgs(o, x, scales, *out, *out_scales, mode, rank_major,
                                         fp8_scale_mode, &a));
  const int T = static_cast<int>(x.dimensions()[0]);
  const int C = static_cast<int>(out->dimensions()[0]);
  JAX_EP_RETURN_IF_ERROR(DispatchHandleArgs(o, R, T, C, row_src, slot_row, send_mask, align,
                                            zero_tail, chunk, timeout_ns, &a));
  ia.nodes = nodes;
  if (T == 0) {  // every rank has T = 0 (one shape): no kernel anywhere; rows have no source
    if (out->size_bytes()) JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out, 0, out->size_bytes(), stream));
    if (out_scales->size_bytes())
      JAX_EP_CUDA_RETURN(cudaMemsetAsync(a.out_scales, 0, out_scales->size_bytes(), stream));
    return ffi::Error::Success();
  }
  JAX_EP_RETURN_IF_ERROR(InterRegion(o, false, a.row_bytes, a.s_row_bytes, &a.peers, nodes,
                                     &ia.sym_bytes, &ia.layout_T));
  JAX_EP_RETURN_IF_ERROR(NetPutMask(o, net_transport, a.peers, nodes, &ia.put_mask));
  if (const char* e = inter_dispatch_check(ia); *e) return InvalidArgument(e);
  const InterLaunch lc = make_inter_launch(T, ia.layout_T, InterBlocks(num_sms, device), chunk);
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
                            int32_t net_transport, int32_t rank_major, int32_t weighted, int32_t num_sms, int32_t chunk,
                            int64_t timeout_ns, ffi::Result<ffi::AnyBuffer> out) {
  const std::string o = "internode combine";
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  InterCombineArgs ia;
  CombineArgs& a = ia.a;
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &a.peers, true));
  const int R = a.peers.num_ranks;

  JAX_EP_RETURN_IF_ERROR(CombineArgsOf(o, R, y, row_weights, slot_row, recv_local_idx,
                                       send_mask, *out, rank_major, weighted, chunk, timeout_ns,
                                       &a));
  const int T = a.T;
  ia.nodes = nodes;
  if (T == 0) return ffi::Error::Success();
  JAX_EP_RETURN_IF_ERROR(InterRegion(o, true, a.row_bytes, 0, &a.peers, nodes, &ia.sym_bytes,
                                     &ia.layout_T));
  JAX_EP_RETURN_IF_ERROR(NetPutMask(o, net_transport, a.peers, nodes, &ia.put_mask));
  if (const char* e = inter_combine_check(ia); *e) return InvalidArgument(e);
  const InterLaunch lc = make_inter_launch(T, ia.layout_T, InterBlocks(num_sms, device), chunk);
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
                                  .Attr<int32_t>("net_transport")  // NetTransport
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("rank_major")
                                  .Attr<int32_t>("align")
                                  .Attr<int32_t>("zero_tail")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int32_t>("chunk")      // tokens per flag (0: default)
                                  .Attr<int32_t>("fp8_scale_mode")
                                  .Attr<int64_t>("timeout_ns")  // peer wait bound (ffi_common.h)
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
                                  .Attr<int32_t>("net_transport")  // NetTransport
                                  .Attr<int32_t>("rank_major")
                                  .Attr<int32_t>("weighted")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int32_t>("chunk")
                                  .Attr<int64_t>("timeout_ns")  // peer wait bound (ffi_common.h)
                                  .Ret<xla::ffi::AnyBuffer>());                // out [T, W]
