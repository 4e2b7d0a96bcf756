// The low-latency region's layout (the runtime's region of that kind,
// runtime/regions.h, or the loopback harness's exact region).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "runtime/regions.h"
#include "runtime/runtime.h"

namespace jax_ep {

// Shape of the low-latency (decode) region (jax_ep.initialize(low_latency=
// config)): experts, max tokens per rank, top-k, hidden. E == 0: no region.
struct LlShape {
  int E = 0, Tmax = 0, K = 0, hidden = 0;
  RegionShape dims() const { return {E, Tmax, K, hidden}; }
  static LlShape of(const RegionShape& d) { return {d[0], d[1], d[2], d[3]}; }
};

// The shape the runtime's low-latency region was laid out for.
inline LlShape ll_region_shape(const Runtime& rt) {
  return LlShape::of(rt.region(kRegionLowLatency).shape);
}

// Low-latency (decode) mode: its own region (docs/low_latency.md).
// From byte `base`, every offset the same on every rank:
//   ctrl         LlOpCtrl[2]: dispatch, combine (local counters)
//   disp_count   u64 [2 parity][L][R]: source s's tagged count for (l, s)
//   comb_flag    u64 [2 parity][max_ranks]: expert rank r's "all my rows to you" word
//   per parity:  disp_rows [max_ranks][Tmax] rows of row_stride bytes: source s's
//                token t at row s*Tmax + t, ONE copy per (token, rank) whatever
//                the number of its experts there (the receive kernel replicates
//                it to each expert's output row), disp_scales (s_row_stride
//                each, same rows), disp_info int32 [L][R][Tmax] (t*K + k of
//                source s's pair in slot `slot` of expert l: which token row to
//                copy, and the combine's handle), comb_rows [Tmax][K] rows of
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
// Double-buffered by call parity: low_latency/kernels.cu says why two suffice.
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
