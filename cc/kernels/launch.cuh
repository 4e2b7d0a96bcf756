// Shared pieces of the intranode dispatch/combine kernels: the launch config,
// the layout of the symmetric buffer they use, and device helpers (vector
// row copies, system-scope flags, a timeout-guarded spin).
//
// Protocol (both ops): each call has an epoch e (a device-side counter, so the
// kernels are safe to replay in CUDA graphs). A sender writes its rows for
// rank r straight into r's staging buffer (P2P stores through the peer table),
// then stores e into r's flag [sender][chunk] with release semantics. The
// receiver spins (acquire) until that flag is >= e. Staging is double-buffered
// by epoch parity: call e on rank a can only start after call e-1 on a
// finished, which waited for every peer's call e-1 flags, which peers only
// raise after finishing call e-2 (and so after consuming parity e%2). So no
// barrier, ack or reset is needed between calls.
#pragma once

#include <cuda_runtime.h>
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <cstddef>
#include <cstdint>

#include "runtime.h"

namespace jax_ep {

// ---- launch configuration --------------------------------------------------
// Receiver warps spin on flags raised by sender warps of other blocks (and
// ranks), so every block of a grid must be resident at once: the grid is at
// most the SM count and a block (512 threads, <= 128 registers) fits one SM.
//
// A chunk (one flag) is `chunk` consecutive tokens, moved by all the sender
// warps of one block at once: with fewer tokens than warps each token row is
// cut into `slices` column slices, one warp each. Small chunks make data land
// in many small waves, so the receive-side work left after the last byte
// arrives (gather / reduce of the last wave) is small.
struct LaunchConfig {
  int num_blocks = 0;    // grid (<= SMs: blocks spin, so all must be resident)
  int send_warps = 8;    // warps per block that push rows to peers
  int recv_warps = 8;    // warps per block that gather / reduce locally
  int chunk = 8;         // tokens per flag (<= kMaxChunks flags per source rank)
  int slices = 1;        // warps per token row inside a chunk (send and receive)
  __host__ __device__ int threads() const { return 32 * (send_warps + recv_warps); }
};

// The ops that own a region of the symmetric buffer (staging, flags).
enum OpKind : int { kOpDispatch = 0, kOpCombine = 1, kOpBench = 2, kNumOps = 3 };

// Picks the grid and chunk size of op (kOpDispatch / kOpCombine) for T tokens
// given an SM budget (num_sms <= 0: every SM of the device). The tokens per
// chunk: `chunk` when > 0 (the `chunk` FFI attribute, EpConfig.tuning; the
// loopback tests), else the default; doubled until at most kMaxChunks chunks.
// Every rank of a group must pass the same chunk (flag j must cover the same
// tokens everywhere): it comes from the one EpConfig they share.
LaunchConfig make_launch_config(OpKind op, int num_tokens, int num_sms_requested, int device_sms,
                                int chunk = 0);

// Warps per token row when a block's warps share a chunk of `chunk` tokens.
inline int slices_for_chunk(int chunk, int warps) { return chunk >= warps ? 1 : warps / chunk; }

// Byte range [off, off + len) of slice `sl` of `slices` of a row of `nvec`
// vectors of `vec` bytes (slices differ by at most one vector).
__host__ __device__ inline void row_slice(long long nvec, int vec, int sl, int slices,
                                          long long* off, long long* len) {
  const long long b = nvec * sl / slices, e = nvec * (sl + 1) / slices;
  *off = b * vec;
  *len = (e - b) * vec;
}

// ---- symmetric buffer layout -------------------------------------------------
constexpr int kMaxChunks = 8192;            // flags per (op, source rank)
constexpr size_t kCtrlBytes = size_t(1) << 20;  // control region (end of buffer)

struct OpCtrl {
  unsigned int epoch;   // last finished epoch (local only)
  unsigned int done;    // blocks finished in the current call
  unsigned int pad[30];
  unsigned int flags[kMaxRanks][kMaxChunks];  // written by source ranks
};
static_assert(sizeof(OpCtrl) * kNumOps <= kCtrlBytes, "control region too small");

// The control region sits at the END of the symmetric buffer (other targets,
// e.g. the runtime self-test, scribble from offset 0): byte offset of op's block.
inline size_t ctrl_offset(size_t sym_bytes, int op) {
  return ((sym_bytes - kCtrlBytes) & ~size_t(255)) + sizeof(OpCtrl) * size_t(op);
}

// Staging: before the control region the buffer is split into 2 data regions
// (dispatch, combine; the bench op reuses dispatch's), each halved by epoch
// parity. Returns the size of one parity half / its byte offset.
inline size_t stage_half_bytes(size_t sym_bytes) {
  size_t data = sym_bytes > 2 * kCtrlBytes ? ((sym_bytes - kCtrlBytes) & ~size_t(255)) : 0;
  return (data / 4) & ~size_t(255);
}
inline size_t stage_offset(size_t sym_bytes, int op, int parity) {
  int region = op == kOpCombine ? 1 : 0;
  return stage_half_bytes(sym_bytes) * size_t(2 * region + parity);
}

// Error codes the kernels leave in host-mapped memory (read by the next call).
enum KernelError : int { kErrNone = 0, kErrTimeout = 1 };

// ---- device helpers ----------------------------------------------------------
#ifdef __CUDACC__

// Element type <-> f32 (round to nearest even).
template <typename T> struct Cvt;
template <> struct Cvt<__nv_bfloat16> {
  __device__ __forceinline__ static float f(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 t(float v) { return __float2bfloat16_rn(v); }
};
template <> struct Cvt<__half> {
  __device__ __forceinline__ static float f(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half t(float v) { return __float2half_rn(v); }
};
template <> struct Cvt<float> {
  __device__ __forceinline__ static float f(float v) { return v; }
  __device__ __forceinline__ static float t(float v) { return v; }
};

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned int ld_acquire_sys(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(unsigned int* p, unsigned int v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned int ld_volatile(const unsigned int* p) {
  return *reinterpret_cast<const volatile unsigned int*>(p);
}

// Barrier over the first `nthreads` threads of the block (the sender warps),
// so the receiver warps never wait on senders inside a block.
__device__ __forceinline__ void named_barrier(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

// Sender warps of a block publish chunk j to every peer: its rows (written by
// any sender thread of the block) are visible before the flag reads epoch.
// The sender warps meet at a barrier and one thread does a system-scope
// release (cumulative over the block's writes, per the PTX memory model). (A
// form where every sender thread fenced first was measured no faster and
// deleted: bench/results/history.)
__device__ __forceinline__ void publish_chunk(const PeerTable& p, size_t ctrl_off, int j,
                                              unsigned int epoch, int send_warps) {
  named_barrier(1, 32 * send_warps);
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int r = 0; r < p.num_ranks; ++r) {
      if (r == p.rank) continue;
      OpCtrl* rc = reinterpret_cast<OpCtrl*>(static_cast<char*>(p.peers[r]) + ctrl_off);
      st_release_sys(&rc->flags[p.rank][j], epoch);
    }
  }
}

// Epoch of this call: one more than the last finished one.
__device__ __forceinline__ unsigned int current_epoch(const OpCtrl* ctrl) {
  return ld_volatile(&ctrl->epoch) + 1u;
}

// Every block calls this once at its end; the last one publishes the epoch.
__device__ __forceinline__ void finish_call(OpCtrl* ctrl, unsigned int epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned int prev = atomicAdd(&ctrl->done, 1u);
    if (prev == gridDim.x - 1) {
      ctrl->done = 0;
      *reinterpret_cast<volatile unsigned int*>(&ctrl->epoch) = epoch;
      __threadfence();
    }
  }
}

// Spin (every lane of the warp) until *flag >= epoch. On timeout, raise the
// error in host-mapped memory and return false (the caller moves on; data is
// then garbage, and the next FFI call reports the error).
__device__ __forceinline__ bool wait_flag(const unsigned int* flag, unsigned int epoch,
                                          int* host_err, unsigned long long timeout_ns) {
  if (static_cast<int>(ld_acquire_sys(flag) - epoch) >= 0) return true;
  unsigned long long t0 = global_timer_ns();
  while (true) {
    for (int i = 0; i < 64; ++i)
      if (static_cast<int>(ld_acquire_sys(flag) - epoch) >= 0) return true;
    if (global_timer_ns() - t0 > timeout_ns) {
      if (host_err) *reinterpret_cast<volatile int*>(host_err) = kErrTimeout;
      return false;
    }
  }
}

// Non-blocking: true (uniformly over the warp) when every lane's acquire load
// saw *flag >= epoch, so every lane may read what the flag publishes.
__device__ __forceinline__ bool flag_ready_warp(const unsigned int* flag, unsigned int epoch) {
  const unsigned int v = ld_acquire_sys(flag);
  return __all_sync(0xffffffffu, static_cast<int>(v - epoch) >= 0);
}

// Vector type and count for copying rows of `bytes` bytes (all rows of a
// stream share the alignment of their row size; buffers are 256-B aligned).
template <int V> struct VecT;
template <> struct VecT<16> { using type = int4; };
template <> struct VecT<8> { using type = int2; };
template <> struct VecT<4> { using type = int; };
template <> struct VecT<2> { using type = short; };
template <> struct VecT<1> { using type = char; };

__host__ __device__ inline int row_vec_bytes(long long bytes) {
  return (bytes % 16 == 0) ? 16 : (bytes % 8 == 0) ? 8 : (bytes % 4 == 0) ? 4 : (bytes % 2 == 0) ? 2 : 1;
}

// Warp copies bytes [off, off + bytes) of a row to the same range of up to
// `n` destination rows (dst[i] may be remote); off and bytes are multiples of
// V. UNROLL independent loads in flight per lane.
template <int V, int UNROLL = 4>
__device__ __forceinline__ void warp_copy_row_multi(const void* __restrict__ src, void* const* dst,
                                                    int n, long long off, long long bytes,
                                                    int lane) {
  using T = typename VecT<V>::type;
  const T* s = reinterpret_cast<const T*>(static_cast<const char*>(src) + off);
  const long long nv = bytes / V;
  long long i = lane;
  for (; i + 32 * (UNROLL - 1) < nv; i += 32 * UNROLL) {
    T v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = s[i + 32 * u];
    for (int d = 0; d < n; ++d) {
      T* o = reinterpret_cast<T*>(static_cast<char*>(dst[d]) + off);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) o[i + 32 * u] = v[u];
    }
  }
  for (; i < nv; i += 32) {
    T v = s[i];
    for (int d = 0; d < n; ++d) reinterpret_cast<T*>(static_cast<char*>(dst[d]) + off)[i] = v;
  }
}

template <int V>
__device__ __forceinline__ void warp_zero_row(void* dst, long long bytes, int lane) {
  using T = typename VecT<V>::type;
  T z;
  memset(&z, 0, sizeof(T));
  T* o = reinterpret_cast<T*>(dst);
  for (long long i = lane; i < bytes / V; i += 32) o[i] = z;
}

// Runtime-dispatched wrappers: v = the stream's vector width (row_vec_bytes of
// its row size), which off and bytes are multiples of.
__device__ __forceinline__ void warp_copy_row_any(const void* src, void* const* dst, int n,
                                                  long long off, long long bytes, int v, int lane) {
  switch (v) {
    case 16: warp_copy_row_multi<16>(src, dst, n, off, bytes, lane); break;
    case 8: warp_copy_row_multi<8>(src, dst, n, off, bytes, lane); break;
    case 4: warp_copy_row_multi<4>(src, dst, n, off, bytes, lane); break;
    case 2: warp_copy_row_multi<2>(src, dst, n, off, bytes, lane); break;
    default: warp_copy_row_multi<1>(src, dst, n, off, bytes, lane); break;
  }
}
__device__ __forceinline__ void warp_zero_row_any(void* dst, long long bytes, int lane) {
  switch (row_vec_bytes(bytes)) {
    case 16: warp_zero_row<16>(dst, bytes, lane); break;
    case 8: warp_zero_row<8>(dst, bytes, lane); break;
    case 4: warp_zero_row<4>(dst, bytes, lane); break;
    case 2: warp_zero_row<2>(dst, bytes, lane); break;
    default: warp_zero_row<1>(dst, bytes, lane); break;
  }
}

#endif  // __CUDACC__

// ---- host helpers ------------------------------------------------------------
// Host-mapped error word the kernels write on timeout (one per process).
int* device_error_word();  // device pointer of the mapped word
int take_device_error();   // reads and clears it (host side, no sync)

// TEST-ONLY debug helper, the one environment read of the library:
// JAX_EP_DEBUG_POISON=1 makes the FFI handlers fill their outputs with 0xFF
// (NaN in every float type) before the kernels run, so a row nobody writes
// shows up in the GPU tests. It never changes the result of a correct kernel
// (every output row it poisons is written), only costs a memset; no tuning
// knob may be read this way (they are FFI attributes: EpConfig.tuning).
bool debug_poison();

// Default spin timeout.
constexpr unsigned long long kDefaultTimeoutNs = 10ull * 1000 * 1000 * 1000;

}  // namespace jax_ep
