// Process-level native runtime: the symmetric buffer(s) and peer tables.
//
// Contract between the runtime (runtime/runtime.cu, nanobind module) and the
// kernels / FFI handlers (each family folder's kernels and FFI handlers). Two transports fill the
// same PeerTable (docs/transports.md):
//  * NVSHMEM: one GPU per process, a process is one PE; the EP group reaches
//    each FFI call as the list of its PEs (attribute);
//  * peer memory: one process drives several GPUs; one plain buffer per GPU
//    (cudaMalloc, peer access enabled between all of them), and the EP group
//    is the list of its CUDA device ordinals; a call finds its own position
//    from the device XLA runs it on (ffi::DeviceOrdinal).
// Either way an EP axis that is a sub-axis of a larger mesh works: kernels
// index peers by position in the group.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/regions.h"

namespace jax_ep {

constexpr int kMaxRanks = 8;  // NVLink P2P group size handled by the kernels

// Everything a kernel needs to reach the other ranks; passed by value.
struct PeerTable {
  int rank = 0;        // position of this process in the EP group
  int num_ranks = 0;   // R
  // Base of the symmetric buffer on each group member, mapped into this
  // process (nvshmem_ptr). peers[rank] is the local buffer. Null only where a
  // caller allowed unmapped members (the low-latency kernels, which reach
  // those by NVSHMEM puts).
  void* peers[kMaxRanks] = {};
  // NVSHMEM PE of each member (the puts' target); 0 with peer memory, which
  // has no PEs and maps every member.
  int pe[kMaxRanks] = {};
  // How a put names byte off of member r (put_target, transport/nvshmem_put.cuh).
  // 0: the caller's own address of it (peers[rank] + off: one symmetric
  // buffer per PE, NVSHMEM's naming). 1: peers[r] + off on pe[r] (the
  // loopback harness: every member's buffer a separate object of one PE's
  // symmetric heap, so its put path runs on one GPU).
  int put_at_peer = 0;
};

enum class Transport : int { kNvshmem = 0, kPeerMemory = 1 };

constexpr int kMaxDevices = 16;  // local GPUs of one process (peer-memory transport)

struct Runtime {
  Transport transport = Transport::kNvshmem;
  int my_pe = -1;
  int n_pes = 0;
  void* sym_base = nullptr;   // NVSHMEM: nvshmem_malloc'd, same offset on every PE
  // The buffer's regions (runtime/regions.h), indexed by RegionKind; every
  // PE / device lays them out alike. The normal region is [0, its bytes).
  BufferRegion regions[kNumRegionKinds];
  int device = -1;            // NVSHMEM: CUDA device of this process
  int num_sms = 0;            // multiprocessors of `device` (of the first device: peer memory)
  // Peer memory: the process's GPUs, by CUDA ordinal, and each one's buffer.
  int num_devices = 0;
  int ordinals[kMaxDevices] = {};
  void* dev_base[kMaxDevices] = {};
  int dev_sms[kMaxDevices] = {};

  // PeerTable for the EP group given in group order as PEs (NVSHMEM) or CUDA
  // ordinals (peer memory), seen from this process's PE / from device
  // `device_ordinal`. Returns false (and fills *err) when this caller is not
  // in the group, or a member is not reachable by P2P unless allow_unmapped
  // (then its peers[] entry is null).
  bool peer_table(const int32_t* group, int group_size, int device_ordinal, PeerTable* out,
                  const char** err, bool allow_unmapped = false) const;
  // Who the caller on device_ordinal is in ep_groups' terms: its PE (NVSHMEM)
  // or the ordinal itself (peer memory).
  int member_id(int device_ordinal) const {
    return transport == Transport::kNvshmem ? my_pe : device_ordinal;
  }
  // Multiprocessors of the caller's device.
  int sms_of(int device_ordinal) const;
  const BufferRegion& region(RegionKind k) const { return regions[k]; }
};

// The live runtime or nullptr when jax_ep.initialize() has not been called.
Runtime* runtime();

// Message every FFI handler returns when runtime() is nullptr.
constexpr const char* kNotInitialized =
    "jax_ep native runtime is not initialised in this process: call "
    "jax_ep.initialize() (after jax.distributed.initialize) before using "
    "backend='native'";

}  // namespace jax_ep
