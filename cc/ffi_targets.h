// The one list of XLA FFI targets exported by jax_ep._C.
//
// To add a target: define its handler in a cc/ffi_*.cc with
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpFoo, FooImpl, ffi::Ffi::Bind()...);
// (the symbol is extern "C" at global scope) and append
//   X("jax_ep_foo", JaxEpFoo)
// below. jax_ep/runtime.py registers every entry with
// jax.ffi.register_ffi_target(name, capsule, platform="CUDA") on import.
#pragma once

#define JAX_EP_FFI_TARGETS(X)        \
  X("jax_ep_layout", JaxEpLayout)    \
  X("jax_ep_ping", JaxEpPing)        \
  X("jax_ep_dispatch", JaxEpDispatch)  \
  X("jax_ep_combine", JaxEpCombine)    \
  X("jax_ep_bench_transfer", JaxEpBenchTransfer) \
  X("jax_ep_combine_bwd", JaxEpCombineBwd) \
  /* dispatch / combine targets: append here (one X(...) per line) */
