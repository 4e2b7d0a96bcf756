// The normal region's layout (the start of the symmetric buffer: the ring
// kernels' staging and control words) and the staging sizes of each op: the
// one place these numbers are computed. The FFI handlers check against them, the
// loopback tests and jax_ep.EpConfig.native_buffer_bytes read them through
// the nanobind module (jax_ep._C.symmetric_buffer_bytes, stage_half_bytes,
// ring_depth).
//
// [ dispatch parity 0 | dispatch parity 1 | combine parity 0 | combine parity 1 | ... | control ]
// Each op's staging is double-buffered by call parity (see transport/ring.cuh
// for the protocol); the control region at the end holds one OpCtrl per op.
//
// Staging is a set of bounded rings, so the buffer does not grow with T: in
// one parity half, for every (peer p < R-1, block b < G) a ring of `depth`
// slots of `chunk` token rows. Chunk j of the tokens belongs to block
// b = j % G and is that block's i-th chunk (i = j / G); it lands in slot
// q = i % depth. A sender reuses a slot only after the receiver returned the
// slot's credit (transport/ring.cuh). When depth covers all of a block's
// chunks nothing wraps and no sender ever waits.
#pragma once

#include <cuda_runtime.h>  // __host__ __device__

#include <cstddef>
#include <cstdint>

#include "runtime/regions.h"
#include "runtime/runtime.h"

namespace jax_ep {

// The ops that own a region of the symmetric buffer (staging, flags). A new
// kernel family adds its op here (and its region below if it stages data).
enum OpKind : int { kOpDispatch = 0, kOpCombine = 1, kOpBench = 2, kNumOps = 3 };

constexpr int kMaxBlocks = 160;             // grid bound (blocks are resident: <= SMs)
// Ring slots per (peer, block): 64 x 132 blocks x 8 tokens covers T = 67584
// without wrapping (every config the pre-ring kernels ran still never waits).
constexpr int kMaxDepth = 64;
constexpr size_t kCtrlBytes = size_t(8) << 20;  // control region (end of buffer)
constexpr size_t kDefaultBufferBytes = size_t(1) << 30;  // jax_ep.initialize() default

// Flag words are epoch-tagged 64-bit values, (epoch << 32) | (i + 1) for a
// block's i-th chunk: monotonic over calls, so they are never reset.
struct OpCtrl {
  unsigned int epoch;   // last finished epoch (local only)
  unsigned int done;    // blocks finished in the current call
  unsigned int pad[30];
  unsigned int barrier[kMaxRanks];  // one-word barriers (bench op), written by peers
  unsigned int pad2[32 - kMaxRanks];
  // ready[s][b][q]: source s filled slot q of block b's ring here (written by s).
  unsigned long long ready[kMaxRanks][kMaxBlocks][kMaxDepth];
  // credit[r][b][q]: receiver r drained slot q of block b's ring (written by r).
  unsigned long long credit[kMaxRanks][kMaxBlocks][kMaxDepth];
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
  size_t data = sym_bytes > kCtrlBytes ? ((sym_bytes - kCtrlBytes) & ~(kRegionAlign - 1)) : 0;
  return (data / 4) & ~(kRegionAlign - 1);
}
inline size_t stage_offset(size_t sym_bytes, int op, int parity) {
  int region = op == kOpCombine ? 1 : 0;
  return stage_half_bytes(sym_bytes) * size_t(2 * region + parity);
}

// Row index of (peer p, block b, slot q, row u) in a staging half.
__host__ __device__ inline long long ring_row(int G, int depth, int chunk, int p, int b, int q,
                                             int u) {
  return ((static_cast<long long>(p) * G + b) * depth + q) * chunk + u;
}

// Rows of one half's rings: (R-1) * G * depth * chunk; the scale rows (fp8
// modes) follow at the 256-aligned byte offset *scales_off.
inline size_t ring_bytes(int R, int G, int depth, int chunk, long long row_bytes,
                         long long s_row_bytes, size_t* scales_off) {
  const size_t rows = size_t(R > 1 ? R - 1 : 0) * size_t(G) * size_t(depth) * size_t(chunk);
  const size_t a = align_up(rows * size_t(row_bytes));
  if (scales_off) *scales_off = a;
  return a + rows * size_t(s_row_bytes);
}

// Chunks of `chunk` tokens the busiest of G blocks handles (T = 0: one).
inline int chunks_per_block(int T, int chunk, int G) {
  const int num_chunks = T > 0 ? (T + chunk - 1) / chunk : 1;
  return (num_chunks + G - 1) / G;
}

// Ring depth for T tokens in chunks of `chunk` over G blocks: as many slots as
// a block has chunks (nothing wraps), capped by kMaxDepth and by what a
// staging half of `half` bytes holds; 0 when not even one slot fits.
inline int ring_depth(int R, int T, int G, int chunk, long long row_bytes, long long s_row_bytes,
                      size_t half) {
  int depth = chunks_per_block(T, chunk, G);
  if (depth > kMaxDepth) depth = kMaxDepth;
  if (depth < 1) depth = 1;
  while (depth > 0 && ring_bytes(R, G, depth, chunk, row_bytes, s_row_bytes, nullptr) > half)
    --depth;
  return depth;
}

// The symmetric buffer (a multiple of 1 MiB) for R ranks and T tokens per
// rank with rows of row_bytes (+ s_row_bytes of scales): rings that never
// wrap for any grid up to kMaxBlocks and chunk up to 8 (G * ceil(n / G) <=
// n + G chunks per peer), capped at kDefaultBufferBytes, beyond which the
// rings wrap (any T runs in the default buffer).
inline size_t symmetric_buffer_bytes(int R, int T, long long row_bytes, long long s_row_bytes) {
  const size_t rows = size_t(R > 1 ? R - 1 : 0) * (size_t(T > 0 ? T : 1) + size_t(kMaxBlocks) * 8);
  const size_t need = align_up(rows * size_t(row_bytes)) + rows * size_t(s_row_bytes);
  const size_t mib = size_t(1) << 20;
  size_t bytes = ((4 * (need + kRegionAlign) + 2 * kCtrlBytes) + mib - 1) / mib * mib;
  while (stage_half_bytes(bytes) < need) bytes += mib;
  return bytes > kDefaultBufferBytes ? kDefaultBufferBytes : bytes;
}

}  // namespace jax_ep
