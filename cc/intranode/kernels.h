// Host interface of the intranode (NVLink P2P) dispatch and combine kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/device_error.h"
#include "intranode/launch_config.h"
#include "intranode/ring_layout.h"
#include "jax_ep_abi.h"
#include "runtime/runtime.h"

namespace jax_ep {

// Dispatch: rows of x [T, *] move to the ranks in send_mask and land in
// out [C, *] at the rows the handle names (slot_row [R, T, K]). Rows whose
// row_src is -1 are zeroed when they pad a group (the a-block of `align` rows
// that holds them starts with a valid row: groups start at multiples of
// align, so only a group's last block has padding), and the tail rows past
// the last group only with zero_tail (else left as they were: at EP 2 /
// V3-train they are half of the dropless capacity, ~470 MB of writes).
// Optionally a second row stream (fp8 scales).
// DispatchMode (copy / fp8 casts / fused combine backward) and RowDtype come
// from jax_ep/abi.py, the one source of the codes (generated jax_ep_abi.h).


struct DispatchArgs {
  PeerTable peers;
  size_t ctrl_off = 0;
  size_t stage_off[2] = {0, 0};  // parity halves (same offset on every rank)
  size_t stage_scales_off = 0;   // scale rows inside a half
  const void* x = nullptr;
  long long x_row_bytes = 0;     // input row bytes (x)
  long long row_bytes = 0;       // staged / output row bytes of stream 0
  const void* scales = nullptr;  // [T, S] f32 or nullptr (copy mode)
  long long s_row_bytes = 0;     // scale row bytes (0: no second stream)
  void* out = nullptr;
  void* out_scales = nullptr;
  const int32_t* row_src = nullptr;   // [C]
  const int32_t* slot_row = nullptr;  // [R, T, K]
  const bool* send_mask = nullptr;    // [T, R]
  int T = 0, K = 0, C = 0;
  int hidden = 0;                // elements per row (cast modes)
  int mode = kDispatchCopy;
  bool rank_major = false;       // one output row per (s, t): use slot k = 0
  int align = 1;                 // expert_alignment (expert_major; 1 for rank_major)
  bool zero_tail = true;         // also zero the rows past the last group
  // kDispatchCombineBwd only: y [C, W] and w [C] in, dw [C] out; dtype of x / y / out.
  const void* y = nullptr;
  const float* row_w = nullptr;
  float* dw = nullptr;
  int dtype = 0;                 // RowDtype
  // Bench breakdown, test build only (common/testing_hooks.h debug_skip(); 0
  // otherwise): bit0 no data sends, bit1 no local gather.
  int skip = 0;
  // The fp8 cast's scale rule (Fp8ScaleMode, jax_ep/abi.py; the
  // fp8_scale_mode FFI attribute): 448/amax as XLA's GPU division rounds it
  // (div.full.f32, the default), as an IEEE division
  // (EpConfig.tuning.fp8_ieee_division), or power-of-two UE8M0 scales
  // (EpConfig.fp8_scale_format). The cast moves 16 elements per lane with one
  // 16-byte store each (the NVLink send is store-bound).
  int scale_mode = kFp8ScaleXlaGpu;
  int* host_err = nullptr;
  unsigned long long timeout_ns = kDefaultTimeoutNs;
};

struct CombineArgs {
  PeerTable peers;
  size_t ctrl_off = 0;
  size_t stage_off[2] = {0, 0};
  const void* y = nullptr;            // [C, W]
  long long row_bytes = 0;
  int W = 0;
  int dtype = kBf16;
  const float* row_weights = nullptr; // [C] or nullptr (= 1)
  const int32_t* slot_row = nullptr;  // [R, T, K]
  const int32_t* recv_local_idx = nullptr;  // [R, T, K]
  const bool* send_mask = nullptr;    // [T, R]
  void* out = nullptr;                // [T, W]
  int T = 0, K = 0, C = 0;
  bool rank_major = false;
  int skip = 0;                       // as DispatchArgs::skip
  int* host_err = nullptr;
  unsigned long long timeout_ns = kDefaultTimeoutNs;
};

cudaError_t launch_dispatch(const DispatchArgs& a, const LaunchConfig& lc, cudaStream_t stream);
cudaError_t launch_combine(const CombineArgs& a, const LaunchConfig& lc, cudaStream_t stream);

}  // namespace jax_ep
