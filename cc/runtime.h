// Process-level native runtime: NVSHMEM bootstrap and the symmetric buffer.
//
// Contract between the runtime (cc/runtime.cu, nanobind module) and the
// kernels / FFI handlers (cc/kernels/*, cc/ffi_*.cc). One GPU per process: a
// process is one NVSHMEM PE. The EP group is given to each FFI call as the
// list of its PEs (attribute), so an EP axis that is a sub-axis of a larger
// mesh works: kernels index peers by position in the group, not by PE.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jax_ep {

constexpr int kMaxRanks = 8;  // NVLink P2P group size handled by the kernels

// Everything a kernel needs to reach the other ranks; passed by value.
struct PeerTable {
  int rank = 0;        // position of this process in the EP group
  int num_ranks = 0;   // R
  // Base of the symmetric buffer on each group member, mapped into this
  // process (nvshmem_ptr). peers[rank] is the local buffer.
  void* peers[kMaxRanks] = {};
};

struct Runtime {
  int my_pe = -1;
  int n_pes = 0;
  void* sym_base = nullptr;   // nvshmem_malloc'd, same offset on every PE
  size_t sym_bytes = 0;
  int device = -1;            // CUDA device of this process
  int num_sms = 0;            // multiprocessors on that device

  // PeerTable for the EP group given as a list of PEs (in group order).
  // Returns false (and fills *err) when a PE is not reachable by P2P.
  bool peer_table(const int32_t* group_pes, int group_size, PeerTable* out,
                  const char** err) const;
};

// The live runtime or nullptr when jax_ep.initialize() has not been called.
Runtime* runtime();

// Message every FFI handler returns when runtime() is nullptr.
constexpr const char* kNotInitialized =
    "jax_ep native runtime is not initialised in this process: call "
    "jax_ep.initialize() (after jax.distributed.initialize) before using "
    "backend='native'";

}  // namespace jax_ep
