// Host interface of the ragged all-to-all kernel (jax_ep.ragged_all_to_all,
// docs/ragged.md): one kernel per call, a send phase and a receive phase.
//
// Transports (put_mask, filled by the FFI handler from the `transport`
// attribute as for the low-latency kernels): bit r clear, rank r is reached by
// P2P stores through peers.peers[r]; set, by NVSHMEM puts to PE peers.pe[r]
// from this rank's staging area.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_error.h"
#include "ragged/region_layout.h"
#include "runtime/runtime.h"

namespace jax_ep {

constexpr int kRaggedWarps = 16;  // warps per block

// One call. Slice p (of K = R * S) of this rank goes to rank p / S:
// operand rows [input_offsets[p], + send_sizes[p]) land at rows
// [output_offsets[p], + send_sizes[p]) of that rank's result. The receive
// phase writes into `out` only the rows of the slices it receives; `out`
// already holds `output` (an XLA alias), so every other row keeps it.
struct RaggedArgs {
  PeerTable peers;
  RaggedLayout lay;
  const void* operand = nullptr;        // [in_rows, row_bytes]
  void* out = nullptr;                  // [out_rows, row_bytes]
  const int32_t* input_offsets = nullptr;   // [K]
  const int32_t* send_sizes = nullptr;      // [K]
  const int32_t* output_offsets = nullptr;  // [K]
  const int32_t* recv_sizes = nullptr;      // [K]
  int slices = 1;                       // S
  long long in_rows = 0, out_rows = 0, row_bytes = 0;
  unsigned int put_mask = 0;            // bit r: rank r by puts
  int* host_err = nullptr;              // kErrTimeout, kErrRaggedBounds, kErrRaggedSizes
  unsigned long long timeout_ns = kDefaultTimeoutNs;
};

// Load the kernel on the current device now (CUDA loads lazily, and a load
// can wait behind a spinning kernel: low_latency/kernels.cu says more). The
// runtime calls it at attach when it lays out a ragged region.
cudaError_t preload_ragged_kernels();

// num_blocks: blocks of the grid (every block must be resident: the receive
// phase waits for a signal that the send phase's last block raises).
cudaError_t launch_ragged_all_to_all(const RaggedArgs& a, int num_blocks, cudaStream_t s);

}  // namespace jax_ep
