// Link ceiling measurements (bench/ep_bench.py; JAX_EP_TESTING builds only).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "runtime/runtime.h"

namespace jax_ep {

// Every rank moves `bytes` from src into the peer's staging. mode: 0 SM
// writes both ways, 1 copy engine both ways, 2 copy engine rank 0 -> 1 only,
// 3 SM writes rank 0 -> 1 only. Bracketed by two device-side barriers so the
// call covers the whole transfer.
cudaError_t launch_bench_transfer(const PeerTable& peers, size_t sym_bytes, const void* src,
                                  size_t bytes, int mode, int num_blocks, int* host_err,
                                  cudaStream_t stream);

}  // namespace jax_ep
