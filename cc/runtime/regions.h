// The symmetric buffer is a sequence of regions, one per kernel family that
// has one (the normal region first, at byte 0), each starting at a
// kRegionAlign boundary.
#pragma once

#include <cstddef>

namespace jax_ep {

constexpr size_t kRegionAlign = 256;

inline size_t align_up(size_t n) { return (n + kRegionAlign - 1) & ~(kRegionAlign - 1); }

}  // namespace jax_ep
