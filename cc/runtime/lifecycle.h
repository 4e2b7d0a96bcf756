// Process-level lifecycle of the native runtime, driven from Python
// (jax_ep/runtime.py through jax_ep._C). All functions throw
// std::runtime_error with a readable message on failure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep {

// nvshmemx_init_status(): 0 = not initialised, 1 = bootstrapped, >= 2 = initialised.
int nvshmem_status();
// Rank 0's NVSHMEM unique id, as raw bytes (shared through JAX's KV store).
std::string nvshmem_unique_id();
// Initialise NVSHMEM on CUDA `device` as PE `rank` of `nranks` with rank 0's id.
// When NVSHMEM is already initialised in the process (e.g. by XLA), attaches to
// it instead (returns false: "not owned", never finalised by us).
bool nvshmem_init(const std::string& uid, int rank, int nranks, int device);
// Collective: allocate the symmetric buffer (bytes for the normal mode, then
// the low-latency region for `ll` when ll.E > 0, then the internode region
// for `inter` when inter.nodes > 1, then the ragged region for `ragged` when
// ragged.area_kib > 0) and publish the Runtime.
struct LlShape;
struct InterShape;
struct RaggedShape;
void runtime_attach(int device, size_t bytes, const LlShape& ll, const InterShape& inter,
                    const RaggedShape& ragged);
// Peer-memory transport (one process, several GPUs): a zeroed buffer of
// `bytes` on every CUDA device in `ordinals`, peer access between all pairs,
// and the Runtime published. No NVSHMEM.
void peer_memory_attach(const std::vector<int>& ordinals, size_t bytes, const LlShape& ll,
                        const InterShape& inter, const RaggedShape& ragged);
// Collective (NVSHMEM) / local (peer memory): free the buffer(s); runtime()
// becomes nullptr.
void runtime_detach();
// Free bytes on CUDA `device` (cudaMemGetInfo), to size-check the heap.
size_t device_free_bytes(int device);
// Collective: nvshmem_finalize().
void nvshmem_fini();

}  // namespace jax_ep
