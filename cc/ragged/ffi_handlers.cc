// XLA FFI target of jax_ep.ragged_all_to_all (jax_ep/ragged/native.py):
// jax_ep_ragged_all_to_all, one kernel (ragged/kernels.cu) on XLA's stream.
//
// Operands: operand [N, ...], output [M, ...] (aliased to the result: XLA
// hands the kernel output's buffer, or a copy of it, as the result), and the
// int32 [K] input_offsets, send_sizes, output_offsets, recv_sizes. Attributes:
// ep_groups / num_ranks (the EP group, jax_ep/_ffi.py), transport (an
// LlTransport code: how each rank is reached, common/ffi_common.h
// TransportPutMask), num_sms (blocks; 0: every SM) and timeout_ns (int64: how
// long the receive phase waits for a sender, common/ffi_common.h PeerTimeoutNs).
//
// The region: the runtime's ragged region (jax_ep.initialize(ragged_bytes=B)),
// whose areas must hold N and M rows. Bad offsets and sizes are found by the
// kernel (the values live on the device) and raise a device-side error that
// the next jax_ep call reports (common/ffi_common.h, CheckDeviceError).
#include <string>

#include "common/ffi_common.h"
#include "ragged/kernels.h"

namespace jax_ep {

namespace {

constexpr const char* kOp = "ragged_all_to_all";

// Bytes of one row of `b` (every dimension after the first; 0 when one of
// them is 0), -1 for a sub-byte element type.
long long RowBytes(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  long long n = static_cast<long long>(ffi::ByteWidth(b.element_type()));
  if (n == 0) return -1;
  for (size_t i = 1; i < d.size(); ++i) n *= d[i];
  return n;
}

// Shapes of the call against each other, the group and the region -> a's
// rows, row bytes and slices.
ffi::Error CheckShapes(const ffi::AnyBuffer& operand, const ffi::AnyBuffer& output,
                       const ffi::AnyBuffer& out, size_t K, const PeerTable& peers,
                       const RaggedLayout& lay, RaggedArgs* a) {
  auto od = operand.dimensions(), md = output.dimensions(), rd = out.dimensions();
  if (od.size() < 1 || md.size() != od.size() || rd.size() != md.size() ||
      operand.element_type() != output.element_type() ||
      out.element_type() != output.element_type())
    return InvalidArgument(std::string(kOp) + ": operand, output and the result must have one "
                           "rank >= 1 and one dtype");
  for (size_t i = 0; i < md.size(); ++i)
    if (rd[i] != md[i] || (i > 0 && od[i] != md[i]))
      return InvalidArgument(std::string(kOp) + ": operand and output rows must have one shape, "
                             "and the result output's shape");
  a->row_bytes = RowBytes(output);
  if (a->row_bytes < 0)
    return InvalidArgument(std::string(kOp) + ": rows of a sub-byte dtype are not supported");
  const size_t R = static_cast<size_t>(peers.num_ranks);
  if (K < R || K % R != 0 || K / R > static_cast<size_t>(kRaggedMaxSlices))
    return InvalidArgument(std::string(kOp) + ": the offsets and sizes must have R * S entries "
                           "with S <= " + std::to_string(kRaggedMaxSlices) + " (R = " +
                           std::to_string(R) + ", got " + std::to_string(K) + ")");
  a->slices = static_cast<int>(K / R);
  a->in_rows = od[0];
  a->out_rows = md[0];
  if (a->in_rows * a->row_bytes > lay.area_bytes || a->out_rows * a->row_bytes > lay.area_bytes)
    return InvalidArgument(std::string(kOp) + ": operand (" +
                           std::to_string(a->in_rows * a->row_bytes) + " bytes) or output (" +
                           std::to_string(a->out_rows * a->row_bytes) + " bytes) is larger than "
                           "the ragged region's " + std::to_string(lay.area_bytes) +
                           "; jax_ep.initialize(ragged_bytes=...) sizes it");
  return ffi::Error::Success();
}

// The live region's layout, or the error naming jax_ep.initialize(ragged_bytes=).
ffi::Error RegionLayout(RaggedLayout* lay) {
  const BufferRegion& region = runtime()->region(kRegionRagged);
  if (region.bytes == 0)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_ep: ragged_all_to_all: the runtime has no ragged region; call "
                      "jax_ep.initialize(ragged_bytes=B) with B the bytes of the largest operand "
                      "or output per rank");
  *lay = ragged_region_layout(region.off, RaggedShape::of(region.shape));
  return ffi::Error::Success();
}

ffi::Error RaggedImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer operand,
                      ffi::AnyBuffer output, ffi::Buffer<ffi::S32> input_offsets,
                      ffi::Buffer<ffi::S32> send_sizes, ffi::Buffer<ffi::S32> output_offsets,
                      ffi::Buffer<ffi::S32> recv_sizes, ffi::Span<const int32_t> ep_groups,
                      int32_t num_ranks, int32_t transport, int32_t num_sms,
                      int64_t timeout_ns, ffi::Result<ffi::AnyBuffer> out) {
  JAX_EP_RETURN_IF_ERROR(CheckDeviceError());
  RaggedArgs a;
  JAX_EP_RETURN_IF_ERROR(GetPeerTable(ep_groups, num_ranks, device, &a.peers,
                                      transport != kLlTransportP2p));
  JAX_EP_RETURN_IF_ERROR(TransportPutMask(kOp, "transport", transport, a.peers, &a.put_mask));
  JAX_EP_RETURN_IF_ERROR(RegionLayout(&a.lay));
  const size_t K = input_offsets.element_count();
  if (send_sizes.element_count() != K || output_offsets.element_count() != K ||
      recv_sizes.element_count() != K)
    return InvalidArgument(std::string(kOp) + ": input_offsets, send_sizes, output_offsets and "
                           "recv_sizes must have one length");
  JAX_EP_RETURN_IF_ERROR(CheckShapes(operand, output, *out, K, a.peers, a.lay, &a));
  if (num_sms < 0) return InvalidArgument(std::string(kOp) + ": num_sms must be >= 0");
  JAX_EP_RETURN_IF_ERROR(PeerTimeoutNs(kOp, timeout_ns, &a.timeout_ns));
  if (out->untyped_data() != output.untyped_data())   // XLA aliases them; a copy otherwise
    JAX_EP_CUDA_RETURN(cudaMemcpyAsync(out->untyped_data(), output.untyped_data(),
                                       output.size_bytes(), cudaMemcpyDeviceToDevice, stream));
  a.operand = operand.untyped_data();
  a.out = out->untyped_data();
  a.input_offsets = input_offsets.typed_data();
  a.send_sizes = send_sizes.typed_data();
  a.output_offsets = output_offsets.typed_data();
  a.recv_sizes = recv_sizes.typed_data();
  a.host_err = device_error_word(ErrorOp::kRaggedAllToAll);
  const int sms = runtime()->sms_of(device);
  JAX_EP_CUDA_RETURN(launch_ragged_all_to_all(a, num_sms > 0 && num_sms < sms ? num_sms : sms,
                                              stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpRaggedAllToAll, jax_ep::RaggedImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::AnyBuffer>()              // operand [N, ...]
                                  .Arg<xla::ffi::AnyBuffer>()              // output [M, ...]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // input_offsets [K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // send_sizes [K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // output_offsets [K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // recv_sizes [K]
                                  .Attr<xla::ffi::Span<const int32_t>>("ep_groups")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("transport")  // LlTransport
                                  .Attr<int32_t>("num_sms")    // blocks (0: every SM)
                                  .Attr<int64_t>("timeout_ns")  // peer wait bound (ffi_common.h)
                                  .Ret<xla::ffi::AnyBuffer>());  // result [M, ...] (= output)
