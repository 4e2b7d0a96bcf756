// Loopback harness of the low-latency kernels (tests only): R "ranks" on ONE
// GPU, as loopback.h does for the normal mode. Each rank gets its own zeroed
// buffer holding the low-latency region (LlLayout at offset 0) in place of
// the symmetric buffer, and its own stream; every call launches the send
// kernel and then the receive kernel of each op on the rank's stream. put 0:
// P2P stores (put_mask 0, no staging); put 1: every rank by NVSHMEM puts, the
// buffers from loopback_sym_alloc and laid out with staging
// (cc/testing/loopback_put.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep {

// The argument layout (exported as jax_ep._C.LOOPBACK_LL_*; tests/gpu/
// test_loopback_ll.py builds its lists from these names). ptrs: per rank r at
// [P r, P r + P), P = the number of names. Dispatch reads x, topk_idx, slot,
// expert_count and writes out, out_scales (cast modes), out_info, src_count,
// count; combine reads y, combine_info / combine_src_count (a dispatch's
// out_info / src_count: the same pointers for a round trip), slot, weights
// (merged) and writes combine_out. ints: mode a DispatchMode (copy or a
// cast), fp8_scale_mode an Fp8ScaleMode, y_dtype a RowDtype, put 0 / 1.
inline constexpr const char* kLoopbackLlPtrs[] = {
    "x", "topk_idx", "slot", "expert_count", "out", "out_scales", "out_info", "src_count",
    "count", "y", "combine_info", "combine_src_count", "weights", "combine_out", "sym"};
inline constexpr const char* kLoopbackLlInts[] = {
    "T", "K", "num_experts", "max_tokens", "hidden", "x_row_bytes", "row_bytes",
    "s_row_bytes", "y_row_bytes", "mode", "fp8_scale_mode", "y_dtype", "num_blocks", "warps",
    "put"};

// Which ops one call runs, in this order (bits).
enum LoopbackLlOps : int { kLlOpDispatch = 1, kLlOpCombine = 2 };

// Runs `iters` calls back to back (*seconds: wall time per call). Returns ""
// or an error message; synchronises the device. After an error the buffers'
// epochs are out of step: start again from zeroed buffers.
std::string loopback_ll(const std::vector<uint64_t>& ptrs, const std::vector<int64_t>& ints,
                        size_t sym_bytes, int num_ranks, int iters, int ops, double* seconds);

}  // namespace jax_ep
