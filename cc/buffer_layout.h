// The symmetric buffer's layout and the staging sizes of each op: the one
// place these numbers are computed. The FFI handlers check against them, the
// loopback tests and jax_ep.EpConfig.native_buffer_bytes read them through
// the nanobind module (jax_ep._C.symmetric_buffer_bytes, stage_half_bytes).
//
// [ dispatch parity 0 | dispatch parity 1 | combine parity 0 | combine parity 1 | ... | control ]
// Each op's staging is double-buffered by call parity (see transport/p2p.cuh
// for the protocol); the control region at the end holds one OpCtrl per op.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime.h"

namespace jax_ep {

// The ops that own a region of the symmetric buffer (staging, flags). A new
// kernel family adds its op here (and its region below if it stages data).
enum OpKind : int { kOpDispatch = 0, kOpCombine = 1, kOpBench = 2, kNumOps = 3 };

constexpr int kMaxChunks = 8192;            // flags per (op, source rank)
constexpr size_t kCtrlBytes = size_t(1) << 20;  // control region (end of buffer)
constexpr size_t kRegionAlign = 256;

struct OpCtrl {
  unsigned int epoch;   // last finished epoch (local only)
  unsigned int done;    // blocks finished in the current call
  unsigned int pad[30];
  unsigned int flags[kMaxRanks][kMaxChunks];  // written by source ranks
};
static_assert(sizeof(OpCtrl) * kNumOps <= kCtrlBytes, "control region too small");

// The control region sits at the END of the symmetric buffer (other targets,
// e.g. the runtime self-test, scribble from offset 0): byte offset of op's block.
inline size_t ctrl_offset(size_t sym_bytes, int op) {
  return ((sym_bytes - kCtrlBytes) & ~(kRegionAlign - 1)) + sizeof(OpCtrl) * size_t(op);
}

// Staging: before the control region the buffer is split into 2 data regions
// (dispatch, combine; the bench op reuses dispatch's), each halved by epoch
// parity. Returns the size of one parity half / its byte offset.
inline size_t stage_half_bytes(size_t sym_bytes) {
  size_t data = sym_bytes > 2 * kCtrlBytes ? ((sym_bytes - kCtrlBytes) & ~(kRegionAlign - 1)) : 0;
  return (data / 4) & ~(kRegionAlign - 1);
}
inline size_t stage_offset(size_t sym_bytes, int op, int parity) {
  int region = op == kOpCombine ? 1 : 0;
  return stage_half_bytes(sym_bytes) * size_t(2 * region + parity);
}

// Bytes of one parity half that dispatch needs: R*T rows of row_bytes, then
// (256-aligned, at *scales_off) R*T scale rows of s_row_bytes (fp8 modes).
inline size_t dispatch_stage_bytes(int R, int T, long long row_bytes, long long s_row_bytes,
                                   size_t* scales_off) {
  const size_t rows = size_t(R) * size_t(T);
  const size_t a = (rows * size_t(row_bytes) + kRegionAlign - 1) & ~(kRegionAlign - 1);
  if (scales_off) *scales_off = a;
  return a + rows * size_t(s_row_bytes);
}
// Combine: R*T rows (one per (source rank, token)).
inline size_t combine_stage_bytes(int R, int T, long long row_bytes) {
  return size_t(R) * size_t(T) * size_t(row_bytes);
}

// The smallest symmetric buffer (a multiple of 1 MiB) whose staging halves
// hold both ops for R ranks, T tokens per rank, rows of row_bytes and scale
// rows of s_row_bytes.
inline size_t symmetric_buffer_bytes(int R, int T, long long row_bytes, long long s_row_bytes) {
  size_t need = dispatch_stage_bytes(R, T, row_bytes, s_row_bytes, nullptr);
  const size_t c = combine_stage_bytes(R, T, row_bytes);
  if (c > need) need = c;
  const size_t mib = size_t(1) << 20;
  size_t bytes = ((4 * (need + kRegionAlign) + 2 * kCtrlBytes) + mib - 1) / mib * mib;
  while (stage_half_bytes(bytes) < need) bytes += mib;
  return bytes;
}

}  // namespace jax_ep
