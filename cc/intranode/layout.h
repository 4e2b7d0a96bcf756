// Dispatch layout: per-rank / per-expert token counts and the token->rank mask.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep {

// topk_idx [T, K]; expert e lives on rank e / (E / R). Ids outside [0, E)
// count nowhere; a token counts once per rank and once per expert.
// Enqueues on `stream` only; returns the launch error, if any.
cudaError_t launch_layout(const int32_t* topk_idx, int64_t T, int64_t K, int32_t E, int32_t R,
                          int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                          bool* is_token_in_rank, cudaStream_t stream);

}  // namespace jax_ep
