// Kernel launch configuration, one form for every family: the grid of an SM
// budget, and a launch of a kernel on a grid / block / dynamic shared memory
// / stream whose result is the launch's error. The families keep their own
// warp splits (LaunchConfig, InterLaunch, LlGrid); their launch sites go
// through here. The FFI handlers (host C++) see sm_budget only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace jax_ep {

// Blocks of a one-block-per-SM grid under a call's SM budget (the num_sms
// attribute): num_sms when in [1, device_sms), else every SM of the device.
inline int sm_budget(int num_sms, int device_sms) {
  return num_sms > 0 && num_sms < device_sms ? num_sms : device_sms;
}

// Where a kernel runs.
struct KernelLaunch {
  int blocks;
  int threads;        // per block
  size_t smem;        // dynamic shared memory, bytes
  cudaStream_t stream;
};

#ifdef __CUDACC__
// kernel(args...) as `l` says; returns the launch's error (configuration
// errors only: never waits for the kernel).
template <typename... Params, typename... Args>
cudaError_t launch(const KernelLaunch& l, void (*kernel)(Params...), Args&&... args) {
  kernel<<<l.blocks, l.threads, l.smem, l.stream>>>(std::forward<Args>(args)...);
  return cudaGetLastError();
}
#endif  // __CUDACC__

}  // namespace jax_ep
