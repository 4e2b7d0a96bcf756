// The one list of XLA FFI targets exported by jax_ep._C.
//
// To add a target: define its handler in its family folder's ffi*.cc (cc/testing/ffi_*.cc for
// test and bench helpers) with
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpFoo, FooImpl, ffi::Ffi::Bind()...);
// (the symbol is extern "C" at global scope) and append
//   X("jax_ep_foo", JaxEpFoo)
// to the production (or testing) list below. jax_ep/runtime.py registers every entry with
// jax.ffi.register_ffi_target(name, capsule, platform="CUDA") on import.
//
// The low-latency targets are registered command-buffer compatible (XLA may
// capture them into a CUDA graph, which a decode step needs): each enqueues
// only on XLA's stream, its launch depends only on its attributes and shapes,
// and its epochs live in device memory. Inside a graph the host-side check of
// the kernels' error words runs at capture only: jax_ep.check_device_error()
// reads them between steps. The normal-mode targets are not (yet): their ring
// kernels have not been measured in graphs, and XLA's default flags capture
// custom calls, so marking them would change every training step.
#pragma once

#define JAX_EP_PRODUCTION_TARGETS(X)   \
  X("jax_ep_layout", JaxEpLayout)      \
  X("jax_ep_dispatch", JaxEpDispatch)  \
  X("jax_ep_combine", JaxEpCombine)    \
  X("jax_ep_combine_bwd", JaxEpCombineBwd) \
  X("jax_ep_internode_dispatch", JaxEpInternodeDispatch) \
  X("jax_ep_internode_combine", JaxEpInternodeCombine) \
  X("jax_ep_ragged_all_to_all", JaxEpRaggedAllToAll) \
  X("jax_ep_gmm_fp8_nt", JaxEpGmmFp8Nt)  \
  X("jax_ep_gmm_fp8_dw", JaxEpGmmFp8Dw)  \
  X("jax_ep_quantize_weights", JaxEpQuantizeWeights)  \
  X("jax_ep_quantize_columns", JaxEpQuantizeColumns)  \
  X("jax_ep_quantize_rows", JaxEpQuantizeRows)  \
  X("jax_ep_quantize_swiglu_rows", JaxEpQuantizeSwigluRows)  \
  JAX_EP_GRAPH_TARGETS(X)              \
  /* dispatch / combine targets: append here (one X(...) per line) */

// Production targets registered command-buffer compatible (see above).
#define JAX_EP_GRAPH_TARGETS(X)                        \
  X("jax_ep_ll_dispatch_send", JaxEpLlDispatchSend)   \
  X("jax_ep_ll_dispatch_recv", JaxEpLlDispatchRecv)   \
  X("jax_ep_ll_combine_send", JaxEpLlCombineSend)     \
  X("jax_ep_ll_combine_recv", JaxEpLlCombineRecv)

// Runtime self-test and link ceilings (cc/testing/): the test build only
// (CMake option JAX_EP_TESTING).
#define JAX_EP_TESTING_TARGETS(X)      \
  X("jax_ep_ping", JaxEpPing)          \
  X("jax_ep_bench_transfer", JaxEpBenchTransfer)

#if JAX_EP_TESTING
#define JAX_EP_FFI_TARGETS(X) JAX_EP_PRODUCTION_TARGETS(X) JAX_EP_TESTING_TARGETS(X)
#else
#define JAX_EP_FFI_TARGETS(X) JAX_EP_PRODUCTION_TARGETS(X)
#endif
