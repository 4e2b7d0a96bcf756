// Host side of launch_config.h.
#include "intranode/launch_config.h"

#include "common/launch.h"

namespace jax_ep {

LaunchConfig make_launch_config(OpKind op, int num_tokens, int num_sms_requested, int device_sms,
                                int chunk) {
  LaunchConfig lc;
  int sms = sm_budget(num_sms_requested, device_sms);
  if (sms < 1) sms = 1;
  lc.send_warps = 8;
  lc.recv_warps = 8;
  // Tokens per chunk: fewer when T is small, so that every block gets work.
  // Dispatch: one per sender warp (8). Combine: 4 (two warps per row), since
  // its receive side (the K-row f32 reduce) is the longer tail after the last
  // byte lands and smaller waves shorten it (measured on 2x H200, V3-train:
  // combine faster at chunk 4, dispatch equal or slower; bench/results/README.md).
  // Smaller chunks pay one publish each.
  if (chunk <= 0) {
    const int max_chunk = op == kOpCombine ? 4 : lc.send_warps;
    chunk = (num_tokens + sms - 1) / sms;
    if (chunk > max_chunk) chunk = max_chunk;
    if (chunk < 1) chunk = 1;
  }
  lc.chunk = chunk;
  lc.slices = slices_for_chunk(chunk, lc.send_warps);
  lc.num_blocks = sms < kMaxBlocks ? sms : kMaxBlocks;
  return lc;
}

bool fit_ring(LaunchConfig* lc, int R, int T, long long row_bytes, long long s_row_bytes,
              size_t half) {
  while (true) {
    const int G = lc->num_blocks;
    const int per_block = chunks_per_block(T, lc->chunk, G);
    lc->depth = ring_depth(R, T, G, lc->chunk, row_bytes, s_row_bytes, half);
    const int want = per_block < 2 ? per_block : 2;
    if (lc->depth >= want || lc->chunk == 1) return lc->depth >= 1;
    lc->chunk /= 2;
    lc->slices = slices_for_chunk(lc->chunk, lc->send_warps);
  }
}

std::string plan_launch(OpKind op, int R, int T, int num_sms_requested, int device_sms,
                        int chunk, long long row_bytes, long long s_row_bytes, size_t sym_bytes,
                        LaunchConfig* lc) {
  *lc = make_launch_config(op, T > 0 ? T : 1, num_sms_requested, device_sms, chunk);
  const size_t half = stage_half_bytes(sym_bytes);
  // Rings wrap at any R (1x H200 loopback: R = 2 and R = 8 with a
  // tiny ring bit-exact to the reference), so the default buffer runs any T.
  if (fit_ring(lc, R, T, row_bytes, s_row_bytes, half)) return "";
  const std::string what = "one ring slot of one row per (peer, block)";
  return "the symmetric buffer's staging (" + std::to_string(half >> 20) +
         " MiB per parity) cannot hold " + what + " for rows of " +
         std::to_string(row_bytes + s_row_bytes) + " bytes, T = " + std::to_string(T) + ", " +
         std::to_string(R) + " ranks and " + std::to_string(lc->num_blocks) +
         " blocks: pass a larger buffer_bytes to jax_ep.initialize()";
}

}  // namespace jax_ep
