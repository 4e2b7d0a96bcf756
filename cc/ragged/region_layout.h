// The ragged all-to-all's region (the runtime's region of kind kRegionRagged,
// jax_ep.initialize(ragged_bytes=B)): its shape and byte layout.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/regions.h"
#include "runtime/runtime.h"

namespace jax_ep {

// Slices per destination rank a call may have (S; the offsets and sizes have
// K = R * S entries). Bounds the slice words and the kernel's shared scan
// ((K + 1) * 8 bytes <= 32 KiB).
constexpr int kRaggedMaxSlices = 512;

// Shape of the region: bytes of each of its three areas (B rounded up to
// KiB; the shape is four int32s, so it counts KiB). area_kib == 0: no region.
struct RaggedShape {
  int area_kib = 0;
  long long area_bytes() const { return static_cast<long long>(area_kib) * 1024; }
  RegionShape dims() const { return {area_kib, 0, 0, 0}; }
  static RaggedShape of(const RegionShape& d) { return {d[0]}; }
};

// Local counters of the op (this rank only).
struct RaggedCtrl {
  unsigned int epoch;      // last finished call
  unsigned int send_done;  // blocks past the send phase of the current call
  unsigned int recv_done;  // blocks past the receive phase of the current call
  unsigned int pad[29];
};

// From byte `base`, every offset the same on every rank:
//   ctrl    RaggedCtrl
//   flags   u64 [2 parity][kMaxRanks]: sender s's "every row and word of this
//           call is here" tag
//   words   int2 [2 parity][kMaxRanks][kRaggedMaxSlices]: sender s's slice k
//           to this rank: (output row it starts at, rows; -1: past a buffer)
//   area    [2 parity] x area bytes: the image of this rank's output, each
//           received row at its own output row
//   stage   area bytes: the image of this rank's operand, the rows it sends
//           by NVSHMEM puts (a put reads symmetric memory). One, not per
//           parity: a call's puts complete before its signals.
// Two parities: a sender's call e + 2 into this rank's area follows its call
// e + 1, which waited for this rank's signal of e + 1, sent after this rank
// finished copying call e out (ragged/kernels.cu).
struct RaggedLayout {
  size_t ctrl = 0, flags = 0, words = 0, area[2] = {0, 0}, stage = 0, end = 0;
  long long area_bytes = 0;
};

inline RaggedLayout ragged_region_layout(size_t base, const RaggedShape& s) {
  RaggedLayout y;
  y.area_bytes = s.area_bytes();
  size_t o = align_up(base);
  y.ctrl = o;
  o = align_up(o + sizeof(RaggedCtrl));
  y.flags = o;
  o = align_up(o + 2 * size_t(kMaxRanks) * sizeof(unsigned long long));
  y.words = o;
  o = align_up(o + 2 * size_t(kMaxRanks) * kRaggedMaxSlices * 2 * sizeof(int32_t));
  for (int p = 0; p < 2; ++p) {
    y.area[p] = o;
    o = align_up(o + size_t(y.area_bytes));
  }
  y.stage = o;
  o = align_up(o + size_t(y.area_bytes));
  y.end = o;
  return y;
}

// Bytes of the runtime's ragged region of shape s (0 when s.area_kib == 0).
inline size_t ragged_region_size(const RaggedShape& s) {
  return s.area_kib > 0 ? ragged_region_layout(0, s).end : 0;
}

}  // namespace jax_ep
