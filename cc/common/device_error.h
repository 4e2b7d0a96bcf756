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

// The op family whose kernels raise into a word: one host-mapped word per
// family, so the error names the op that raised it (the host cannot: the
// kernel that times out may have been launched several calls before the call
// that reads the words). The words follow a first word, in one 64-byte-aligned
// block, that the first error of any family sets with its op: the waits read
// it to give up on any family's error (common/sync.cuh), the host reports it.
enum class ErrorOp : int {
  kDispatch = 0,        // intranode and internode dispatch
  kCombine,             // intranode and internode combine, and its backward
  kLowLatencyDispatch,  // its send and receive
  kLowLatencyCombine,
  kRaggedAllToAll,
  kTesting,             // cc/testing's transfer bench
  kCount,
};
const char* error_op_name(int op);   // "dispatch", ...; "" past kCount

// An error as read: its KernelError in the low 8 bits, its ErrorOp above
// them (0: none). Host side, no stream sync.
int* device_error_word(ErrorOp op);  // device pointer of the op's mapped word
int take_device_error();   // the first error raised; then every word is cleared
int peek_device_error();   // the same, every word left as it is
void clear_device_error(); // every word back to kErrNone (a new runtime)
constexpr int error_code(int e) { return e & 0xff; }
constexpr int error_op(int e) { return e >> 8; }

// Default spin timeout of the kernel argument structs. The FFI handlers set
// theirs from the timeout_ns attribute (common/ffi_common.h PeerTimeoutNs),
// whose default, peer_timeout_s = 10.0 (jax_ep/config.py), is this value.
constexpr unsigned long long kDefaultTimeoutNs = 10ull * 1000 * 1000 * 1000;

}  // namespace jax_ep
