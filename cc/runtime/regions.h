// The symmetric buffer as a list of regions, one per kind, in buffer order:
// the normal region at byte 0 (the ring kernels: intranode/ring_layout.h),
// then each family that has its own region, each at the next kRegionAlign
// boundary after the last non-empty one (the earlier regions' offsets never
// move). A new kernel family with its own region adds a kind here and sizes
// it in runtime/runtime.cu (lay_out_regions).
#pragma once

#include <array>
#include <cstddef>

namespace jax_ep {

constexpr size_t kRegionAlign = 256;

inline size_t align_up(size_t n) { return (n + kRegionAlign - 1) & ~(kRegionAlign - 1); }

enum RegionKind : int {
  kRegionNormal = 0,      // intranode ring staging + control words
  kRegionLowLatency = 1,  // low_latency/region_layout.h (LlShape)
  kRegionInternode = 2,   // internode/region_layout.h (InterShape)
  kRegionRagged = 3,      // ragged/region_layout.h (RaggedShape)
  kNumRegionKinds = 4,
};

// The numbers a region is laid out for, in its family's order (LlShape,
// InterShape, RaggedShape); all zero for the normal region.
using RegionShape = std::array<int, 4>;

struct BufferRegion {
  size_t off = 0;    // byte offset in every rank's buffer (same on all)
  size_t bytes = 0;  // 0: the runtime has no such region
  RegionShape shape = {0, 0, 0, 0};
};

}  // namespace jax_ep
