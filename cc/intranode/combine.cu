// Intranode combine. Sender warps (expert side) reduce, for every (source s,
// token t) received from a peer s, this rank's rows in k order (p = sum_k
// w_row * f32(y[row_k]); rank_major: p = y[row]), cast p to y's dtype and
// write it into s's staging ring (ring_layout.h), raising one flag per chunk.
// Receiver warps (source side) form this rank's own partial for its tokens
// straight from y (never staged), then, as the peers' chunks arrive, sum the
// partials of ranks 0..R-1 in that order in f32 and cast. One row per
// (token, rank) crosses the link, as in dispatch; the arithmetic is
// jax_ep.reference's, op for op (__fmul_rn / __fadd_rn: no FMA contraction),
// so results are deterministic and equal to the reference's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/launch.h"
#include "common/row_copy.cuh"
#include "common/sync.cuh"
#include "intranode/combine_rows.cuh"
#include "intranode/kernels.h"
#include "transport/ring.cuh"

namespace jax_ep {

namespace {

// Walks one warp's (token, slice) items: item i = rw, rw + step, ... of chunk
// j (tokens j*chunk.., `slices` items each), for the chunks j = block,
// block + grid, ... .
struct ItemCursor {
  int j, i, rw, chunk, slices, step, T, num_chunks, grid;
  __device__ ItemCursor(int j0, int rw_, int chunk_, int slices_, int step_, int T_, int nc, int g)
      : j(j0), i(rw_), rw(rw_), chunk(chunk_), slices(slices_), step(step_), T(T_),
        num_chunks(nc), grid(g) {
    settle();
  }
  __device__ int items(int jj) const { return (min(T, (jj + 1) * chunk) - jj * chunk) * slices; }
  __device__ bool valid() const { return j < num_chunks; }
  __device__ int t() const { return j * chunk + i / slices; }
  __device__ int sl() const { return i % slices; }
  __device__ void settle() {
    while (j < num_chunks && i >= items(j)) {
      j += grid;
      i = rw;
    }
  }
  __device__ void next() {
    i += step;
    settle();
  }
};

template <typename T, int V>
__global__ void __launch_bounds__(512, 1)
combine_kernel(CombineArgs a, LaunchConfig lc, int num_chunks) {
  const int send_warps = lc.send_warps, recv_warps = lc.recv_warps, chunk = lc.chunk;
  const int slices = lc.slices, depth = lc.depth, G = gridDim.x;
  const int me = a.peers.rank, R = a.peers.num_ranks;
  __shared__ unsigned int ring_cnt[kMaxDepth];  // receiver warps done per slot
  for (int i = threadIdx.x; i < kMaxDepth; i += blockDim.x) ring_cnt[i] = 0u;
  __syncthreads();
  OpCtrl* ctrl = reinterpret_cast<OpCtrl*>(peer_ptr(a.peers, me, a.ctrl_off));
  const unsigned int epoch = current_epoch(ctrl);
  const size_t stage = a.stage_off[epoch & 1u];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int NT = a.T;
  const char* y = static_cast<const char*>(a.y);
  const bool weighted = a.row_weights != nullptr && !a.rank_major;
  const long long RB = a.row_bytes, nvec = RB / V;
  int rows[kMaxK];
  float w[kMaxK];

  if (warp < send_warps) {
    // ---- expert side: partial of every (s, t) received from a peer s; the
    // block's warps share chunk j's (token, slice) items ----
    send_ring_chunks(a.peers, ctrl, a.ctrl_off, num_chunks, depth, epoch, send_warps,
                     a.host_err, a.timeout_ns, [&](int j, int q) {
      const int t0 = j * chunk, nit = (min(NT, t0 + chunk) - t0) * slices;
      for (int it = warp; it < nit; it += send_warps) {
        const int t = t0 + it / slices;
        long long off, len;
        row_slice(nvec, V, it % slices, slices, &off, &len);
        for (int i = 1; i < R; ++i) {
          const int s = (me + i) % R;
          bool received;
          const int n = slot_rows(a, s, t, rows, w, &received, lane);
          if (!received || (a.skip & 1)) continue;
          char* dst = peer_ptr(a.peers, s, stage) +
                      ring_row(G, depth, chunk, (me - s + R) % R - 1, blockIdx.x, q, t - t0) * RB;
          if (n == 0) {
            warp_zero_row<V>(dst + off, len, lane);
          } else if (a.rank_major) {
            void* d[1] = {dst};
            warp_copy_row_multi<V>(y + static_cast<long long>(rows[0]) * RB, d, 1, off, len, lane);
          } else {
            warp_reduce_rows<T, V>(y, RB, rows, w, n, weighted, dst, off, len, lane);
          }
        }
      }
    });
  } else {
    // ---- source side: sum the partials of ranks 0..R-1 ----
    // Per (token, slice) item two steps over this warp's item list (its items
    // of this block's chunks): A needs nobody: this rank's own partial
    // cast(p_me) is formed from y and parked in out[t] (exact: it is stored in
    // y's dtype anyway), or out[t] is finished when no peer is involved. B
    // waits for the peers' chunk flags and sums ranks 0..R-1 in order (own
    // partial read back from out[t]). B runs whenever its next item is ready,
    // A otherwise, so the local reduction hides behind the transfer. rank_major
    // has no A for items with peers: its own partial is one row of y, read by B.
    const int rw = warp - send_warps;
    const char* my_stage = peer_ptr(a.peers, me, stage);
    const char* src[kMaxRanks];
    const bool work = !(a.skip & 2);
    ItemCursor ca(blockIdx.x, rw, chunk, slices, recv_warps, NT, num_chunks, G);
    const int n_ci = blockIdx.x < num_chunks ? (num_chunks - blockIdx.x + G - 1) / G : 0;
    ItemCursor cb = ca;
    int na = 0, nb = 0;  // items done by A / B (B never overtakes A)
    // Rings that wrap: before an item of chunk ci, wait for EVERY peer's chunk
    // ci (all peers publish every chunk), not only the peers the token needs.
    // A peer publishes ci only after the credit of ci - depth, i.e. after every
    // warp of this block drained the slot, so no warp can count its drain of
    // ci into the slot counter while a slower warp still owes ci - depth.
    const bool wraps = depth < n_ci;
    while (cb.valid()) {
      const int tb = cb.t(), jb = cb.j, cib = jb / G, qb = cib % depth;
      const unsigned long long tag = chunk_tag(epoch, cib);
      const bool* mb = a.send_mask + static_cast<long long>(tb) * R;
      if (nb < na) {
        bool ready = true;
        for (int r = 0; r < R && ready; ++r)
          if (r != me && (mb[r] || wraps))
            ready = tag_ready_warp(&ctrl->ready[r][blockIdx.x][qb], tag);
        if (!ready && !ca.valid()) {  // nothing else to do: block on the flags
          for (int r = 0; r < R; ++r)
            if (r != me && (mb[r] || wraps))
              wait_tag(&ctrl->ready[r][blockIdx.x][qb], tag, a.host_err, a.timeout_ns);
          ready = true;
        }
        if (ready) {
          int n = 0, remote = 0, local_pos = -1, n_rows = 0;
          for (int r = 0; r < R; ++r) {
            if (!mb[r]) continue;
            if (r == me) {
              if (a.rank_major) {  // own partial straight from its row of y
                bool received;
                n_rows = slot_rows(a, me, tb, rows, w, &received, lane);
                local_pos = n;
              }
              // (rank_major: position local_pos, summed from y, never read here)
              src[n++] = static_cast<const char*>(a.out) + tb * RB;
            } else {
              src[n++] = my_stage + ring_row(G, depth, chunk, (r - me + R) % R - 1, blockIdx.x,
                                             qb, tb - jb * chunk) * RB;
              ++remote;
            }
          }
          if (remote && work) {
            long long off, len;
            row_slice(nvec, V, cb.sl(), slices, &off, &len);
            warp_combine_token<T, V>(src, n, local_pos, y, RB, rows, w, n_rows, false,
                                     static_cast<char*>(a.out) + tb * RB, off, len, lane);
          }
          ++nb;
          cb.next();
          if (!cb.valid() || cb.j != jb)  // this warp is done with chunk jb: every peer's slot
            drain_slot(a.peers, a.ctrl_off, -1, qb, tag, &ring_cnt[qb],
                       min(recv_warps, cb.items(jb)), cib + depth < n_ci, lane);
          continue;
        }
      }
      // step A for the next item
      const int ta = ca.t();
      const bool* ma = a.send_mask + static_cast<long long>(ta) * R;
      int remote = 0;
      for (int r = 0; r < R; ++r) remote += (r != me && ma[r]);
      char* out = static_cast<char*>(a.out) + ta * RB;
      long long off, len;
      row_slice(nvec, V, ca.sl(), slices, &off, &len);
      if (work) {
        if (ma[me]) {
          if (remote) {
            if (!a.rank_major) {
              bool received;
              const int n_rows = slot_rows(a, me, ta, rows, w, &received, lane);
              if (n_rows == 0) warp_zero_row<V>(out + off, len, lane);
              else warp_reduce_rows<T, V>(y, RB, rows, w, n_rows, weighted, out, off, len, lane);
            }
          } else {
            bool received;
            const int n_rows = slot_rows(a, me, ta, rows, w, &received, lane);
            src[0] = nullptr;
            warp_combine_token<T, V>(src, 1, 0, y, RB, rows, w, n_rows, weighted, out, off, len,
                                     lane);
          }
        } else if (!remote) {
          warp_zero_row<V>(out + off, len, lane);
        }
      }
      ++na;
      ca.next();
    }
  }
  finish_call(ctrl, epoch);
}

template <typename T>
cudaError_t launch_typed(const CombineArgs& a, const LaunchConfig& lc, cudaStream_t stream) {
  const int num_chunks = (a.T + lc.chunk - 1) / lc.chunk;
  if (lc.depth < 1 || lc.depth > kMaxDepth || lc.num_blocks > kMaxBlocks)
    return cudaErrorInvalidValue;
  const int v = row_vec_bytes(a.row_bytes);
  const KernelLaunch k{lc.num_blocks, lc.threads(), 0, stream};
  if (v >= 16) return launch(k, combine_kernel<T, 16>, a, lc, num_chunks);
  if (v >= 8) return launch(k, combine_kernel<T, 8>, a, lc, num_chunks);
  if (v >= 4 && sizeof(T) <= 4) return launch(k, combine_kernel<T, 4>, a, lc, num_chunks);
  return launch(k, combine_kernel<T, sizeof(T)>, a, lc, num_chunks);
}

}  // namespace

cudaError_t launch_combine(const CombineArgs& a, const LaunchConfig& lc, cudaStream_t stream) {
  if (a.K > kMaxK) return cudaErrorInvalidValue;
  switch (a.dtype) {
    case kBf16: return launch_typed<__nv_bfloat16>(a, lc, stream);
    case kF16: return launch_typed<__half>(a, lc, stream);
    case kF32: return launch_typed<float>(a, lc, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_ep
