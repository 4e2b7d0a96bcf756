// The test build's side of common/testing_hooks.h.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common/testing_hooks.h"

namespace jax_ep {

bool debug_poison() {
  static const bool on = [] {
    const char* v = std::getenv("JAX_EP_DEBUG_POISON");
    return v && std::strcmp(v, "0") != 0 && v[0] != 0;
  }();
  return on;
}

namespace {
std::atomic<int> g_skip{0};
}  // namespace

int debug_skip() { return g_skip.load(std::memory_order_relaxed); }
void set_debug_skip(int skip) { g_skip.store(skip, std::memory_order_relaxed); }

}  // namespace jax_ep
