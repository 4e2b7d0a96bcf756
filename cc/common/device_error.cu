// Host side of device_error.h: the host-mapped error words the kernels raise
// (a spin timeout, a bad argument), one per op family. Reading them needs no
// stream sync: the next FFI call of this process sees an error and fails with
// a clear message instead of hanging.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <iterator>
#include <mutex>

#include "common/device_error.h"

namespace jax_ep {

namespace {
constexpr int kWords = static_cast<int>(ErrorOp::kCount);
// [first, op 0, op 1, ...] in one 64-byte block: word 0 holds the first error
// raised, encoded (device_error.h), and sync.cuh finds it by aligning a
// family's word down to 64 bytes
static_assert((kWords + 1) * sizeof(int) <= 64, "the error words fill one 64-byte block");
std::once_flag g_once;
int* g_host = nullptr;
int* g_dev = nullptr;

void map_words() {
  std::call_once(g_once, [] {
    void* h = nullptr;   // 128 bytes: room to start the block at a 64-byte device address
    if (cudaHostAlloc(&h, 128, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    void* d = nullptr;
    if (cudaHostGetDevicePointer(&d, h, 0) != cudaSuccess) {
      cudaGetLastError();
      cudaFreeHost(h);
      return;
    }
    const size_t shift = (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64;
    g_host = reinterpret_cast<int*>(static_cast<char*>(h) + shift);
    g_dev = reinterpret_cast<int*>(static_cast<char*>(d) + shift);
    for (int i = 0; i <= kWords; ++i) g_host[i] = 0;
  });
}

volatile int& word(int i) { return reinterpret_cast<volatile int*>(g_host)[i]; }

// The first family's word set, encoded; 0 if none.
int scan_families() {
  for (int op = 0; op < kWords; ++op)
    if (int v = word(1 + op)) return (v & 0xff) | (op << 8);
  return 0;
}

// The error to report: the first raised (word 0), else a family's word that
// a race left without it; 0 if none.
int current_error() {
  if (!g_host) return 0;
  const int first = word(0);
  return first ? first : scan_families();
}
}  // namespace

const char* error_op_name(int op) {
  static const char* const kNames[] = {"dispatch", "combine", "low-latency dispatch",
                                       "low-latency combine", "ragged_all_to_all", "test"};
  static_assert(std::size(kNames) == kWords, "one name per ErrorOp");
  return op >= 0 && op < kWords ? kNames[op] : "";
}

int* device_error_word(ErrorOp op) {
  map_words();
  return g_dev ? g_dev + 1 + static_cast<int>(op) : nullptr;  // nullptr: kernels only time out
}

int peek_device_error() {
  map_words();   // the words exist (and g_host is set) before anyone reads them
  return current_error();
}

void clear_device_error() {
  map_words();
  if (g_host)
    for (int i = 0; i <= kWords; ++i) word(i) = 0;
}

int take_device_error() {
  const int e = current_error();
  if (!e) return 0;
  for (int op = 0; op < kWords; ++op) word(1 + op) = 0;
  word(0) = 0;
  // A kernel that raised while the words were cleared skipped word 0 (still
  // set then): put its error back there, or the waits would stop giving up.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (const int late = scan_families()) word(0) = late;
  return e;
}

}  // namespace jax_ep
