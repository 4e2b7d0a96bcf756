// Test and bench hooks of the FFI handlers. Only the test build (CMake option
// JAX_EP_TESTING) has them, defined in cc/testing/hooks.cc; in production they
// are constants, so the handlers' test branches compile away and the library
// reads nothing from the environment. No tuning knob may live here: those are
// FFI attributes (EpConfig.tuning).
#pragma once

namespace jax_ep {

#if JAX_EP_TESTING
// JAX_EP_DEBUG_POISON=1: the FFI handlers fill their outputs with 0xFF (NaN
// in every float type) before the kernels run, so a row nobody writes shows
// up in the GPU tests. It never changes the result of a correct kernel (every
// output row it poisons is written), only costs a memset. Read once.
bool debug_poison();

// Bench breakdown of the intranode dispatch / combine (DispatchArgs::skip):
// bit 0 sends no data, bit 1 skips the receive-side gather / reduce. Set by
// bench code (_C.set_debug_skip), read by every such call of the process.
int debug_skip();
void set_debug_skip(int skip);
#else
constexpr bool debug_poison() { return false; }
constexpr int debug_skip() { return 0; }
#endif

}  // namespace jax_ep
