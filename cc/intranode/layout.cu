#include "intranode/layout.h"

#include "common/launch.h"

namespace jax_ep {
namespace {

constexpr int kThreads = 256;
// Histograms up to this many bins are accumulated in shared memory first.
constexpr int kMaxSmemBins = 8192;

// One thread per token. A slot counts only if no earlier slot of the same
// token hit the same expert (per-expert count) / rank (per-rank count): K is
// small (<= ~16), so the quadratic scan is cheaper than any bookkeeping.
__global__ void layout_kernel(const int32_t* __restrict__ topk_idx, int64_t T, int K, int E, int R,
                              int L, bool use_smem, int32_t* __restrict__ per_rank,
                              int32_t* __restrict__ per_expert, bool* __restrict__ in_rank) {
  extern __shared__ int32_t hist[];  // [E] experts then [R] ranks
  int32_t* h_exp = use_smem ? hist : per_expert;
  int32_t* h_rank = use_smem ? hist + E : per_rank;
  if (use_smem) {
    for (int i = threadIdx.x; i < E + R; i += blockDim.x) hist[i] = 0;
    __syncthreads();
  }
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < T;
       t += (int64_t)gridDim.x * blockDim.x) {
    const int32_t* row = topk_idx + t * K;
    bool* mask = in_rank + t * R;
    for (int r = 0; r < R; ++r) mask[r] = false;
    for (int k = 0; k < K; ++k) {
      int e = row[k];
      if (e < 0 || e >= E) continue;
      bool new_expert = true, new_rank = true;
      for (int j = 0; j < k; ++j) {
        int f = row[j];
        if (f < 0 || f >= E) continue;
        new_expert &= f != e;
        new_rank &= f / L != e / L;
      }
      if (new_expert) atomicAdd(&h_exp[e], 1);
      if (new_rank) {
        atomicAdd(&h_rank[e / L], 1);
        mask[e / L] = true;
      }
    }
  }
  if (use_smem) {
    __syncthreads();
    for (int i = threadIdx.x; i < E; i += blockDim.x)
      if (hist[i]) atomicAdd(&per_expert[i], hist[i]);
    for (int i = threadIdx.x; i < R; i += blockDim.x)
      if (hist[E + i]) atomicAdd(&per_rank[i], hist[E + i]);
  }
}

}  // namespace

cudaError_t launch_layout(const int32_t* topk_idx, int64_t T, int64_t K, int32_t E, int32_t R,
                          int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                          bool* is_token_in_rank, cudaStream_t stream) {
  // Memsets are stream-ordered and capturable (graph-safe).
  cudaError_t e = cudaMemsetAsync(tokens_per_rank, 0, sizeof(int32_t) * R, stream);
  if (e == cudaSuccess) e = cudaMemsetAsync(tokens_per_expert, 0, sizeof(int32_t) * E, stream);
  if (e != cudaSuccess || T == 0) return e;
  bool use_smem = E + R <= kMaxSmemBins;
  size_t smem = use_smem ? sizeof(int32_t) * (E + R) : 0;
  int64_t blocks = (T + kThreads - 1) / kThreads;
  if (blocks > 1024) blocks = 1024;
  return launch({static_cast<int>(blocks), kThreads, smem, stream}, layout_kernel, topk_idx, T,
                static_cast<int>(K), E, R, E / R, use_smem, tokens_per_rank, tokens_per_expert,
                is_token_in_rank);
}

}  // namespace jax_ep
