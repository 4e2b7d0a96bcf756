// Grid, warp split and chunking of the intranode kernels.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "intranode/ring_layout.h"

namespace jax_ep {

// Receiver warps spin on flags raised by sender warps of other blocks (and
// ranks), so every block of a grid must be resident at once: the grid is at
// most the SM count and a block (512 threads, <= 128 registers) fits one SM.
//
// A chunk (one flag) is `chunk` consecutive tokens, moved by all the sender
// warps of one block at once: with fewer tokens than warps each token row is
// cut into `slices` column slices, one warp each. Small chunks make data land
// in many small waves, so the receive-side work left after the last byte
// arrives (gather / reduce of the last wave) is small.
struct LaunchConfig {
  int num_blocks = 0;    // grid (<= SMs: blocks spin, so all must be resident)
  int send_warps = 8;    // warps per block that push rows to peers
  int recv_warps = 8;    // warps per block that gather / reduce locally
  int chunk = 8;         // tokens per ring slot (one ready flag each)
  int slices = 1;        // warps per token row inside a chunk (send and receive)
  int depth = 1;         // ring slots per (peer, block): ring_layout.h
  __host__ __device__ int threads() const { return 32 * (send_warps + recv_warps); }
};

// Picks the grid and chunk size of op (kOpDispatch / kOpCombine) for T tokens
// given an SM budget (num_sms <= 0: every SM of the device). The tokens per
// chunk: `chunk` when > 0 (the `chunk` FFI attribute, EpConfig.tuning; the
// loopback tests), else the default. Every rank of a group must pass the
// same chunk and get the same grid (chunk j must mean the same tokens and
// block everywhere): they come from the one EpConfig they share, on GPUs of
// one kind.
LaunchConfig make_launch_config(OpKind op, int num_tokens, int num_sms_requested, int device_sms,
                                int chunk = 0);

// Sets lc->depth for R ranks, T tokens and rows of row_bytes (+ s_row_bytes
// of scales) in a staging half of `half` bytes; halves the chunk while the
// ring would hold fewer than 2 slots per (peer, block) (so sending and
// draining overlap). False when not even one row per ring fits.
bool fit_ring(LaunchConfig* lc, int R, int T, long long row_bytes, long long s_row_bytes,
              size_t half);

// The launch of op for R ranks and T tokens in a symmetric buffer of
// sym_bytes (make_launch_config + fit_ring): "" and *lc, or why the staging
// does not fit. The FFI handlers and the trace-time check in jax_ep/intranode/native.py
// (jax_ep._C.staging_error) both use it.
std::string plan_launch(OpKind op, int R, int T, int num_sms_requested, int device_sms,
                        int chunk, long long row_bytes, long long s_row_bytes, size_t sym_bytes,
                        LaunchConfig* lc);

// Warps per token row when a block's warps share a chunk of `chunk` tokens.
inline int slices_for_chunk(int chunk, int warps) { return chunk >= warps ? 1 : warps / chunk; }

}  // namespace jax_ep
