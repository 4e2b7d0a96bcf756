// See graph_capture.h.
#include "common/graph_capture.h"

#include <atomic>

namespace jax_ep {

namespace {
std::atomic<long long> g_captured{0};
}

void note_graph_capture(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) == cudaSuccess && st == cudaStreamCaptureStatusActive)
    g_captured.fetch_add(1, std::memory_order_relaxed);
}

long long graph_capture_count() { return g_captured.load(std::memory_order_relaxed); }

}  // namespace jax_ep
