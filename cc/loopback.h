// Loopback harness (tests only): R "ranks" of the intranode dispatch / combine
// kernels on ONE GPU in one process. Each rank gets its own zeroed buffer in
// place of the NVSHMEM symmetric buffer and its own stream; the peer table
// points at the other ranks' buffers on the same device, so the kernels run
// their real protocol (staging, flags, epochs, chunk slices) with HBM standing
// in for NVLink. Each rank gets num_blocks SMs; R * num_blocks must fit the
// device, since blocks of all ranks spin on each other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep {

// ptrs, per rank r at [11r, 11r + 11): x, scales, out, out_scales, row_src,
// slot_row, send_mask, sym, y, row_w, dw (the last three: mode 3, the combine
// backward, only). ints: T, K, C, hidden, x_row_bytes, row_bytes,
// s_row_bytes, mode, rank_major, num_blocks, chunk (<= 0: default),
// div_mode, zero_tail, align, dtype (0 bf16, 1 f32, 2 f16; mode 3).
// Runs `iters` calls back to back (*seconds: wall time per call). Returns ""
// or an error message; synchronises the device.
std::string loopback_dispatch(const std::vector<uint64_t>& ptrs, const std::vector<int64_t>& ints,
                              size_t sym_bytes, int num_ranks, int iters, double* seconds);

// ptrs, per rank at [7r, 7r + 7): y, row_weights (0: none), slot_row,
// recv_local_idx, send_mask, out, sym. ints: T, K, C, W, dtype (0 bf16, 1 f32,
// 2 f16), row_bytes, rank_major, num_blocks, chunk. As loopback_dispatch.
std::string loopback_combine(const std::vector<uint64_t>& ptrs, const std::vector<int64_t>& ints,
                             size_t sym_bytes, int num_ranks, int iters, double* seconds);

}  // namespace jax_ep
