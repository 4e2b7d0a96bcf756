// See ffi_args.h.
#include "intranode/ffi_args.h"

namespace jax_ep {

namespace {

// slot_row [R, T, K] of the handle: checked, *K its top-k.
ffi::Error SlotRowArgs(const std::string& o, int R, int T, ffi::Buffer<ffi::S32> slot_row,
                       int* K) {
  auto sd = slot_row.dimensions();
  if (sd.size() != 3 || sd[0] != R || sd[1] != T)
    return InvalidArgument(o + ": slot_row must be [R, T, K] with R = EP group size");
  *K = static_cast<int>(sd[2]);
  if (*K > 32) return InvalidArgument(o + ": top-k above 32 is not supported natively");
  return ffi::Error::Success();
}

}  // namespace

ffi::Error DispatchRowArgs(const std::string& o, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scales,
                           ffi::AnyBuffer out, ffi::Buffer<ffi::F32> out_scales, int32_t mode,
                           int32_t rank_major, int32_t fp8_scale_mode, DispatchArgs* a) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return InvalidArgument(o + ": x must be [T, W]");
  const int T = static_cast<int>(xd[0]);
  const long long W = xd[1];
  auto od = out.dimensions();
  if (od.size() != 2 || od[1] != W) return InvalidArgument(o + ": out must be [C, W]");
  const int C = static_cast<int>(od[0]);
  if (mode != kDispatchCopy && mode != kDispatchCastBf16 && mode != kDispatchCastF32)
    return InvalidArgument(o + ": unknown mode");
  // XLA:GPU's rounding of 448/amax (the default), IEEE division, or UE8M0 scales.
  if (!IsFp8ScaleMode(fp8_scale_mode))
    return InvalidArgument(o + ": fp8_scale_mode must be an Fp8ScaleMode (jax_ep/abi.py)");
  a->x = x.untyped_data();
  a->x_row_bytes = static_cast<long long>(x.size_bytes() / (T > 0 ? T : 1));
  a->row_bytes = static_cast<long long>(out.size_bytes() / (C > 0 ? C : 1));
  a->out = out.untyped_data();
  a->hidden = static_cast<int>(W);
  a->mode = mode;
  a->rank_major = rank_major != 0;
  a->scale_mode = fp8_scale_mode;
  const size_t so_rows = out_scales.element_count();
  a->s_row_bytes = C > 0 ? static_cast<long long>(so_rows / C) * 4 : 0;
  a->out_scales = out_scales.untyped_data();
  if (mode == kDispatchCopy) {
    if (a->x_row_bytes != a->row_bytes) return InvalidArgument(o + ": x and out row sizes differ");
    if (a->s_row_bytes) {
      if (scales.element_count() != static_cast<size_t>(T) * (a->s_row_bytes / 4))
        return InvalidArgument(o + ": scales must be [T, S] matching out_scales [C, S]");
      a->scales = scales.typed_data();
    }
  } else {
    if (W % 128 != 0) return InvalidArgument(o + ": fp8 cast needs hidden % 128 == 0");
    if (out.element_type() != ffi::DataType::F8E4M3FN)
      return InvalidArgument(o + ": fp8 cast output must be float8_e4m3fn");
    const ffi::DataType want = mode == kDispatchCastBf16 ? ffi::DataType::BF16 : ffi::DataType::F32;
    if (x.element_type() != want) return InvalidArgument(o + ": x dtype does not match the cast mode");
    if (a->s_row_bytes != (W / 128) * 4) return InvalidArgument(o + ": out_scales must be [C, H/128]");
  }
  return ffi::Error::Success();
}

ffi::Error DispatchHandleArgs(const std::string& o, int R, int T, int C,
                              ffi::Buffer<ffi::S32> row_src, ffi::Buffer<ffi::S32> slot_row,
                              ffi::Buffer<ffi::PRED> send_mask, int32_t align, int32_t zero_tail,
                              int32_t chunk, int64_t timeout_ns, DispatchArgs* a) {
  int K = 0;
  JAX_EP_RETURN_IF_ERROR(SlotRowArgs(o, R, T, slot_row, &K));
  if (row_src.element_count() != static_cast<size_t>(C))
    return InvalidArgument(o + ": row_src must be [C]");
  if (send_mask.element_count() != static_cast<size_t>(T) * R)
    return InvalidArgument(o + ": send_mask must be [T, R]");
  if (align < 1) return InvalidArgument(o + ": align must be >= 1");
  if (chunk < 0) return InvalidArgument(o + ": chunk must be >= 0 (0: the kernel default)");
  JAX_EP_RETURN_IF_ERROR(PeerTimeoutNs(o, timeout_ns, &a->timeout_ns));
  a->row_src = row_src.typed_data();
  a->slot_row = slot_row.typed_data();
  a->send_mask = send_mask.typed_data();
  a->T = T;
  a->K = K;
  a->C = C;
  a->align = align;
  a->zero_tail = zero_tail != 0;
  a->host_err = device_error_word(ErrorOp::kDispatch);
  return ffi::Error::Success();
}

ffi::Error CombineArgsOf(const std::string& o, int R, ffi::AnyBuffer y,
                         ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::S32> slot_row,
                         ffi::Buffer<ffi::S32> recv_local_idx, ffi::Buffer<ffi::PRED> send_mask,
                         ffi::AnyBuffer out, int32_t rank_major, int32_t weighted, int32_t chunk,
                         int64_t timeout_ns, CombineArgs* a) {
  auto yd = y.dimensions();
  auto od = out.dimensions();
  if (yd.size() != 2 || od.size() != 2 || yd[1] != od[1])
    return InvalidArgument(o + ": y must be [C, W] and out [T, W]");
  if (y.element_type() != out.element_type())
    return InvalidArgument(o + ": out dtype must equal y dtype");
  const int C = static_cast<int>(yd[0]);
  const int T = static_cast<int>(od[0]);
  int K = 0;
  JAX_EP_RETURN_IF_ERROR(SlotRowArgs(o, R, T, slot_row, &K));
  if (recv_local_idx.element_count() != slot_row.element_count())
    return InvalidArgument(o + ": recv_local_idx must be [R, T, K]");
  if (send_mask.element_count() != static_cast<size_t>(T) * R)
    return InvalidArgument(o + ": send_mask must be [T, R]");
  if (weighted && row_weights.element_count() != static_cast<size_t>(C))
    return InvalidArgument(o + ": row_weights must be [C]");
  if (chunk < 0) return InvalidArgument(o + ": chunk must be >= 0 (0: the kernel default)");
  JAX_EP_RETURN_IF_ERROR(PeerTimeoutNs(o, timeout_ns, &a->timeout_ns));
  if (!RowDtypeOf(y.element_type(), &a->dtype))
    return InvalidArgument(o + ": y must be bf16, f16 or f32");
  a->y = y.untyped_data();
  a->W = static_cast<int>(yd[1]);
  a->row_bytes =
      static_cast<long long>(yd[1]) * static_cast<long long>(ffi::ByteWidth(y.element_type()));
  a->row_weights = weighted ? row_weights.typed_data() : nullptr;
  a->slot_row = slot_row.typed_data();
  a->recv_local_idx = recv_local_idx.typed_data();
  a->send_mask = send_mask.typed_data();
  a->out = out.untyped_data();
  a->T = T;
  a->K = K;
  a->C = C;
  a->rank_major = rank_major != 0;
  a->host_err = device_error_word(ErrorOp::kCombine);
  return ffi::Error::Success();
}

}  // namespace jax_ep
