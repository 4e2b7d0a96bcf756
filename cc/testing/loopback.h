// Loopback harness (tests only): R "ranks" of the intranode dispatch / combine
// kernels on ONE GPU in one process. Each rank gets its own zeroed buffer in
// place of the NVSHMEM symmetric buffer and its own stream; the peer table
// points at the other ranks' buffers on the same device, so the kernels run
// their real protocol (staging, flags, epochs, chunk slices) with HBM standing
// in for NVLink. Each rank gets num_blocks SMs; R * num_blocks must fit the
// device, since blocks of all ranks spin on each other.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "intranode/kernels.h"
#include "runtime/runtime.h"

namespace jax_ep {

// The argument layout (exported as jax_ep._C.LOOPBACK_*; tests/gpu/test_loopback.py
// builds its lists from these names). ptrs: per rank r at [P r, P r + P),
// P = the number of names; y, row_w, dw only for mode 3 (the combine
// backward). ints: chunk <= 0 is the default; dtype a RowDtype (mode 3).
inline constexpr const char* kLoopbackDispatchPtrs[] = {
    "x", "scales", "out", "out_scales", "row_src", "slot_row", "send_mask", "sym", "y", "row_w",
    "dw"};
inline constexpr const char* kLoopbackDispatchInts[] = {
    "T", "K", "C", "hidden", "x_row_bytes", "row_bytes", "s_row_bytes", "mode", "rank_major",
    "num_blocks", "chunk", "fp8_scale_mode", "zero_tail", "align", "dtype"};
inline constexpr const char* kLoopbackCombinePtrs[] = {
    "y", "row_weights", "slot_row", "recv_local_idx", "send_mask", "out", "sym"};
inline constexpr const char* kLoopbackCombineInts[] = {
    "T", "K", "C", "W", "dtype", "row_bytes", "rank_major", "num_blocks", "chunk"};

// Runs `iters` calls back to back (*seconds: wall time per call). Returns ""
// or an error message; synchronises the device.
std::string loopback_dispatch(const std::vector<uint64_t>& ptrs, const std::vector<int64_t>& ints,
                              size_t sym_bytes, int num_ranks, int iters, double* seconds);

// As loopback_dispatch (row_weights 0: none).
std::string loopback_combine(const std::vector<uint64_t>& ptrs, const std::vector<int64_t>& ints,
                             size_t sym_bytes, int num_ranks, int iters, double* seconds);

// Shared by the loopback entry points (here and loopback_ll.cu).
// Receive spins give up after 2 s (a stalled test fails fast, never hangs).
constexpr unsigned long long kLoopbackTimeoutNs = 2ull * 1000 * 1000 * 1000;
// Rank r's peer table: rank i's stand-in symmetric buffer is ptrs[stride * i + sym_index].
PeerTable loopback_peers(const std::vector<uint64_t>& ptrs, int stride, int sym_index, int R,
                         int r);
// Rank r's kernel arguments from the loopback_dispatch / loopback_combine
// pointer and int lists (kLoopback*Ptrs / *Ints): every field the intranode
// and the internode kernels both read. The caller adds its own (control and
// staging offsets, the combine-backward pointers; the internode layout).
DispatchArgs loopback_dispatch_args(const std::vector<uint64_t>& ptrs,
                                    const std::vector<int64_t>& ints, int R, int r);
CombineArgs loopback_combine_args(const std::vector<uint64_t>& ptrs,
                                  const std::vector<int64_t>& ints, int R, int r);
// "" when R ranks of num_blocks blocks each fit the device at once (one block per SM).
std::string check_resident(int R, int num_blocks);
// Launches fn(r, stream_r) for every rank on its own stream, `iters` times
// back to back, then waits; "" or the error (a device-side timeout included).
std::string run_ranks(int R, int iters, double* seconds,
                      const std::function<cudaError_t(int, cudaStream_t)>& fn);

}  // namespace jax_ep
