// Helpers shared by every XLA FFI handler (the family folders' ffi*.cc).
//
// Conventions for a jax_ep FFI target:
//  * typed FFI API, `.Ctx<Stream>()` first, work enqueued on that (XLA's)
//    stream only, no host synchronisation (so it can run inside command
//    buffers / CUDA graphs when it uses no host-side state);
//  * targets that talk to other ranks take `.Ctx<Device>()` (XLA's device
//    ordinal of the call) and two attributes, produced by jax_ep._ffi.call():
//    `ep_groups` (i32 array: every EP group of the mesh, one row of
//    `num_ranks` members each, in axis order: PEs with NVSHMEM, CUDA ordinals
//    with the peer-memory transport) and `num_ranks` (i32); call
//    GetPeerTable() to get this caller's PeerTable;
//  * every handler is defined with XLA_FFI_DEFINE_HANDLER_SYMBOL and listed in
//    cc/ffi_targets.h, which module.cc turns into jax_ep._C.registrations().
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/device_error.h"
#include "common/testing_hooks.h"
#include "intranode/launch_config.h"
#include "jax_ep_abi.h"
#include "runtime/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {

namespace ffi = xla::ffi;
using Stream = ffi::PlatformStream<cudaStream_t>;
using Device = ffi::DeviceOrdinal;  // int32 in the handler: XLA's (= CUDA's) ordinal

inline ffi::Error CudaFfiError(cudaError_t e, const char* what, const char* file, int line) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_ep: CUDA error '") + cudaGetErrorString(e) + "' in " + what +
                        " (" + file + ":" + std::to_string(line) + ")");
}

// Return an ffi::Error from the enclosing handler when a CUDA call fails.
#define JAX_EP_CUDA_RETURN(expr)                                                   \
  do {                                                                             \
    cudaError_t jax_ep_e_ = (expr);                                                \
    if (jax_ep_e_ != cudaSuccess)                                                  \
      return ::jax_ep::CudaFfiError(jax_ep_e_, #expr, __FILE__, __LINE__);         \
  } while (0)

// Check a kernel launch (launch-configuration errors only: no sync).
#define JAX_EP_LAUNCH_CHECK(name) JAX_EP_CUDA_RETURN(cudaGetLastError())

// Propagate an ffi::Error from a helper.
#define JAX_EP_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::xla::ffi::Error jax_ep_err_ = (expr);          \
    if (jax_ep_err_.failure()) return jax_ep_err_;   \
  } while (0)

inline ffi::Error NotInitialized() {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, kNotInitialized);
}

inline ffi::Error InvalidArgument(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_ep: " + msg);
}

// *dtype = the RowDtype of rows of element type t; false when the kernels
// take no such rows (bf16, f16 and f32 only).
inline bool RowDtypeOf(ffi::DataType t, int* dtype) {
  switch (t) {
    case ffi::DataType::BF16: *dtype = kBf16; return true;
    case ffi::DataType::F16: *dtype = kF16; return true;
    case ffi::DataType::F32: *dtype = kF32; return true;
    default: return false;
  }
}

// Whether the fp8_scale_mode attribute names an Fp8ScaleMode.
inline bool IsFp8ScaleMode(int32_t mode) {
  return mode == kFp8ScaleIeee || mode == kFp8ScaleXlaGpu || mode == kFp8ScaleUe8m0;
}

// The `timeout_ns` attribute (int64) of a target whose kernel waits for peers:
// how long a spin on a peer's flag lasts before the kernel gives up and
// raises kErrTimeout (common/sync.cuh). Python passes peer_timeout_s
// (KernelTuning / RaggedConfig) in nanoseconds (jax_ep/ffi_attrs.py,
// timeout_ns). Checked > 0 into *out; `op` names the target in the error.
inline ffi::Error PeerTimeoutNs(const std::string& op, int64_t timeout_ns,
                                unsigned long long* out) {
  if (timeout_ns <= 0)
    return InvalidArgument(op + ": timeout_ns (how long a kernel waits for a peer rank) must be "
                           "> 0 nanoseconds, got " + std::to_string(timeout_ns) +
                           "; set peer_timeout_s (KernelTuning, RaggedConfig) to a positive "
                           "number of seconds");
  *out = static_cast<unsigned long long>(timeout_ns);
  return ffi::Error::Success();
}

// The live runtime, or the kNotInitialized error.
inline ffi::Error GetRuntime(Runtime** out) {
  *out = runtime();
  return *out ? ffi::Error::Success() : NotInitialized();
}

// PeerTable of the EP group that holds the caller (this process's PE, or
// with peer memory the GPU `device` the call runs on), from the `ep_groups`
// and `num_ranks` attributes (see jax_ep/_ffi.py: rows = groups, in axis order).
// allow_unmapped: members NVSHMEM does not map are kept, with null peers[]
// (for kernels that reach them by puts); else they are an error.
inline ffi::Error GetPeerTable(ffi::Span<const int32_t> ep_groups, int32_t num_ranks,
                               int32_t device, PeerTable* out, bool allow_unmapped = false) {
  Runtime* rt = runtime();
  if (!rt) return NotInitialized();
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    return InvalidArgument("EP group size " + std::to_string(num_ranks) + " outside [1, " +
                           std::to_string(kMaxRanks) + "]");
  if (ep_groups.size() % num_ranks != 0)
    return InvalidArgument("ep_groups length is not a multiple of num_ranks");
  const int me = rt->member_id(device);
  for (size_t g = 0; g < ep_groups.size(); g += num_ranks) {
    for (int32_t i = 0; i < num_ranks; ++i) {
      if (ep_groups[g + i] != me) continue;
      const char* err = nullptr;
      if (!rt->peer_table(ep_groups.begin() + g, num_ranks, device, out, &err, allow_unmapped))
        return ffi::Error(ffi::ErrorCode::kFailedPrecondition, std::string("jax_ep: ") + err);
      // One process, several GPUs: XLA has made this GPU's context current;
      // its ordinal must be the one ep_groups and the buffers are keyed by.
      if (rt->transport == Transport::kPeerMemory) {
        int cur = -1;
        if (cudaGetDevice(&cur) != cudaSuccess || cur != device)
          return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                            "jax_ep: XLA's device ordinal " + std::to_string(device) +
                                " is not the current CUDA device (" + std::to_string(cur) +
                                "): the peer-memory transport keys its buffers by CUDA ordinal");
      }
      return ffi::Error::Success();
    }
  }
  return InvalidArgument(rt->transport == Transport::kNvshmem
                             ? "this process (PE " + std::to_string(rt->my_pe) +
                                   ") is in none of the EP groups passed to the call"
                             : "GPU " + std::to_string(device) +
                                   " is in none of the EP groups passed to the call");
}

// Bit r set in *mask: rank r of the group is reached by NVSHMEM puts under
// `transport` (an LlTransport code, the attribute `attr` of op `op`): "auto"
// puts exactly where NVSHMEM gave no P2P mapping (a PE across a network),
// "p2p" none (every rank must be mapped), "put" every rank, this one too (a
// put to the own PE is valid; needs the NVSHMEM transport).
inline ffi::Error TransportPutMask(const char* op, const char* attr, int32_t transport,
                                   const PeerTable& p, unsigned int* mask) {
  *mask = 0;
  switch (transport) {
    case kLlTransportAuto:
      for (int r = 0; r < p.num_ranks; ++r)
        if (!p.peers[r]) *mask |= 1u << r;
      return ffi::Error::Success();
    case kLlTransportP2p:
      for (int r = 0; r < p.num_ranks; ++r)
        if (!p.peers[r])
          return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                            std::string("jax_ep: ") + op + ", " + attr + "='p2p': rank " +
                                std::to_string(r) +
                                " of the EP group is not mapped into this process (NVSHMEM gave "
                                "no P2P pointer: a PE across a network); use 'auto' or 'put'");
      return ffi::Error::Success();
    case kLlTransportPut:
      if (runtime()->transport != Transport::kNvshmem)
        return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                          std::string("jax_ep: ") + op + ", " + attr +
                              "='put' needs the NVSHMEM transport (the peer-memory transport "
                              "has no PEs to put to); use 'auto' or 'p2p'");
      *mask = (1u << p.num_ranks) - 1u;
      return ffi::Error::Success();
    default:
      return InvalidArgument(std::string(op) + ": " + attr + " must be 0 (auto), 1 (p2p) or 2 "
                             "(put), got " + std::to_string(transport));
  }
}

// The ragged_all_to_all's bad-slice errors (the host reads them after the call).
inline std::string RaggedErrorMessage(int e) {
  const std::string what =
      e == kErrRaggedBounds
          ? "a slice of this rank ran past its operand (input_offsets + send_sizes > its rows) or "
            "past the receiver's output (output_offsets + send_sizes > its rows), or had a "
            "negative offset or size; it was not sent"
          : "a slice this rank received has a size other than its recv_sizes entry (each "
            "recv_sizes[s * S + k] must equal send_sizes[r * S + k] of sender s), or its sender's "
            "slice ran past a buffer; it was not written";
  return "jax_ep.ragged_all_to_all: " + what + ". The call's result is incomplete; fix the "
         "offsets and sizes (the next calls run normally)";
}

// Surfaces a spin timeout a previous kernel of this process left behind.
inline ffi::Error CheckDeviceError() {
  // One process per GPU: the words are this rank's, read once. One process
  // driving several GPUs shares them: an error stays set, so every GPU's next
  // call fails (else the others would launch, spin and time out again, and
  // the GPU that failed would fall an epoch behind).
  const Runtime* rt = runtime();
  const bool sticky = rt && rt->transport == Transport::kPeerMemory;
  if (const int raised = sticky ? peek_device_error() : take_device_error()) {
    const int e = error_code(raised);
    if (e == kErrRaggedBounds || e == kErrRaggedSizes) {
      // a bad argument, not a lost peer: the ranks stay in step, so the
      // words are cleared (with peer memory too) and later calls run
      if (sticky) take_device_error();
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, RaggedErrorMessage(e));
    }
    if (e == kErrLlOrder)
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "jax_ep: a low-latency send ran before the previous receive of the same "
                        "op had finished on this rank (each op must alternate send, receive, "
                        "send, ...: two sends of one op in flight would overwrite rows a peer "
                        "still reads); its peers time out; results since are invalid, restart "
                        "the job");
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jax_ep: a previous ") + error_op_name(error_op(raised)) +
                      " kernel timed out waiting for a peer rank (error " + std::to_string(e) +
                      "): ranks called different ops, a peer died, or a peer reached the call "
                      "later than peer_timeout_s (KernelTuning / RaggedConfig, 10 s by default: "
                      "raise it when hosts reach their first call far apart); results since are "
                      "invalid, restart the job");
  }
  return ffi::Error::Success();
}

}  // namespace jax_ep
