// The symmetric buffer's layout and the staging sizes of each op: the one
// place these numbers are computed. The FFI handlers check against them, the
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

#include "runtime.h"

namespace jax_ep {

// The ops that own a region of the symmetric buffer (staging, flags). A new
// kernel family adds its op here (and its region below if it stages data).
enum OpKind : int { kOpDispatch = 0, kOpCombine = 1, kOpBench = 2, kNumOps = 3 };

constexpr int kMaxBlocks = 160;             // grid bound (blocks are resident: <= SMs)
// Ring slots per (peer, block): 64 x 132 blocks x 8 tokens covers T = 67584
// without wrapping (every config the pre-ring kernels ran still never waits).
constexpr int kMaxDepth = 64;
constexpr size_t kCtrlBytes = size_t(8) << 20;  // control region (end of buffer)
constexpr size_t kRegionAlign = 256;
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

inline size_t align_up(size_t n) { return (n + kRegionAlign - 1) & ~(kRegionAlign - 1); }

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

// ---- Low-latency (decode) mode: its own region (docs/low_latency.md) ----
// From byte `base`, every offset the same on every rank:
//   ctrl         LlOpCtrl[2]: dispatch, combine (local counters)
//   disp_count   u64 [2 parity][L][R]: source s's tagged count for (l, s)
//   comb_flag    u64 [2 parity][max_ranks]: expert rank r's "all my rows to you" word
//   per parity:  disp_rows [max_ranks][Tmax] rows of row_stride bytes: source s's
//                token t at row s*Tmax + t, ONE copy per (token, rank) whatever
//                the number of its experts there (the receive kernel replicates
//                it to each expert's output row), disp_scales (s_row_stride
//                each, same rows), disp_info int32 [L][R][Tmax] (t*K + k of the
//                pair at output row (l, s, slot): which token row to copy, and
//                the combine's handle), comb_rows [Tmax][K] rows of
//                comb_row_stride (the source's pair (t, k) at row t*K + k).
//   staging      (the runtime's region only) this rank's own source rows for
//                NVSHMEM puts (a put to a network PE reads symmetric memory,
//                and its source must stay put until the kernel's quiet):
//                disp_stage [Tmax] rows of row_stride (token t at row t, cast
//                once, put to each of its ranks) + disp_stage_scales;
//                comb_stage comb_stage_rows rows of comb_row_stride (the
//                combine send's i-th valid row at row i). One of each, not per
//                parity: a send kernel's puts are complete before it ends, and
//                sends of one op never overlap.
// max_ranks: R for the loopback harness's exact region, kMaxRanks for the
// runtime's (offsets independent of R).
// Double-buffered by call parity: cc/kernels/low_latency.cu says why two suffice.
// A call's rows may be shorter than the strides (the runtime's region is laid
// out once for the widest rows, so a call's format never moves the areas a
// slower peer may still read).
struct LlOpCtrl {
  unsigned int send_epoch;  // last finished send call (local only)
  unsigned int recv_epoch;  // last finished receive call
  unsigned int send_done;   // blocks finished in the current send call
  unsigned int recv_done;   // blocks finished in the current receive call
  unsigned int pad[28];
};
enum LlOp : int { kLlDispatch = 0, kLlCombine = 1 };

struct LlLayout {
  size_t ctrl = 0, disp_count = 0, comb_flag = 0;
  size_t disp_rows[2] = {0, 0}, disp_scales[2] = {0, 0}, disp_info[2] = {0, 0};
  size_t comb_rows[2] = {0, 0};
  size_t disp_stage = 0, disp_stage_scales = 0, comb_stage = 0;  // staging (put transport)
  long long comb_stage_rows = 0;  // rows of comb_stage (0: no staging, P2P only)
  size_t end = 0;  // one past the region (bytes from the buffer start)
  // The shape the areas are laid out for; the kernels read it from here (one
  // source: a call cannot index the region with another shape).
  int L = 0, Tmax = 0, K = 0;
  long long row_bytes = 0, s_row_bytes = 0, comb_row_bytes = 0;        // this call's rows
  long long row_stride = 0, s_row_stride = 0, comb_row_stride = 0;     // the areas' rows
};

// Rows a rank's combine send may stage: one per row it received, at most
// Tmax * min(K, L) from each source (a token names an expert once), so
// R * Tmax * min(K, L) <= min(E, kMaxRanks * K) * Tmax: a bound for every R.
inline long long ll_comb_stage_rows(int E, int Tmax, int K) {
  const long long by_k = static_cast<long long>(kMaxRanks) * K;
  return (E < by_k ? E : by_k) * Tmax;
}

// The layout with explicit strides; row sizes are set by the callers below.
// stage: with the put transport's staging areas.
inline LlLayout ll_layout_strided(size_t base, int R, int L, int Tmax, int K, int max_ranks,
                                  long long row_stride, long long s_row_stride,
                                  long long comb_row_stride, bool stage) {
  LlLayout y;
  y.L = L;
  y.Tmax = Tmax;
  y.K = K;
  y.row_stride = row_stride;
  y.s_row_stride = s_row_stride;
  y.comb_row_stride = comb_row_stride;
  const size_t pairs = size_t(L) * size_t(R) * size_t(Tmax);   // output rows (info words)
  const size_t rows = size_t(max_ranks) * size_t(Tmax);        // token rows received
  size_t o = align_up(base);
  y.ctrl = o;
  o = align_up(o + 2 * sizeof(LlOpCtrl));
  y.disp_count = o;
  o = align_up(o + 2 * size_t(L) * size_t(R) * sizeof(unsigned long long));
  y.comb_flag = o;
  o = align_up(o + 2 * size_t(max_ranks) * sizeof(unsigned long long));
  for (int p = 0; p < 2; ++p) {
    y.disp_rows[p] = o;
    o = align_up(o + rows * size_t(row_stride));
    y.disp_scales[p] = o;
    o = align_up(o + rows * size_t(s_row_stride));
    y.disp_info[p] = o;
    o = align_up(o + pairs * sizeof(int32_t));
    y.comb_rows[p] = o;
    o = align_up(o + size_t(Tmax) * size_t(K) * size_t(comb_row_stride));
  }
  if (stage) {
    y.comb_stage_rows = ll_comb_stage_rows(L * R, Tmax, K);
    y.disp_stage = o;
    o = align_up(o + size_t(Tmax) * size_t(row_stride));
    y.disp_stage_scales = o;
    o = align_up(o + size_t(Tmax) * size_t(s_row_stride));
    y.comb_stage = o;
    o = align_up(o + size_t(y.comb_stage_rows) * size_t(comb_row_stride));
  }
  y.end = o;
  return y;
}

// A region laid out for exactly these rows (the loopback harness: one format
// per run; staging only in its put mode, cc/testing/loopback_put.h).
inline LlLayout ll_layout(size_t base, int R, int L, int Tmax, int K, long long row_bytes,
                          long long s_row_bytes, long long comb_row_bytes, bool stage = false) {
  LlLayout y = ll_layout_strided(base, R, L, Tmax, K, R, row_bytes, s_row_bytes, comb_row_bytes,
                                 stage);
  y.row_bytes = row_bytes;
  y.s_row_bytes = s_row_bytes;
  y.comb_row_bytes = comb_row_bytes;
  return y;
}

// Bytes of the low-latency region for R ranks, E experts, Tmax tokens, top-K,
// dispatch rows of row_bytes (+ s_row_bytes of fp8 scales), combine rows of
// comb_row_bytes: 2 x (R * Tmax dispatch rows + E * Tmax info words + Tmax * K
// combine rows) + control
// (the loopback harness's region; stage: with the put staging).
inline size_t ll_region_bytes(int R, int E, int Tmax, int K, long long row_bytes,
                              long long s_row_bytes, long long comb_row_bytes,
                              bool stage = false) {
  return ll_layout(0, R, R > 0 ? E / R : 0, Tmax, K, row_bytes, s_row_bytes, comb_row_bytes,
                   stage).end;
}

// The runtime's region (jax_ep.initialize(low_latency=config)), laid out once
// for its shape s and the widest rows of each area: bf16 dispatch rows (fp8
// rows are shorter), per-128 f32 scales, f32 combine rows; flag words for
// kMaxRanks; the put transport's staging. Offsets depend on s only, never on
// R or a call's formats: every area keeps its place from call to call
// (kMaxRanks * Tmax dispatch rows, E * Tmax info words, whatever R).
inline LlLayout ll_region_layout(size_t base, int R, const LlShape& s, long long row_bytes,
                                 long long s_row_bytes, long long comb_row_bytes) {
  const long long H = s.hidden;
  LlLayout y = ll_layout_strided(base, R, R > 0 ? s.E / R : 0, s.Tmax, s.K, kMaxRanks, 2 * H,
                                 H / 128 * 4, 4 * H, true);
  y.row_bytes = row_bytes;
  y.s_row_bytes = s_row_bytes;
  y.comb_row_bytes = comb_row_bytes;
  return y;
}

// Why a call's rows do not fit the region's strides ("" when they do).
inline const char* ll_rows_error(const LlLayout& y) {
  if (y.row_bytes > y.row_stride) return "dispatch rows wider than the region's (bf16 / fp8 rows)";
  if (y.s_row_bytes > y.s_row_stride) return "scale rows wider than the region's";
  if (y.comb_row_bytes > y.comb_row_stride) return "combine rows wider than the region's (f32)";
  return "";
}

// Bytes of the runtime's low-latency region for shape s (0 when s.E == 0).
inline size_t ll_region_size(const LlShape& s) {
  return s.E > 0 ? ll_region_layout(0, 1, s, 0, 0, 0).end : 0;
}

}  // namespace jax_ep
