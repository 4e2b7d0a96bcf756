// Loopback harness of the internode (hierarchical) kernels (tests only): R
// ranks on ONE GPU, as cc/testing/loopback.h does for the intranode kernels,
// grouped into `nodes` emulated nodes of R / nodes consecutive ranks (the
// config that says "treat these ranks as nodes"). Both legs are P2P stores
// into the other ranks' stand-in buffers on the same device (HBM standing in
// for NVLink and for the network).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep {

// Arguments: exactly loopback_dispatch's / loopback_combine's (the names
// kLoopbackDispatchPtrs / Ints, kLoopbackCombinePtrs / Ints, jax_ep._C.LOOPBACK_*)
// with three more ints at the end of ints: `nodes` (N, dividing R), `put`
// (1: the network leg by NVSHMEM puts, every rank's "sym" buffer from
// loopback_sym_alloc: cc/testing/loopback_put.h) and `layout_T` (> 0: the
// runtime's fixed-T layout, internode_region_bytes(N, R, layout_T, H), on
// which calls of any T share one buffer, as windows of layout_T tokens when
// longer; 0: laid out per call).
// Each rank's "sym" buffer holds the internode region from byte 0, zeroed
// before the first call; with layout_T 0 it must be internode_buffer_bytes(N,
// R / N, T, ...) large and is used with one (N, T) only (its flags are laid
// out for them).
// chunk <= 0: the default. Dispatch modes: copy (with or without given
// scales) and the fp8 casts; zero_tail / align as loopback_dispatch.
std::string loopback_inter_dispatch(const std::vector<uint64_t>& ptrs,
                                    const std::vector<int64_t>& ints, size_t sym_bytes,
                                    int num_ranks, int iters, double* seconds);
std::string loopback_inter_combine(const std::vector<uint64_t>& ptrs,
                                   const std::vector<int64_t>& ints, size_t sym_bytes,
                                   int num_ranks, int iters, double* seconds);

}  // namespace jax_ep
