// Raw transfer ceilings: SM stores or the copy engine into the peer's
// staging, between two one-block barriers on the bench op's flags.
#include "testing/bench_transfer.h"

#include "common/device_error.h"
#include "common/sync.cuh"
#include "intranode/ring_layout.h"
#include "transport/ring.cuh"

namespace jax_ep {

namespace {

// One-block barrier over the group on the bench op's flags.
__global__ void bench_barrier_kernel(PeerTable p, size_t ctrl_off, int* host_err) {
  OpCtrl* ctrl = reinterpret_cast<OpCtrl*>(peer_ptr(p, p.rank, ctrl_off));
  const unsigned int epoch = current_epoch(ctrl);
  if (threadIdx.x < p.num_ranks) {
    OpCtrl* rc = reinterpret_cast<OpCtrl*>(peer_ptr(p, threadIdx.x, ctrl_off));
    __threadfence_system();
    st_release_sys(&rc->barrier[p.rank], epoch);
    wait_flag(&ctrl->barrier[threadIdx.x], epoch, host_err, kDefaultTimeoutNs);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *reinterpret_cast<volatile unsigned int*>(&ctrl->epoch) = epoch;
    __threadfence_system();
  }
}

__global__ void __launch_bounds__(512)
bench_write_kernel(const int4* __restrict__ src, int4* dst, size_t n16) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    int4 v0 = src[i], v1 = src[i + stride], v2 = src[i + 2 * stride], v3 = src[i + 3 * stride];
    dst[i] = v0; dst[i + stride] = v1; dst[i + 2 * stride] = v2; dst[i + 3 * stride] = v3;
  }
  for (; i < n16; i += stride) dst[i] = src[i];
  __threadfence_system();
}

}  // namespace

cudaError_t launch_bench_transfer(const PeerTable& peers, size_t sym_bytes, const void* src,
                                  size_t bytes, int mode, int num_blocks, int* host_err,
                                  cudaStream_t stream) {
  const size_t ctrl_off = ctrl_offset(sym_bytes, kOpBench);
  const int peer = (peers.rank + 1) % peers.num_ranks;
  void* dst = static_cast<char*>(peers.peers[peer]) + stage_offset(sym_bytes, kOpBench, 0);
  const bool sender = (mode == 0 || mode == 1) || peers.rank == 0;
  bench_barrier_kernel<<<1, 32, 0, stream>>>(peers, ctrl_off, host_err);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (sender && bytes > 0) {
    if (mode == 1 || mode == 2) {
      err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
    } else {
      bench_write_kernel<<<num_blocks, 512, 0, stream>>>(static_cast<const int4*>(src),
                                                          static_cast<int4*>(dst), bytes / 16);
      err = cudaGetLastError();
    }
    if (err != cudaSuccess) return err;
  }
  bench_barrier_kernel<<<1, 32, 0, stream>>>(peers, ctrl_off, host_err);
  return cudaGetLastError();
}

}  // namespace jax_ep
