// Put mode of the loopback harnesses (tests only): the kernels' NVSHMEM put
// path on ONE GPU. This process is the only PE (the test initialises NVSHMEM
// with one rank), every emulated rank's stand-in symmetric buffer is a
// separate object of its heap (loopback_sym_alloc), and the peer table names
// a put's target by that rank's buffer on PE 0 (PeerTable::put_at_peer). The
// puts, signals, quiets and tests run for real; only their ordering across a
// link is not exercised (every byte stays on this GPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/runtime.h"

namespace jax_ep {

// A zeroed buffer of `bytes` from the NVSHMEM symmetric heap (nvshmem_malloc:
// collective, so one PE only). Throws when NVSHMEM is down or the heap is full.
uint64_t loopback_sym_alloc(size_t bytes);
void loopback_sym_free(uint64_t ptr);

// Turns rank tables of the loopback harness into put tables: "" when every
// member's buffer lies in an allocation of loopback_sym_alloc of at least
// sym_bytes (then put_at_peer = 1, every pe = 0), else the reason.
std::string loopback_put_peers(PeerTable* p, size_t sym_bytes);

}  // namespace jax_ep
