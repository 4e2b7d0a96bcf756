// Runtime self-test: ring exchange through the symmetric buffer.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "runtime/runtime.h"

namespace jax_ep {

// y = x of the previous rank of the group (ring), via peer stores into the
// next rank's symmetric buffer and NVSHMEM barriers on `stream`.
cudaError_t launch_ping(const PeerTable& peers, const int32_t* x, int32_t* y, int64_t n,
                        cudaStream_t stream);

}  // namespace jax_ep
