// Errors raised on the device (a spin timeout) and read on the host by the
// next FFI call of the process.
#pragma once

namespace jax_ep {

// Error codes the kernels leave in host-mapped memory (read by the next call).
// kErrLlOrder: a low-latency send of an op before its previous receive
// finished on this rank (low_latency/kernels.cu, ll_send_in_order).
// kErrRaggedBounds: a ragged_all_to_all slice of this rank ran past its
// operand or its receiver's output (not sent); kErrRaggedSizes: a slice this
// rank received does not have its recv_sizes size, or its sender's ran past a
// buffer (not written). Both: ragged/kernels.cu.
enum KernelError : int {
  kErrNone = 0,
  kErrTimeout = 1,
  kErrLlOrder = 2,
  kErrRaggedBounds = 3,
  kErrRaggedSizes = 4,
};

// Host-mapped error word the kernels write on timeout (one per process).
int* device_error_word();  // device pointer of the mapped word
int take_device_error();   // reads and clears it (host side, no sync)
int peek_device_error();   // reads it, leaves it set
void clear_device_error(); // back to kErrNone (a new runtime)

// Default spin timeout of the kernel argument structs. The FFI handlers set
// theirs from the timeout_ns attribute (common/ffi_common.h PeerTimeoutNs),
// whose default, peer_timeout_s = 10.0 (jax_ep/config.py), is this value.
constexpr unsigned long long kDefaultTimeoutNs = 10ull * 1000 * 1000 * 1000;

}  // namespace jax_ep
