// How often an FFI handler ran while XLA was capturing its stream into a CUDA
// graph (a command buffer): the test of whether XLA really captures jax_ep's
// custom calls (the compiled HLO does not show it: XLA builds command buffers
// from the thunk sequence). One cudaStreamIsCapturing per call.
#pragma once

#include <cuda_runtime.h>

namespace jax_ep {

void note_graph_capture(cudaStream_t stream);  // counts the call when `stream` is capturing
long long graph_capture_count();              // calls counted so far in this process

}  // namespace jax_ep
