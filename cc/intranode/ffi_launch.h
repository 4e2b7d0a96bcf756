// The FFI form of plan_launch: the ring kernels' grid and staging for a call.
#pragma once

#include <string>

#include "common/ffi_common.h"
#include "intranode/launch_config.h"
#include "intranode/ring_layout.h"
#include "runtime/runtime.h"

namespace jax_ep {

// Grid and staging rings of op on the caller's device (intranode/launch_config.h,
// plan_launch); a clear error when the symmetric buffer cannot hold them.
inline ffi::Error PlanLaunch(const std::string& o, OpKind op, int R, int T, int num_sms, int chunk,
                             long long row_bytes, long long s_row_bytes, int32_t device,
                             LaunchConfig* lc) {
  Runtime* rt = runtime();
  const std::string err = plan_launch(op, R, T, num_sms, rt->sms_of(device), chunk, row_bytes,
                                      s_row_bytes, rt->region(kRegionNormal).bytes, lc);
  return err.empty() ? ffi::Error::Success() : InvalidArgument(o + ": " + err);
}

}  // namespace jax_ep
