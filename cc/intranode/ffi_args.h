// Argument checks and kernel-argument filling that the intranode and the
// internode FFI handlers share: both families take the same buffers (the
// dispatch handle, x / out rows, y / out rows), so one parser serves both and
// the two cannot drift apart. Messages start with the op name `o`.
#pragma once

#include <string>

#include "common/ffi_common.h"
#include "intranode/kernels.h"

namespace jax_ep {

// x [T, W] (+ scales [T, S]) -> out [C, W] (+ out_scales [C, S]) of a
// dispatch-kernel call in `mode` (copy, or an fp8 cast with fp8_scale_mode):
// shapes, dtypes and row sizes, into a's row fields (x, out, scales,
// x_row_bytes, row_bytes, s_row_bytes, hidden, mode, rank_major, scale_mode).
ffi::Error DispatchRowArgs(const std::string& o, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scales,
                           ffi::AnyBuffer out, ffi::Buffer<ffi::F32> out_scales, int32_t mode,
                           int32_t rank_major, int32_t fp8_scale_mode, DispatchArgs* a);

// The dispatch handle of R ranks, T tokens, C output rows (slot_row
// [R, T, K], row_src [C], send_mask [T, R]), align, chunk and the peer
// timeout (the timeout_ns attribute, common/ffi_common.h PeerTimeoutNs):
// checked, into a's handle fields (row_src, slot_row, send_mask, T, K, C,
// align, zero_tail, host_err, timeout_ns).
ffi::Error DispatchHandleArgs(const std::string& o, int R, int T, int C,
                              ffi::Buffer<ffi::S32> row_src, ffi::Buffer<ffi::S32> slot_row,
                              ffi::Buffer<ffi::PRED> send_mask, int32_t align, int32_t zero_tail,
                              int32_t chunk, int64_t timeout_ns, DispatchArgs* a);

// y [C, W] -> out [T, W] of a combine over R ranks (slot_row / recv_local_idx
// [R, T, K], send_mask [T, R], row_weights [C] when weighted), chunk and the
// peer timeout (as DispatchHandleArgs): checked, into every field of `a` but
// peers and the staging offsets.
ffi::Error CombineArgsOf(const std::string& o, int R, ffi::AnyBuffer y,
                         ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::S32> slot_row,
                         ffi::Buffer<ffi::S32> recv_local_idx, ffi::Buffer<ffi::PRED> send_mask,
                         ffi::AnyBuffer out, int32_t rank_major, int32_t weighted, int32_t chunk,
                         int64_t timeout_ns, CombineArgs* a);

}  // namespace jax_ep
