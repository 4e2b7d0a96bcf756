// See loopback_put.h.
#include "testing/loopback_put.h"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <map>
#include <mutex>
#include <stdexcept>

namespace jax_ep {

namespace {
std::mutex g_mu;
std::map<uint64_t, size_t> g_allocs;  // base -> bytes, of loopback_sym_alloc
}  // namespace

uint64_t loopback_sym_alloc(size_t bytes) {
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED)
    throw std::runtime_error("loopback_sym_alloc: NVSHMEM is not initialised (nvshmem_init "
                             "with one rank first)");
  if (nvshmem_n_pes() != 1)
    throw std::runtime_error("loopback_sym_alloc: the loopback put mode needs exactly one PE");
  void* p = nvshmem_malloc(bytes);
  if (!p)
    throw std::runtime_error("loopback_sym_alloc: nvshmem_malloc(" + std::to_string(bytes) +
                             ") failed (raise NVSHMEM_SYMMETRIC_SIZE)");
  if (cudaError_t e = cudaMemset(p, 0, bytes); e != cudaSuccess)
    throw std::runtime_error(std::string("loopback_sym_alloc: cudaMemset: ") +
                             cudaGetErrorString(e));
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess)
    throw std::runtime_error(std::string("loopback_sym_alloc: ") + cudaGetErrorString(e));
  std::lock_guard<std::mutex> lock(g_mu);
  g_allocs[reinterpret_cast<uint64_t>(p)] = bytes;
  return reinterpret_cast<uint64_t>(p);
}

void loopback_sym_free(uint64_t ptr) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_allocs.erase(ptr)) throw std::runtime_error("loopback_sym_free: not an allocation");
  }
  cudaDeviceSynchronize();
  nvshmem_free(reinterpret_cast<void*>(ptr));
}

std::string loopback_put_peers(PeerTable* p, size_t sym_bytes) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (int i = 0; i < p->num_ranks; ++i) {
    const uint64_t a = reinterpret_cast<uint64_t>(p->peers[i]);
    auto it = g_allocs.upper_bound(a);
    if (it == g_allocs.begin() || (--it, a + sym_bytes > it->first + it->second))
      return "loopback put mode: rank " + std::to_string(i) +
             "'s buffer is not from loopback_sym_alloc (or smaller than sym_bytes)";
    p->pe[i] = 0;
  }
  p->put_at_peer = 1;
  return "";
}

}  // namespace jax_ep
