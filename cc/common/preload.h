// Loading a family's kernels before any of them spins.
//
// CUDA loads kernels lazily (CUDA_MODULE_LOADING=LAZY, the default since
// 12.2) at their first launch, and that load can wait for kernels already
// running on the device. A receive kernel spins on a peer's send: when one
// host thread drives several ranks (the loopback harness, the peer-memory
// transport) and blocks loading, say, a send behind a spinning receive, the
// peer's send is never launched until the receive times out (seen in the
// low-latency loopback round trip's first call). So whoever starts a family
// whose kernels wait on each other loads all of them first, once per device.
#pragma once

#include <cuda_runtime.h>

#include <initializer_list>
#include <mutex>

namespace jax_ep {

class KernelPreload {
 public:
  // Loads `fns` on the current device, once per device (cudaFuncGetAttributes
  // forces the load).
  cudaError_t once(std::initializer_list<const void*> fns) {
    int dev = 0;
    if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
    std::lock_guard<std::mutex> lock(mu_);
    if (dev < 64 && (loaded_ >> dev) & 1ull) return cudaSuccess;
    cudaFuncAttributes at;
    for (const void* f : fns)
      if (cudaError_t e = cudaFuncGetAttributes(&at, f); e != cudaSuccess) return e;
    if (dev < 64) loaded_ |= 1ull << dev;
    return cudaSuccess;
  }

 private:
  std::mutex mu_;
  unsigned long long loaded_ = 0;   // bit d: device d done
};

}  // namespace jax_ep
