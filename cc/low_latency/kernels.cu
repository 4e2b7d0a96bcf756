// Low-latency (decode) dispatch and combine (docs/semantics.md §12; the plan
// is docs/low_latency.md). The reference is jax_ep/low_latency/reference.py; these
// kernels give its bits.
//
// Dispatch sends each token once per destination rank (its row cast once, in
// column slices over the warps), with one int32 info word per (token, expert)
// pair; combine sends each pair's row on its own. The source knows where each
// pair lands (slot, computed in XLA before the kernel), so no counts are
// exchanged first: each op is one pass of stores plus one round of tagged
// signal words.
//
// Receive areas (LlLayout, low_latency/region_layout.h):
//  - dispatch: [max_ranks][Tmax] token rows on the expert's rank (source s's token t
//    at row s*Tmax + t) and an int32 info word t*K + k per pair (l, s, slot)
//    (the pair at its source, DeepEP's src_info): the receive kernel copies
//    token row (s, info / K) to the pair's output row, expert l's rows packed
//    by source (packed_row), and the info word, at that row, is an output of
//    the dispatch that the combine takes back.
//  - combine: [Tmax][K] rows on the source, row t*K + k for pair (t, k). The
//    alternative, an [E][Tmax] area indexed (expert, slot) as the reference
//    indexes its dense all_to_all, needs no info word but is E*Tmax rows per
//    parity (470 MB at V3-decode, Tmax 128, H 7168, bf16) against Tmax*K
//    (15 MB); the info word costs 4 bytes per dispatched row.
//
// Signals: the send kernels' blocks never wait. Each block fences and bumps
// a local counter when its stores are issued; the last block (which then
// sees every block's stores, fence-cumulativity) raises the signal words with
// system-scope release stores (NVSHMEM signal ops for ranks reached by puts:
// the transport seam below):
//  - dispatch: per (l, me) on the expert's rank, tag(epoch, n[l, me]) =
//    (epoch << 32) | (n + 1), from the expert_count input (the reference's
//    tokens per expert), so the receiver learns n[l, s] from the word;
//  - combine: per (me) on every source rank, tag(epoch, 0).
// A receive kernel waits (acquire, device-side timeout raising host_err,
// never a hang) for every word of its epoch, then reads rows.
//
// Epochs and parity: each op keeps two local counters (LlOpCtrl), the last
// finished send and the last finished receive; call e uses parity e % 2 for
// its rows and words, and tags its words with e, so nothing is ever reset.
// Two parities suffice when each rank runs send(e), recv(e), send(e+1), ...
// per op: rank A's send(e+2) into B's parity-e area comes after A's recv(e+1),
// which waited for B's send(e+1), which B issued after its recv(e) finished
// reading that area. One parity would not: A's send(e+1) may start while B's
// recv(e) still copies (A finished recv(e) first), overwriting rows B reads.
// (Two sends of one op in flight before the first receive, e.g. two
// micro-batches both dispatched before either is received, would need a
// third buffer; the hook must keep them interleaved.)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/fp8_cast.cuh"
#include "common/grid_work.cuh"
#include "common/launch.h"
#include "common/preload.h"
#include "common/row_copy.cuh"
#include "common/sync.cuh"
#include "low_latency/kernels.h"
#include "transport/nvshmem_put.cuh"
#include "transport/peer.cuh"

namespace jax_ep {

namespace {

// ---- Reaching other ranks. Rank r is reached one of two ways (bit r of
// put_mask, low_latency/kernels.h):
//  - P2P: a warp writes its row in place through peer_ptr;
//  - put: a warp writes its row into this rank's staging area and sends it
//    with put_row_warp (transport/nvshmem_put.cuh).
// Signals are send_signal<PUT, SignalOrder::kOrderedByCaller>: no fence at the
// signal itself. Each block fences before it arrives on the done counter and
// the last block fences again (fence cumulativity covers the P2P stores); a
// fence does not cover a put that a NIC carries out, so with puts each block
// first completes its puts (quiet_puts: done and visible at the target). The
// last block's signals then follow every block's rows, and the staging rows
// are free when the kernel ends.
// The send kernels are instantiated twice: PUT = false (no rank by puts: no
// NVSHMEM call at all) and PUT = true (per rank).
template <bool PUT>
__device__ __forceinline__ void ll_signal(const PeerTable& p, unsigned int put_mask, int r,
                                          size_t off, unsigned long long tag) {
  send_signal<PUT, SignalOrder::kOrderedByCaller>(p, put_mask, r, off, tag);
}

__device__ __forceinline__ LlOpCtrl* ll_ctrl(const PeerTable& p, const LlLayout& lay, int op) {
  return reinterpret_cast<LlOpCtrl*>(peer_ptr(p, p.rank, lay.ctrl)) + op;
}

__device__ __forceinline__ void set_epoch(unsigned int* w, unsigned int epoch) {
  *reinterpret_cast<volatile unsigned int*>(w) = epoch;
}

// A receive kernel's call: its op's control words, the call's epoch (one past
// the last received here) and parity, and that parity's n signal words at
// byte off of this rank's region (what this call's senders write).
struct LlRecvCall {
  LlOpCtrl* ctrl;
  unsigned int epoch;
  int par;
  const unsigned long long* words;
};

__device__ __forceinline__ LlRecvCall ll_recv_call(LlOpCtrl* ctrl, const PeerTable& p, int me,
                                                   size_t off, int n) {
  LlRecvCall c;
  c.ctrl = ctrl;
  c.epoch = ld_volatile(&ctrl->recv_epoch) + 1u;
  c.par = c.epoch & 1u;
  c.words = reinterpret_cast<const unsigned long long*>(peer_ptr(p, me, off)) +
            static_cast<size_t>(c.par) * n;
  return c;
}

// The last block of a receive kernel to finish records the call as received.
__device__ __forceinline__ void ll_recv_finish(const LlRecvCall& c) {
  if (last_block(&c.ctrl->recv_done) && threadIdx.x == 0) set_epoch(&c.ctrl->recv_epoch, c.epoch);
}

// The two-parity rule (top of file) needs send(e+1) after recv(e) on this
// rank: a send of an op whose previous receive has not finished raises
// kErrLlOrder and sends nothing (its peers then time out: a clear error, not
// silently overwritten rows). Block-uniform.
__device__ __forceinline__ bool ll_send_in_order(const LlOpCtrl* ctrl, int* host_err) {
  const unsigned int sent = ld_volatile(&ctrl->send_epoch);
  const unsigned int recvd = ld_volatile(&ctrl->recv_epoch);
  if (sent == recvd) return true;
  if (threadIdx.x == 0) raise_error(host_err, kErrLlOrder);
  return false;
}

// Every block of a send kernel calls this once, after its stores and puts:
// true (block-uniform) in the last block, which may then raise the signals.
// With puts, thread 0's quiet (after the barrier: every warp's puts issued)
// completes the block's puts first.
template <bool PUT>
__device__ __forceinline__ bool ll_send_finished(unsigned int* done) {
  if constexpr (PUT) {
    __syncthreads();
    if (threadIdx.x == 0) quiet_puts();
  }
  return last_block(done);
}

// ------------------------------------------------------------------ dispatch

// Column slices per row (warp_slices, common/grid_work.cuh) fill the grid's
// warps when there are fewer rows than warps (decode: 1024 pairs, 128 tokens
// against 2112 warps on an H200), in units of 4 fp8 groups (one warp step of
// the cast: 32 lanes x 16 elements) or of 128 vectors (one unrolled step of
// the row copy).

// MODE: kDispatchCopy, kDispatchCastBf16, kDispatchCastF32; PUT: some rank by puts.
// Work item (t, slice): the warp's lane k holds pair (t, k); the token's row
// (slice) is cast once and stored once per destination RANK, at row me*Tmax +
// t of that rank's area, however many of its experts live there (the receive
// kernel copies it to each expert's output row: one copy per (token, rank) on
// the link, DeepEP's normal-mode rule, instead of one per pair). The info
// words (one per pair, slice 0's warp, at the area's (expert, source, slot)
// word) say which token row each of the expert's rows takes.
template <int MODE, bool PUT>
__global__ void __launch_bounds__(32 * kLlMaxWarps)
ll_dispatch_send_kernel(LlDispatchSendArgs a) {
  __shared__ float sm_scales[kLlMaxWarps][kSmScales];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int me = a.peers.rank, R = a.peers.num_ranks, E = a.lay.L * R, K = a.lay.K;
  LlOpCtrl* ctrl = ll_ctrl(a.peers, a.lay, kLlDispatch);
  if (!ll_send_in_order(ctrl, a.host_err)) return;
  const unsigned int epoch = ld_volatile(&ctrl->send_epoch) + 1u;
  const int par = epoch & 1u;
  constexpr bool kCast = MODE != kDispatchCopy;
  const int v = row_vec_bytes(a.lay.row_bytes);
  const int G = a.hidden / 128;                        // cast: 128-channel groups
  const long long nvec = a.lay.row_bytes / v;          // copy: vectors per row
  const long long units = kCast ? (G + 3) / 4 : (nvec + 127) / 128;
  const int slices = warp_slices(a.T, units);
  const size_t row_off = a.lay.disp_rows[par] + (static_cast<size_t>(me) * a.lay.Tmax) * a.lay.row_stride;
  const size_t srow_off =
      a.lay.disp_scales[par] + (static_cast<size_t>(me) * a.lay.Tmax) * a.lay.s_row_stride;
  for (int it = global_warp(); it < a.T * slices; it += num_warps()) {
    const int t = it / slices, sl = it % slices;
    int j = -1, e = -1;
    if (lane < K) {
      j = __ldg(a.slot + t * K + lane);
      e = __ldg(a.topk_idx + t * K + lane);
    }
    const bool valid = lane < K && j >= 0 && j < a.lay.Tmax && e >= 0 && e < E;  // -1, repeats
    const int r = valid ? e / a.lay.L : -1;
    if (!__ballot_sync(0xffffffffu, valid)) continue;  // warp-uniform
    // The first pair of each destination rank names it (invalid lanes never match).
    const unsigned int same = __match_any_sync(0xffffffffu, valid ? r : -1 - lane);
    const unsigned int firsts = __ballot_sync(0xffffffffu, valid && __ffs(same) - 1 == lane);
    const size_t off = row_off + static_cast<size_t>(t) * a.lay.row_stride;
    const size_t soff = srow_off + static_cast<size_t>(t) * a.lay.s_row_stride;
    char* dst[kMaxRanks];
    char* dsts[kMaxRanks];
    int n = 0, si = 0;       // si: the staging row's index in dst (when puts)
    unsigned int puts = 0;   // bit r: rank r gets the staged row by a put
    for (unsigned int m = firsts; m; m &= m - 1) {
      const int rr = __shfl_sync(0xffffffffu, r, __ffs(m) - 1);
      if (PUT && by_put(a.put_mask, rr)) {
        if (!puts) {  // one staged copy (token t's staging row) serves every put rank
          si = n;
          dst[n] = own_ptr(a.peers, a.lay.disp_stage + static_cast<size_t>(t) * a.lay.row_stride);
          dsts[n++] = own_ptr(a.peers, a.lay.disp_stage_scales +
                                          static_cast<size_t>(t) * a.lay.s_row_stride);
        }
        puts |= 1u << rr;
        continue;
      }
      dst[n] = peer_ptr(a.peers, rr, off);
      dsts[n++] = peer_ptr(a.peers, rr, soff);
    }
    const char* xr = static_cast<const char*>(a.x) + t * a.x_row_bytes;
    const long long u0 = units * sl / slices, u1 = units * (sl + 1) / slices;
    long long b0, b1;  // this slice's bytes of the row
    int g0 = 0, g1 = 0;
    if constexpr (kCast) {
      using Tin = std::conditional_t<MODE == kDispatchCastBf16, __nv_bfloat16, float>;
      g0 = static_cast<int>(4 * u0);
      g1 = static_cast<int>(min(4 * u1, static_cast<long long>(G)));
      b0 = 128LL * g0;
      b1 = 128LL * g1;
      warp_cast_row<Tin, 16>(reinterpret_cast<const Tin*>(xr), dst, dsts, n, g0, g1, lane,
                             a.scale_mode, sm_scales[warp]);
    } else {
      vec_slice(nvec, v, sl, slices, &b0, &b1);
      warp_copy_row_any(xr, reinterpret_cast<void* const*>(dst), n, b0, b1 - b0, v, lane);
    }
    if constexpr (PUT) {
      if (puts) {
        __syncwarp();
        for (unsigned int m = puts; m; m &= m - 1) {
          const int rr = __ffs(m) - 1;
          put_row_warp(a.peers, rr, off + b0, dst[si] + b0, b1 - b0);
          if constexpr (kCast)
            put_row_warp(a.peers, rr, soff + 4LL * g0, dsts[si] + 4LL * g0, 4LL * (g1 - g0));
        }
      }
    }
    if (sl == 0 && valid) {  // each pair's info word: t*K + k at the area's (l, me, slot) word
      const int l = e % a.lay.L;
      const size_t ioff =
          a.lay.disp_info[par] + ((static_cast<size_t>(l) * R + me) * a.lay.Tmax + j) * 4;
      const int32_t tk = t * K + lane;
      if (PUT && by_put(a.put_mask, r))  // travels by value: nothing to stage
        put_int32(a.peers, r, ioff, tk);
      else
        *reinterpret_cast<int32_t*>(peer_ptr(a.peers, r, ioff)) = tk;
    }
  }
  if (ll_send_finished<PUT>(&ctrl->send_done)) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const int r = e / a.lay.L, l = e % a.lay.L;
      const size_t w = a.lay.disp_count + ((static_cast<size_t>(par) * a.lay.L + l) * R + me) * 8;
      ll_signal<PUT>(a.peers, a.put_mask, r, w, chunk_tag(epoch, __ldg(a.expert_count + e)));
    }
    if (threadIdx.x == 0) set_epoch(&ctrl->send_epoch, epoch);
  }
}

// Output row of valid row i (block b = l*R + s of the exclusive prefix `pre`
// over blocks): expert l's rows start at l*R*Tmax, its sources' rows one
// after the other from there (pre[l*R] rows belong to earlier experts).
__device__ __forceinline__ long long packed_row(const int* pre, int b, int R, int Tmax, int i) {
  const int l = b / R;
  return static_cast<long long>(l) * R * Tmax + (i - pre[l * R]);
}

__global__ void __launch_bounds__(32 * kLlMaxWarps)
ll_dispatch_recv_kernel(LlDispatchRecvArgs a) {
  extern __shared__ int sm_pre[];  // [L*R + 1]: counts, then their exclusive prefix
  const int lane = threadIdx.x % 32;
  const int me = a.peers.rank, R = a.peers.num_ranks, LR = a.lay.L * R;
  const LlRecvCall call =
      ll_recv_call(ll_ctrl(a.peers, a.lay, kLlDispatch), a.peers, me, a.lay.disp_count, LR);
  const unsigned int epoch = call.epoch;
  const int par = call.par;
  const auto* words = call.words;
  // Word b = l*R + s; each thread acquires its words, the barrier in the scan
  // then orders the row reads of every warp after them.
  for (int b = threadIdx.x; b < LR; b += blockDim.x) {
    int n = 0;
    if (wait_tag(words + b, chunk_tag(epoch, -1), a.host_err, a.timeout_ns))
      n = static_cast<int>(static_cast<unsigned int>(ld_acquire_sys64(words + b))) - 1;
    sm_pre[b] = min(max(n, 0), a.lay.Tmax);
  }
  puts_visible_block(a.put_mask, words);
  block_exclusive_scan(sm_pre, LR);
  if (blockIdx.x == 0) {
    for (int b = threadIdx.x; b < LR; b += blockDim.x) a.src_count[b] = sm_pre[b + 1] - sm_pre[b];
    for (int l = threadIdx.x; l < a.lay.L; l += blockDim.x)
      a.count[l] = sm_pre[(l + 1) * R] - sm_pre[l * R];
  }
  // Valid rows only, spread evenly over the warps (skewed routing fills one
  // block): row v of the valid ones is row j = v - pre[b] of block b.
  const char* rows = peer_ptr(a.peers, me, a.lay.disp_rows[par]);
  const char* srows = peer_ptr(a.peers, me, a.lay.disp_scales[par]);
  const auto* info = reinterpret_cast<const int32_t*>(peer_ptr(a.peers, me, a.lay.disp_info[par]));
  // Region rows are row_stride apart, output rows row_bytes (a call's rows may
  // be shorter than the region's).
  const long long rb = a.lay.row_bytes, srb = a.lay.s_row_bytes;
  const long long rs = a.lay.row_stride, srs = a.lay.s_row_stride;
  const int v = row_vec_bytes(rb), sv = srb ? row_vec_bytes(srb) : 1;
  const int TK = a.lay.Tmax * a.lay.K, n_rows = sm_pre[LR];
  const long long nvec = rb / v;
  const int slices = warp_slices(n_rows, (nvec + 127) / 128);
  for (int it = global_warp(); it < n_rows * slices; it += num_warps()) {
    const int i = it / slices, sl = it % slices;
    const int b = locate(sm_pre, LR, i);
    const long long row = static_cast<long long>(b) * a.lay.Tmax + (i - sm_pre[b]);  // in the area
    const long long orow = packed_row(sm_pre, b, R, a.lay.Tmax, i);
    // Output row orow (expert l's rows packed by source) takes source s's
    // token row t = info / K: one row per (token, rank) in the area, one copy
    // per expert here.
    const int tk = info[row];
    if (sl == 0 && lane == 0) a.out_info[orow] = tk;
    if (tk < 0 || tk >= TK) continue;  // never for a peer's own send
    const long long src = static_cast<long long>(b % R) * a.lay.Tmax + tk / a.lay.K;
    void* dst = static_cast<char*>(a.out) + orow * rb;
    long long b0, b1;
    vec_slice(nvec, v, sl, slices, &b0, &b1);
    warp_copy_row_any(rows + src * rs, &dst, 1, b0, b1 - b0, v, lane);
    if (srb && sl == 0) {
      void* dsts = static_cast<char*>(a.out_scales) + orow * srb;
      warp_copy_row_any(srows + src * srs, &dsts, 1, 0, srb, sv, lane);
    }
  }
  ll_recv_finish(call);
}

// ------------------------------------------------------------------- combine

template <bool PUT>  // some rank by puts
__global__ void __launch_bounds__(32 * kLlMaxWarps)
ll_combine_send_kernel(LlCombineSendArgs a) {
  extern __shared__ int sm_pre[];  // [L*R + 1]
  const int lane = threadIdx.x % 32;
  const int me = a.peers.rank, R = a.peers.num_ranks, LR = a.lay.L * R;
  LlOpCtrl* ctrl = ll_ctrl(a.peers, a.lay, kLlCombine);
  if (!ll_send_in_order(ctrl, a.host_err)) return;
  const unsigned int epoch = ld_volatile(&ctrl->send_epoch) + 1u;
  const int par = epoch & 1u;
  for (int b = threadIdx.x; b < LR; b += blockDim.x)
    sm_pre[b] = min(max(__ldg(a.src_count + b), 0), a.lay.Tmax);
  block_exclusive_scan(sm_pre, LR);
  const long long cb = a.lay.comb_row_bytes;
  const int v = row_vec_bytes(cb), n_rows = sm_pre[LR];
  const long long nvec = cb / v;
  const int slices = warp_slices(n_rows, (nvec + 127) / 128);
  for (int it = global_warp(); it < n_rows * slices; it += num_warps()) {
    const int i = it / slices, sl = it % slices;
    const int b = locate(sm_pre, LR, i), s = b % R;
    const long long row = packed_row(sm_pre, b, R, a.lay.Tmax, i);   // in y and info
    const int tk = __ldg(a.info + row);
    if (tk < 0 || tk >= a.lay.Tmax * a.lay.K) continue;  // never for a dispatch's own info
    const size_t off = a.lay.comb_rows[par] + tk * a.lay.comb_row_stride;
    const bool put = PUT && by_put(a.put_mask, s);  // warp-uniform
    // By put: written to staging row i first (i < comb_stage_rows for a
    // dispatch's own src_count: low_latency/region_layout.h).
    if (put && i >= a.lay.comb_stage_rows) continue;
    char* dst = put ? own_ptr(a.peers, a.lay.comb_stage + i * a.lay.comb_row_stride)
                    : peer_ptr(a.peers, s, off);
    long long b0, b1;
    vec_slice(nvec, v, sl, slices, &b0, &b1);
    warp_copy_row_any(static_cast<const char*>(a.y) + row * cb,
                      reinterpret_cast<void* const*>(&dst), 1, b0, b1 - b0, v, lane);
    if constexpr (PUT) {
      if (put) {
        __syncwarp();
        put_row_warp(a.peers, s, off + b0, dst + b0, b1 - b0);
      }
    }
  }
  if (ll_send_finished<PUT>(&ctrl->send_done)) {
    for (int s = threadIdx.x; s < R; s += blockDim.x)
      ll_signal<PUT>(a.peers, a.put_mask, s,
                     a.lay.comb_flag + (static_cast<size_t>(par) * R + me) * 8,
                     chunk_tag(epoch, 0));
    if (threadIdx.x == 0) set_epoch(&ctrl->send_epoch, epoch);
  }
}

// Bytes [off, off + len) of out[t] = cast(sum_k sel_k), sel_k = slot_k >= 0 ?
// w_k * f32(row(t, k)) : 0, in the f32 operations of the reference's HLO: XLA
// folds its `zeros + sel_0` to sel_0, so the sum starts at sel_0 (not 0 + sel_0,
// which differs for -0), then adds sel_1, sel_2, ... one rounding each
// (__fmul_rn / __fadd_rn, no FMA). (XLA's CPU backend contracts some of these
// into FMAs on hosts that have them, after hoisting the select out of its row
// loop; the loopback test runs the reference without FMA for that reason.
// Whether XLA:GPU contracts any is not yet checked.) slot_l / w_l: lane k
// holds pair k's.
template <typename T, int V>
__device__ __forceinline__ void reduce_slice(const char* area, long long stride, int t, int K,
                                             int slot_l, float w_l, char* out, long long off,
                                             long long len, int lane) {
  using Vec = typename VecT<V>::type;
  constexpr int EL = V / sizeof(T);
  const long long nv = len / V;
  // Warp-uniform trip count: the shuffles below need every lane (a lane past
  // nv still runs the loop, with every vector guarded).
  for (long long base = 0; base < nv; base += 32 * kU) {
    const long long i0 = base + lane;
    float acc[kU][EL] = {};
    for (int k = 0; k < K; ++k) {
      const int sk = __shfl_sync(0xffffffffu, slot_l, k);
      const float wk = __shfl_sync(0xffffffffu, w_l, k);
      if (sk < 0) {  // sel_k = +0 (warp-uniform branch)
#pragma unroll
        for (int u = 0; u < kU; ++u)
#pragma unroll
          for (int e = 0; e < EL; ++e) acc[u][e] = k == 0 ? 0.f : __fadd_rn(acc[u][e], 0.f);
        continue;
      }
      Vec x[kU];
      load_vecs<V>(area + (static_cast<long long>(t) * K + k) * stride + off, i0, nv, x);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (i0 + 32 * u >= nv) continue;
        const T* xt = reinterpret_cast<const T*>(&x[u]);
#pragma unroll
        for (int e = 0; e < EL; ++e) {
          const float term = __fmul_rn(wk, Cvt<T>::f(xt[e]));
          acc[u][e] = k == 0 ? term : __fadd_rn(acc[u][e], term);
        }
      }
    }
    store_acc<T, V>(acc, out + off, i0, nv);
  }
}

template <typename T>
__global__ void __launch_bounds__(32 * kLlMaxWarps)
ll_combine_recv_kernel(LlCombineRecvArgs a) {
  const int lane = threadIdx.x % 32;
  const int me = a.peers.rank, R = a.peers.num_ranks;
  const LlRecvCall call =
      ll_recv_call(ll_ctrl(a.peers, a.lay, kLlCombine), a.peers, me, a.lay.comb_flag, R);
  for (int s = threadIdx.x; s < R; s += blockDim.x)
    wait_tag(call.words + s, chunk_tag(call.epoch, -1), a.host_err, a.timeout_ns);
  __syncthreads();
  puts_visible_block(a.put_mask, call.words);
  const char* area = peer_ptr(a.peers, me, a.lay.comb_rows[call.par]);
  const long long rb = a.lay.comb_row_bytes;
  const int K = a.lay.K;
  const bool v16 = rb % 16 == 0;
  const int vb = v16 ? 16 : int(sizeof(T));
  const long long nv = rb / vb;
  // Column slices of a row per warp when there are fewer tokens than warps.
  const int slices = max(1, min(num_warps() / max(a.T, 1), static_cast<int>((nv + 31) / 32)));
  for (int it = global_warp(); it < a.T * slices; it += num_warps()) {
    const int t = it / slices, sl = it % slices;
    const int slot_l = lane < K ? __ldg(a.slot + t * K + lane) : -1;
    const float w_l = lane < K ? __ldg(a.weights + t * K + lane) : 0.f;
    long long off, len;
    row_slice(nv, vb, sl, slices, &off, &len);
    char* out = static_cast<char*>(a.out) + t * rb;
    const long long rs = a.lay.comb_row_stride;
    if (v16) reduce_slice<T, 16>(area, rs, t, K, slot_l, w_l, out, off, len, lane);
    else reduce_slice<T, sizeof(T)>(area, rs, t, K, slot_l, w_l, out, off, len, lane);
  }
  ll_recv_finish(call);
}

bool grid_ok(const LlGrid& g) {
  return g.num_blocks >= 1 && g.warps >= 1 && g.warps <= kLlMaxWarps;
}

// A call's rows fit the region's strides (and 16-byte vectors stay aligned
// when the rows are: strides are multiples of 16 whenever the rows are).
bool rows_ok(const LlLayout& y) {
  return y.row_bytes <= y.row_stride && y.s_row_bytes <= y.s_row_stride &&
         y.comb_row_bytes <= y.comb_row_stride;
}

// Puts name ranks of the group only.
static_assert(kMaxRanks < 32, "put_mask holds a bit per rank");
bool mask_ok(unsigned int put_mask, int R) { return R >= 1 && R <= kMaxRanks && !(put_mask >> R); }

// A send by puts needs the staging areas to send from (the runtime's region).
bool sends_ok(unsigned int put_mask, int R, const LlLayout& y) {
  return mask_ok(put_mask, R) && (!put_mask || y.comb_stage_rows > 0);
}

// One block of g per SM (or the budget), `smem` dynamic shared memory.
KernelLaunch ll_launch(const LlGrid& g, size_t smem, cudaStream_t s) {
  return {g.num_blocks, 32 * g.warps, smem, s};
}

template <int MODE>
cudaError_t dispatch_send(const LlDispatchSendArgs& a, const KernelLaunch& k) {
  if (a.put_mask) return launch(k, ll_dispatch_send_kernel<MODE, true>, a);
  return launch(k, ll_dispatch_send_kernel<MODE, false>, a);
}

}  // namespace

// Receives spin on peers' sends: whoever starts the low-latency kernels on a
// device (the runtime at attach, the loopback harness) loads all of them
// first (common/preload.h says why).
cudaError_t preload_ll_kernels() {
  static KernelPreload preload;
  return preload.once({
      reinterpret_cast<const void*>(ll_dispatch_send_kernel<kDispatchCopy, false>),
      reinterpret_cast<const void*>(ll_dispatch_send_kernel<kDispatchCastBf16, false>),
      reinterpret_cast<const void*>(ll_dispatch_send_kernel<kDispatchCastF32, false>),
      reinterpret_cast<const void*>(ll_dispatch_send_kernel<kDispatchCopy, true>),
      reinterpret_cast<const void*>(ll_dispatch_send_kernel<kDispatchCastBf16, true>),
      reinterpret_cast<const void*>(ll_dispatch_send_kernel<kDispatchCastF32, true>),
      reinterpret_cast<const void*>(ll_dispatch_recv_kernel),
      reinterpret_cast<const void*>(ll_combine_send_kernel<false>),
      reinterpret_cast<const void*>(ll_combine_send_kernel<true>),
      reinterpret_cast<const void*>(ll_combine_recv_kernel<__nv_bfloat16>),
      reinterpret_cast<const void*>(ll_combine_recv_kernel<__half>),
      reinterpret_cast<const void*>(ll_combine_recv_kernel<float>)});
}

cudaError_t launch_ll_dispatch_send(const LlDispatchSendArgs& a, const LlGrid& g, cudaStream_t s) {
  const bool cast = a.mode == kDispatchCastBf16 || a.mode == kDispatchCastF32;
  if (!grid_ok(g) || !rows_ok(a.lay) || !sends_ok(a.put_mask, a.peers.num_ranks, a.lay) ||
      a.lay.K < 1 || a.lay.K > kLlMaxTopk || a.lay.L < 1 || a.T < 0 || a.T > a.lay.Tmax ||
      (cast && (a.hidden % 128 != 0 || a.lay.s_row_bytes != a.hidden / 128 * 4 ||
                a.lay.row_bytes != a.hidden)) ||
      (!cast && (a.mode != kDispatchCopy || a.lay.row_bytes != a.x_row_bytes)))
    return cudaErrorInvalidValue;
  const KernelLaunch k = ll_launch(g, 0, s);
  switch (a.mode) {
    case kDispatchCastBf16: return dispatch_send<kDispatchCastBf16>(a, k);
    case kDispatchCastF32: return dispatch_send<kDispatchCastF32>(a, k);
    default: return dispatch_send<kDispatchCopy>(a, k);
  }
}

cudaError_t launch_ll_dispatch_recv(const LlDispatchRecvArgs& a, const LlGrid& g, cudaStream_t s) {
  const long long LR = static_cast<long long>(a.lay.L) * a.peers.num_ranks;
  if (!grid_ok(g) || !rows_ok(a.lay) || a.lay.L < 1 || LR > kLlMaxBlocksLR ||
      !mask_ok(a.put_mask, a.peers.num_ranks))
    return cudaErrorInvalidValue;
  return launch(ll_launch(g, (LR + 1) * sizeof(int), s), ll_dispatch_recv_kernel, a);
}

cudaError_t launch_ll_combine_send(const LlCombineSendArgs& a, const LlGrid& g, cudaStream_t s) {
  const long long LR = static_cast<long long>(a.lay.L) * a.peers.num_ranks;
  if (!grid_ok(g) || !rows_ok(a.lay) || a.lay.L < 1 || LR > kLlMaxBlocksLR || a.lay.K < 1 ||
      a.lay.K > kLlMaxTopk || !sends_ok(a.put_mask, a.peers.num_ranks, a.lay))
    return cudaErrorInvalidValue;
  const KernelLaunch k = ll_launch(g, (LR + 1) * sizeof(int), s);
  if (a.put_mask) return launch(k, ll_combine_send_kernel<true>, a);
  return launch(k, ll_combine_send_kernel<false>, a);
}

cudaError_t launch_ll_combine_recv(const LlCombineRecvArgs& a, const LlGrid& g, cudaStream_t s) {
  // The combine area holds Tmax x K rows: a larger T reads past it.
  if (!grid_ok(g) || !rows_ok(a.lay) || a.lay.K < 1 || a.lay.K > kLlMaxTopk || a.T < 0 ||
      a.T > a.lay.Tmax || !mask_ok(a.put_mask, a.peers.num_ranks))
    return cudaErrorInvalidValue;
  const KernelLaunch k = ll_launch(g, 0, s);
  switch (a.dtype) {
    case kBf16:
      if (a.lay.comb_row_bytes % 2) return cudaErrorInvalidValue;
      return launch(k, ll_combine_recv_kernel<__nv_bfloat16>, a);
    case kF16:
      if (a.lay.comb_row_bytes % 2) return cudaErrorInvalidValue;
      return launch(k, ll_combine_recv_kernel<__half>, a);
    case kF32:
      if (a.lay.comb_row_bytes % 4) return cudaErrorInvalidValue;
      return launch(k, ll_combine_recv_kernel<float>, a);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_ep
