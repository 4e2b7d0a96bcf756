#include "testing/ping.h"

#include <nvshmem.h>
#include <nvshmemx.h>

namespace jax_ep {
namespace {

__global__ void put_next(PeerTable peers, const int32_t* __restrict__ x, int64_t n) {
  int32_t* dst = static_cast<int32_t*>(peers.peers[(peers.rank + 1) % peers.num_ranks]);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = x[i];
}

}  // namespace

cudaError_t launch_ping(const PeerTable& peers, const int32_t* x, int32_t* y, int64_t n,
                        cudaStream_t stream) {
  if (n > 0) {
    put_next<<<static_cast<unsigned>(n < 65536 * 256 ? (n + 255) / 256 : 65536), 256, 0, stream>>>(
        peers, x, n);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  nvshmemx_barrier_all_on_stream(stream);  // peers' stores have landed
  cudaError_t e = cudaMemcpyAsync(y, peers.peers[peers.rank], sizeof(int32_t) * n,
                                  cudaMemcpyDeviceToDevice, stream);
  if (e != cudaSuccess) return e;
  nvshmemx_barrier_all_on_stream(stream);  // nobody overwrites before we have read
  return cudaGetLastError();
}

}  // namespace jax_ep
