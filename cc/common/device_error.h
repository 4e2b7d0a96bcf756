// Errors raised on the device (a spin timeout) and read on the host by the
// next FFI call of the process, plus the test-only output poisoning switch.
#pragma once

namespace jax_ep {

// Error codes the kernels leave in host-mapped memory (read by the next call).
// kErrLlOrder: a low-latency send of an op before its previous receive
// finished on this rank (low_latency/kernels.cu, ll_send_in_order).
enum KernelError : int { kErrNone = 0, kErrTimeout = 1, kErrLlOrder = 2 };

// Host-mapped error word the kernels write on timeout (one per process).
int* device_error_word();  // device pointer of the mapped word
int take_device_error();   // reads and clears it (host side, no sync)
int peek_device_error();   // reads it, leaves it set
void clear_device_error(); // back to kErrNone (a new runtime)

// TEST-ONLY debug helper, the one environment read of the library:
// JAX_EP_DEBUG_POISON=1 makes the FFI handlers fill their outputs with 0xFF
// (NaN in every float type) before the kernels run, so a row nobody writes
// shows up in the GPU tests. It never changes the result of a correct kernel
// (every output row it poisons is written), only costs a memset; no tuning
// knob may be read this way (they are FFI attributes: EpConfig.tuning).
bool debug_poison();

// Default spin timeout.
constexpr unsigned long long kDefaultTimeoutNs = 10ull * 1000 * 1000 * 1000;

}  // namespace jax_ep
