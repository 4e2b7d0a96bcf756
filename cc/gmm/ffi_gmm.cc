// XLA FFI targets of the fp8 grouped matmul's CUDA kernels
// (jax_ep/gmm/cuda_fp8.py), each one kernel on XLA's stream; they need no
// runtime (no jax_ep.initialize()). Attribute num_sms: CTAs (0: one per SM);
// the forward's tma_store: a bf16 result's 64-row blocks go out by TMA from a
// shared-memory tile (the ring one stage shorter), else from registers.
//
// jax_ep_gmm_fp8_nt (gmm/fp8_nt.cu): x [M, Kc] e4m3, xs_t [Kc/128, M] f32, v
// [G, N, Kc] e4m3, vs [G, N/128, Kc/128] f32, and
// the int32 row-tile table row_start, lo, hi, group, partner [T] with counts [2]
// (gmm/kernels.h), cut at attribute tile_rows rows -> out [M, N] bf16 or f32.
//
// jax_ep_gmm_fp8_dw (gmm/fp8_dw.cu): a [Ka, P] e4m3, as [P/128, Ka] f32, c
// [Nc, P] e4m3, cs [P/128, Nc] f32, segments [G+1] int32 -> out [G, Ka, Nc]
// bf16 or f32.
#include <string>

#include "common/ffi_common.h"
#include "gmm/kernels.h"

namespace jax_ep {

namespace {

constexpr const char* kNtOp = "gmm_fp8_nt";
constexpr const char* kDwOp = "gmm_fp8_dw";
constexpr int64_t kMaxDim = int64_t(1) << 30;   // every dimension: int indexing with room

// Both operands e4m3 (`names`: theirs, for the message), the result bf16 or f32.
ffi::Error CheckTypes(const std::string& op, const char* names, const ffi::AnyBuffer& a,
                      const ffi::AnyBuffer& b, const ffi::AnyBuffer& out) {
  if (a.element_type() != ffi::F8E4M3FN || b.element_type() != ffi::F8E4M3FN)
    return InvalidArgument(op + ": " + names + " must be float8_e4m3fn");
  if (out.element_type() != ffi::BF16 && out.element_type() != ffi::F32)
    return InvalidArgument(op + ": the result must be bfloat16 or float32");
  return ffi::Error::Success();
}

// num_sms: CTAs of the persistent kernel, 0 for one per SM.
ffi::Error CheckNumSms(const char* op, int32_t num_sms) {
  if (num_sms < 0)
    return InvalidArgument(std::string(op) + ": num_sms must be >= 0 (0: one CTA per SM)");
  return ffi::Error::Success();
}

ffi::Error NtShapes(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& xs_t,
                    const ffi::AnyBuffer& v, const ffi::Buffer<ffi::F32>& vs,
                    const ffi::AnyBuffer& out, GmmFp8Args* a) {
  auto xd = x.dimensions(), sd = xs_t.dimensions(), vd = v.dimensions(), wd = vs.dimensions(),
       od = out.dimensions();
  JAX_EP_RETURN_IF_ERROR(CheckTypes(kNtOp, "x and v", x, v, out));
  if (xd.size() != 2 || vd.size() != 3 || sd.size() != 2 || wd.size() != 3 || od.size() != 2)
    return InvalidArgument(std::string(kNtOp) + ": expected x [M, Kc], xs_t [Kc/128, M], "
                           "v [G, N, Kc], vs [G, N/128, Kc/128], out [M, N]");
  if (xd[0] >= kMaxDim || xd[1] >= kMaxDim || vd[0] >= kMaxDim || vd[1] >= kMaxDim ||
      vd[2] >= kMaxDim)
    return InvalidArgument(std::string(kNtOp) + ": M, Kc, G and N must each be below 2^30");
  a->m = static_cast<int>(xd[0]);
  a->kc = static_cast<int>(xd[1]);
  a->groups = static_cast<int>(vd[0]);
  a->n = static_cast<int>(vd[1]);
  if (vd[2] != xd[1] || sd[0] * 128 != xd[1] || sd[1] != xd[0] || wd[0] != vd[0] ||
      wd[1] * 128 != vd[1] || wd[2] * 128 != xd[1] || od[0] != xd[0] || od[1] != vd[1])
    return InvalidArgument(std::string(kNtOp) + ": operand shapes disagree (x [M, Kc], "
                           "xs_t [Kc/128, M], v [G, N, Kc], vs [G, N/128, Kc/128], out [M, N])");
  const std::string why = gmm_fp8_shape_error(*a);
  if (!why.empty()) return InvalidArgument(std::string(kNtOp) + ": " + why);
  return ffi::Error::Success();
}

ffi::Error GmmFp8NtImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::F32> xs_t,
                        ffi::AnyBuffer v, ffi::Buffer<ffi::F32> vs,
                        ffi::Buffer<ffi::S32> row_start, ffi::Buffer<ffi::S32> lo,
                        ffi::Buffer<ffi::S32> hi, ffi::Buffer<ffi::S32> group,
                        ffi::Buffer<ffi::S32> partner, ffi::Buffer<ffi::S32> counts,
                        int32_t num_sms, int32_t tile_rows,
                        int32_t tma_store, ffi::Result<ffi::AnyBuffer> out) {
  if (counts.element_count() != 2 || lo.element_count() != row_start.element_count() ||
      hi.element_count() != row_start.element_count() ||
      group.element_count() != row_start.element_count() ||
      partner.element_count() != row_start.element_count() ||
      row_start.element_count() >= kMaxDim)
    return InvalidArgument(std::string(kNtOp) + ": the row-tile table must be five int32 [T] "
                           "arrays (T below 2^30) and counts [2]");
  GmmFp8Args a;
  a.tiles = static_cast<int>(row_start.element_count());
  a.tile_rows = tile_rows;
  a.tma_store = tma_store != 0;
  JAX_EP_RETURN_IF_ERROR(NtShapes(x, xs_t, v, vs, *out, &a));
  JAX_EP_RETURN_IF_ERROR(CheckNumSms(kNtOp, num_sms));
  a.x = x.untyped_data();
  a.xs_t = xs_t.typed_data();
  a.v = v.untyped_data();
  a.vs = vs.typed_data();
  a.row_start = row_start.typed_data();
  a.lo = lo.typed_data();
  a.hi = hi.typed_data();
  a.group = group.typed_data();
  a.partner = partner.typed_data();
  a.counts = counts.typed_data();
  a.out = out->untyped_data();
  a.out_f32 = out->element_type() == ffi::F32;
  a.num_sms = num_sms;
  a.device = device;
  JAX_EP_CUDA_RETURN(launch_gmm_fp8_nt(a, stream));
  return ffi::Error::Success();
}

ffi::Error DwShapes(const ffi::AnyBuffer& a, const ffi::Buffer<ffi::F32>& as,
                    const ffi::AnyBuffer& c, const ffi::Buffer<ffi::F32>& cs,
                    const ffi::Buffer<ffi::S32>& seg, const ffi::AnyBuffer& out,
                    GmmFp8DwArgs* d) {
  const std::string op = kDwOp;
  auto ad = a.dimensions(), sd = as.dimensions(), cd = c.dimensions(), td = cs.dimensions(),
       od = out.dimensions();
  JAX_EP_RETURN_IF_ERROR(CheckTypes(op, "a and c", a, c, out));
  if (ad.size() != 2 || cd.size() != 2 || sd.size() != 2 || td.size() != 2 || od.size() != 3 ||
      seg.dimensions().size() != 1 || seg.element_count() < 2)
    return InvalidArgument(op + ": expected a [Ka, P], as [P/128, Ka], c [Nc, P], "
                           "cs [P/128, Nc], segments [G+1], out [G, Ka, Nc]");
  if (ad[0] >= kMaxDim || ad[1] >= kMaxDim || cd[0] >= kMaxDim ||
      seg.element_count() - 1 >= kMaxDim)
    return InvalidArgument(op + ": Ka, Nc, P and G must each be below 2^30");
  d->ka = static_cast<int>(ad[0]);
  d->p = static_cast<int>(ad[1]);
  d->nc = static_cast<int>(cd[0]);
  d->groups = static_cast<int>(seg.element_count() - 1);
  if (cd[1] != ad[1] || sd[0] * 128 != ad[1] || sd[1] != ad[0] || td[0] != sd[0] ||
      td[1] != cd[0] || od[0] != d->groups || od[1] != ad[0] || od[2] != cd[0])
    return InvalidArgument(op + ": operand shapes disagree (a [Ka, P], as [P/128, Ka], "
                           "c [Nc, P], cs [P/128, Nc], segments [G+1], out [G, Ka, Nc])");
  const std::string why = gmm_fp8_dw_shape_error(*d);
  if (!why.empty()) return InvalidArgument(op + ": " + why);
  return ffi::Error::Success();
}

ffi::Error GmmFp8DwImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                        ffi::Buffer<ffi::F32> as, ffi::AnyBuffer c, ffi::Buffer<ffi::F32> cs,
                        ffi::Buffer<ffi::S32> segments, int32_t num_sms,
                        ffi::Result<ffi::AnyBuffer> out) {
  GmmFp8DwArgs d;
  JAX_EP_RETURN_IF_ERROR(DwShapes(a, as, c, cs, segments, *out, &d));
  JAX_EP_RETURN_IF_ERROR(CheckNumSms(kDwOp, num_sms));
  d.a = a.untyped_data();
  d.a_scales = as.typed_data();
  d.c = c.untyped_data();
  d.c_scales = cs.typed_data();
  d.segments = segments.typed_data();
  d.out = out->untyped_data();
  d.out_f32 = out->element_type() == ffi::F32;
  d.num_sms = num_sms;
  d.device = device;
  JAX_EP_CUDA_RETURN(launch_gmm_fp8_dw(d, stream));
  return ffi::Error::Success();
}

}  // namespace

}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpGmmFp8Nt, jax_ep::GmmFp8NtImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x [M, Kc] e4m3
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // xs_t [Kc/128, M]
                                  .Arg<xla::ffi::AnyBuffer>()              // v [G, N, Kc] e4m3
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // vs [G, N/128, Kc/128]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_start [T]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // lo [T]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // hi [T]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group [T]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // partner [T]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [2]
                                  .Attr<int32_t>("num_sms")    // CTAs (0: one per SM)
                                  .Attr<int32_t>("tile_rows")  // the table's rows per tile
                                  .Attr<int32_t>("tma_store")  // 1: TMA stores (bf16 out; f32 ignores it)
                                  .Ret<xla::ffi::AnyBuffer>());  // out [M, N] bf16 / f32

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpGmmFp8Dw, jax_ep::GmmFp8DwImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<jax_ep::Stream>()
                                  .Ctx<jax_ep::Device>()
                                  .Arg<xla::ffi::AnyBuffer>()              // a [Ka, P] e4m3
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // as [P/128, Ka]
                                  .Arg<xla::ffi::AnyBuffer>()              // c [Nc, P] e4m3
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // cs [P/128, Nc]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // segments [G+1]
                                  .Attr<int32_t>("num_sms")  // CTAs (0: one per SM)
                                  .Ret<xla::ffi::AnyBuffer>());  // out [G, Ka, Nc] bf16 / f32
