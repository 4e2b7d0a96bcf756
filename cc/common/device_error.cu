// Host side of device_error.h: the host-mapped error word the kernels raise on a
// spin timeout. Reading it needs no stream sync: the next FFI call of this
// process sees it and fails with a clear message instead of hanging.
#include <cuda_runtime.h>

#include <mutex>

#include "common/device_error.h"

namespace jax_ep {

namespace {
std::once_flag g_once;
int* g_host = nullptr;
int* g_dev = nullptr;
}  // namespace

int* device_error_word() {
  std::call_once(g_once, [] {
    void* h = nullptr;
    if (cudaHostAlloc(&h, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    void* d = nullptr;
    if (cudaHostGetDevicePointer(&d, h, 0) != cudaSuccess) {
      cudaGetLastError();
      cudaFreeHost(h);
      return;
    }
    g_host = static_cast<int*>(h);
    *g_host = 0;
    g_dev = static_cast<int*>(d);
  });
  return g_dev;  // nullptr: no error reporting (kernels then only time out)
}

int peek_device_error() {
  device_error_word();  // the word exists (and g_host is set) before anyone reads it
  return g_host ? *reinterpret_cast<volatile int*>(g_host) : 0;
}

void clear_device_error() {
  device_error_word();
  if (g_host) *reinterpret_cast<volatile int*>(g_host) = 0;
}

int take_device_error() {
  if (!g_host) return 0;
  int v = *reinterpret_cast<volatile int*>(g_host);
  if (v) *reinterpret_cast<volatile int*>(g_host) = 0;
  return v;
}

}  // namespace jax_ep
