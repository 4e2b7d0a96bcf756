// Intranode dispatch: each token row crosses the link once per destination
// rank (send_mask), into that rank's staging ring (ring_layout.h); the
// receiver gathers staging rows into the output layout (slot_row), reading
// its own tokens straight from x (copy mode) and zeroing group padding rows
// (and the tail only when asked: DispatchArgs::zero_tail). The same kernel is
// the expert side of the combine backward (kDispatchCombineBwd).
//
// One kernel, warp-specialised: "sender" warps push chunks of tokens (16-byte
// P2P stores; in the fp8 modes they cast first) and raise one flag per
// (destination, chunk); "receiver" warps gather a peer's chunk as soon as its
// flag is up and otherwise do the work that needs nobody (zero rows, own
// tokens), so the local gather overlaps the NVLink transfer. Chunks go
// through bounded rings with credits (transport/ring.cuh): a block's chunk i
// reuses slot i % depth once every receiver drained chunk i - depth.
#include <cuda_fp8.h>
#include <cuda_bf16.h>

#include "common/fp8_cast.cuh"
#include "common/launch.h"
#include "common/row_copy.cuh"
#include "common/sync.cuh"
#include "intranode/dispatch_rows.cuh"
#include "intranode/kernels.h"
#include "transport/ring.cuh"

namespace jax_ep {

namespace {


// Combine backward, expert side (kDispatchCombineBwd): for each of the n slot
// rows (pointers into out = dy) of one received row g of token t:
//   dy[c] = cast(w[c] * f32(g))  -- the reference's f32 product then cast: same bits
//   dw[c] = sum_h f32(g[h]) * f32(y[c, h]) in a fixed order: lane l runs over its
//           vectors l, l + 32, ... ascending, elements ascending, one fmaf each,
//           then a xor butterfly over the lanes (16, 8, 4, 2, 1; every lane ends
//           with the same bits). Deterministic; vs the reference's sum only f32
//           reduction-order differences.
// g is re-read per slot row (L1/L2 hits); y is read and dy written once: no
// [C, H] f32 temporaries.
template <typename T, int V>
__device__ __forceinline__ void bwd_rows(const DispatchArgs& a, const char* g, char* const* rows,
                                      int n, int lane) {
  using Vec = typename VecT<V>::type;
  constexpr int E = V / sizeof(T);
  constexpr int U = 4;  // vectors of g and of y in flight per lane
  const long long nv = a.row_bytes / V;
  const Vec* gv = reinterpret_cast<const Vec*>(g);
  for (int k = 0; k < n; ++k) {
    const long long off = rows[k] - static_cast<char*>(a.out);
    const long long row = off / a.row_bytes;
    const Vec* yv = reinterpret_cast<const Vec*>(static_cast<const char*>(a.y) + off);
    Vec* dyv = reinterpret_cast<Vec*>(rows[k]);
    const float w = __ldg(a.row_w + row);
    float acc = 0.f;
    for (long long i0 = lane; i0 < nv; i0 += 32 * U) {
      Vec gr[U], yr[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i0 + 32 * u < nv) {
          gr[u] = gv[i0 + 32 * u];
          yr[u] = yv[i0 + 32 * u];
        }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (i0 + 32 * u >= nv) continue;
        const T* gt = reinterpret_cast<const T*>(&gr[u]);
        const T* yt = reinterpret_cast<const T*>(&yr[u]);
        Vec o;
        T* ot = reinterpret_cast<T*>(&o);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float gf = Cvt<T>::f(gt[e]);
          ot[e] = Cvt<T>::t(__fmul_rn(w, gf));
          acc = __fmaf_rn(gf, Cvt<T>::f(yt[e]), acc);
        }
        dyv[i0 + 32 * u] = o;
      }
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    if (lane == 0) a.dw[row] = acc;
  }
}

__device__ __forceinline__ void bwd_rows_any(const DispatchArgs& a, const char* g,
                                             char* const* rows, int n, int lane) {
  const bool v16 = a.row_bytes % 16 == 0;
  switch (a.dtype) {
    case kBf16:
      v16 ? bwd_rows<__nv_bfloat16, 16>(a, g, rows, n, lane)
          : bwd_rows<__nv_bfloat16, 2>(a, g, rows, n, lane);
      break;
    case kF16:
      v16 ? bwd_rows<__half, 16>(a, g, rows, n, lane) : bwd_rows<__half, 2>(a, g, rows, n, lane);
      break;
    default:
      v16 ? bwd_rows<float, 16>(a, g, rows, n, lane) : bwd_rows<float, 4>(a, g, rows, n, lane);
      break;
  }
}

// EPL: 16 = the fp8 cast kernel (16 elements per lane, one 16-byte store
// each); 8 = the copy kernel (no cast code), a template so that the cast's
// register pressure stays out of the copy kernel; BWD (kDispatchCombineBwd)
// likewise. (An 8-element cast was measured slower and deleted: numbers in
// bench/results/README.md, "Deleted variants".)
template <int EPL, bool BWD>
__global__ void __launch_bounds__(512, 1)
dispatch_kernel(DispatchArgs a, LaunchConfig lc, int num_chunks) {
  const int send_warps = lc.send_warps, recv_warps = lc.recv_warps, chunk = lc.chunk;
  const int slices = lc.slices, depth = lc.depth, G = gridDim.x;
  __shared__ float sm_scales[16][kSmScales];
  __shared__ unsigned int ring_cnt[kMaxRanks][kMaxDepth];  // receiver warps done per (peer, slot)
  for (int i = threadIdx.x; i < kMaxRanks * kMaxDepth; i += blockDim.x) (&ring_cnt[0][0])[i] = 0u;
  __syncthreads();
  const int me = a.peers.rank, R = a.peers.num_ranks;
  OpCtrl* ctrl = reinterpret_cast<OpCtrl*>(peer_ptr(a.peers, me, a.ctrl_off));
  const unsigned int epoch = current_epoch(ctrl);
  const int parity = epoch & 1u;
  const size_t stage = a.stage_off[parity];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int T = a.T;
  const int v = row_vec_bytes(a.row_bytes);
  const int sv = a.s_row_bytes ? row_vec_bytes(a.s_row_bytes) : 1;
  float* sm = sm_scales[warp & 15];

  if (warp < send_warps) {
    // ---- sender: chunk j of my tokens to every rank that wants them; the
    // block's warps share the chunk's (token, slice) items ----
    send_ring_chunks(a.peers, ctrl, a.ctrl_off, num_chunks, depth, epoch, send_warps,
                     a.host_err, a.timeout_ns, [&](int j, int q) {
      const int t0 = j * chunk, nit = (min(T, t0 + chunk) - t0) * slices;
      for (int it = warp; it < nit; it += send_warps) {
        const int t = t0 + it / slices, sl = it % slices;
        char* dst[kMaxRanks];
        char* dsts[kMaxRanks];
        int n = 0;
        for (int i = 1; i < R; ++i) {  // peers only: own rows are gathered from x
          const int r = (me + i) % R;
          if (!a.send_mask[static_cast<long long>(t) * R + r]) continue;
          // my ring at r: peer index (me - r) mod R, minus 1 (r never rings itself)
          const long long slot = ring_row(G, depth, chunk, (me - r + R) % R - 1, blockIdx.x, q,
                                          t - t0);
          dst[n] = peer_ptr(a.peers, r, stage) + slot * a.row_bytes;
          dsts[n] = peer_ptr(a.peers, r, stage + a.stage_scales_off) + slot * a.s_row_bytes;
          ++n;
        }
        if (n == 0 || (a.skip & 1)) continue;
        move_row_slice<EPL>(a, t, static_cast<const char*>(a.x) + t * a.x_row_bytes, dst, dsts, n,
                            sl, slices, v, sv, lane, sm);
      }
    });
  } else {
    // ---- receiver ----
    const int rw = warp - send_warps;
    const int nrw = gridDim.x * recv_warps;
    const int gw = blockIdx.x * recv_warps + rw;
    char* rows[kMaxDst];
    char* srows[kMaxDst];
    const char* my_stage = peer_ptr(a.peers, me, stage);
    // Two work lists per warp, interleaved: remote chunks (this block's
    // chunk ci from peer pi, every peer's chunk ci before chunk ci + 1: the
    // rings' progress rule; this warp's items in it) whenever their flag is
    // up, and otherwise local work that needs nobody: zero rows, then own
    // tokens straight from x (cast here in the fp8 modes). So the local
    // gather hides behind the transfer and only the last wave is left after it.
    const bool work = !(a.skip & 2);
    const int rslices = BWD ? 1 : slices;  // bwd: dw reduces a whole row in one warp
    ZeroCursor zc(work ? gw : a.C, nrw);   // zero rows
    int lt = work ? gw : T;     // local-token cursor
    int pi = 1, ci = 0, pj = blockIdx.x;  // remote cursor: peer me + pi, chunk pj (ci-th)
    const int n_ci = blockIdx.x < num_chunks ? (num_chunks - blockIdx.x + G - 1) / G : 0;
    while (true) {
      const bool remote_left = R > 1 && pj < num_chunks;
      const int s = remote_left ? (me + pi) % R : 0;
      const int q = ci % depth;
      const unsigned long long tag = chunk_tag(epoch, ci);
      const unsigned long long* ready = &ctrl->ready[s][blockIdx.x][q];
      bool do_remote = false;
      if (remote_left) do_remote = tag_ready_warp(ready, tag);
      if (!do_remote) {
        // local work item, if any
        const int z = zc.pop(a, lane);
        if (z >= 0) {
          warp_zero_row_any(static_cast<char*>(a.out) + static_cast<long long>(z) * a.row_bytes,
                            a.row_bytes, lane);
          if (a.s_row_bytes)
            warp_zero_row_any(static_cast<char*>(a.out_scales) + static_cast<long long>(z) * a.s_row_bytes,
                              a.s_row_bytes, lane);
          continue;
        }
        if (lt < T) {
          const int t = lt;
          lt += nrw;
          const int n = gather_rows(a, me, t, rows, srows, lane);
          if (n == 0) continue;
          const char* xr = static_cast<const char*>(a.x) + t * a.x_row_bytes;
          if constexpr (BWD) bwd_rows_any(a, xr, rows, n, lane);
          else move_row_slice<EPL>(a, t, xr, rows, srows, n, 0, 1, v, sv, lane, sm);
          continue;
        }
        if (!remote_left) break;
        wait_tag(ready, tag, a.host_err, a.timeout_ns);
      }
      // remote chunk (s, pj): this warp's (token, slice) items
      const int t0 = pj * chunk;
      const int nit = work ? (min(T, t0 + chunk) - t0) * rslices : 0;
      for (int it = rw; it < nit; it += recv_warps) {
        const int t = t0 + it / rslices, sl = it % rslices;
        const int n = gather_rows(a, s, t, rows, srows, lane);
        if (n == 0) continue;
        const long long slot = ring_row(G, depth, chunk, pi - 1, blockIdx.x, q, t - t0);
        if constexpr (BWD) {
          bwd_rows_any(a, my_stage + slot * a.row_bytes, rows, n, lane);
          continue;
        }
        long long off, len;
        row_slice(a.row_bytes / v, v, sl, rslices, &off, &len);
        warp_copy_row_any(my_stage + slot * a.row_bytes, reinterpret_cast<void* const*>(rows), n,
                          off, len, v, lane);
        if (a.s_row_bytes && sl == 0)
          warp_copy_row_any(my_stage + a.stage_scales_off + slot * a.s_row_bytes,
                            reinterpret_cast<void* const*>(srows), n, 0, a.s_row_bytes, sv, lane);
      }
      drain_slot(a.peers, a.ctrl_off, s, q, tag, &ring_cnt[s][q], recv_warps, ci + depth < n_ci,
                 lane);
      if (++pi == R) {
        pi = 1;
        ++ci;
        pj += G;
      }
    }
  }
  finish_call(ctrl, epoch);
}

}  // namespace

cudaError_t launch_dispatch(const DispatchArgs& a, const LaunchConfig& lc, cudaStream_t stream) {
  const int num_chunks = (a.T + lc.chunk - 1) / lc.chunk;
  if (lc.depth < 1 || lc.depth > kMaxDepth || lc.num_blocks > kMaxBlocks)
    return cudaErrorInvalidValue;
  const KernelLaunch k{lc.num_blocks, lc.threads(), 0, stream};
  if (a.mode == kDispatchCombineBwd) return launch(k, dispatch_kernel<8, true>, a, lc, num_chunks);
  if (a.mode != kDispatchCopy) return launch(k, dispatch_kernel<16, false>, a, lc, num_chunks);
  return launch(k, dispatch_kernel<8, false>, a, lc, num_chunks);
}

}  // namespace jax_ep
