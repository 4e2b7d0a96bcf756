// Internode (hierarchical) dispatch, docs/internode.md. Three warp roles per
// block, each a pipeline stage that waits only on the stage before it (on
// other ranks), so with every block resident nothing can deadlock:
//   sender    (source s = (n, g)): chunk j of its tokens; each token once per
//             destination node m (any of m's ranks in send_mask), into the
//             forwarder (m, g)'s net area [n][t], cast to fp8 here (once, at
//             the source), with a G-bit mask of the ranks of m that want it;
//             one network signal per (forwarder, chunk), sent for every chunk.
//   forwarder (f = (m, g)): per source node ns and chunk j, once its signal is
//             up: each token row to the ranks of m in its mask, over NVLink,
//             into their nvl area [s][t] (s = (ns, g)); one flag per (rank of
//             m, s, chunk), raised for every chunk.
//   receiver  (r): per source rank s and chunk j: the rows into out at
//             slot_row[s, t, :], exactly the intranode receiver's gather (and
//             its zero rows while flags are down).
// Every flag is raised each call whether or not data moved, so a rank that
// finished call e has seen every rank it depends on start call e; with the
// areas double-buffered by call parity no area is rewritten while read
// (docs/internode.md, "Reuse across calls").
// PUT (template): some forwarder is reached by NVSHMEM puts (put_mask,
// legs.cuh): its rows, scales and mask words are staged here and put;
// PUT = false is the P2P kernel with no NVSHMEM call.
// Windows: a kernel moves tokens [t0, t0 + tw) of the call (the launcher runs
// one kernel per window of the region's layout T); t below is the index in
// the window (areas, flags, chunks), t0 + t the call's token (x, send_mask,
// slot_row). Group padding rows are zeroed by the first window's kernel.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/launch.h"
#include "common/row_copy.cuh"
#include "internode/legs.cuh"
#include "intranode/dispatch_rows.cuh"

namespace jax_ep {

namespace {

// Whole warp, PUT only: token t's staged row (and scales) to the forwarder of
// every node in put_t, at its network slot (the offset the P2P path writes).
__device__ __forceinline__ void put_token_row(const PeerTable& p, unsigned int put_t, int G,
                                              int my_g, const InterDispatchAreas& ar, size_t slot,
                                              int t, long long RB, long long SB) {
  if (!put_t) return;
  __syncwarp();  // every lane's staging writes before the warp's puts read them
  for (int nd = 0; put_t >> nd; ++nd) {
    if (!((put_t >> nd) & 1u)) continue;
    put_row_warp(p, nd * G + my_g, ar.net_rows + slot * RB,
                 ar.stage_rows + size_t(t) * RB, RB);
    if (SB)
      put_row_warp(p, nd * G + my_g, ar.net_scales + slot * SB,
                   ar.stage_scales + size_t(t) * SB, SB);
  }
}

// Whole warp, PUT only, after __syncwarp: the mask words of tokens [t0, t1)
// (0 for a token the node does not want: the forwarder reads every one) to
// each node reached by puts, one contiguous put per node.
__device__ __forceinline__ void put_chunk_meta(const PeerTable& p, unsigned int put_nodes, int N,
                                               int G, int my_node, int my_g,
                                               const InterDispatchAreas& ar, int LT, int t0,
                                               int t1) {
  for (int nd = 0; nd < N; ++nd) {
    if (!((put_nodes >> nd) & 1u)) continue;
    put_row_warp(p, nd * G + my_g, ar.net_meta + (size_t(my_node) * LT + t0) * 4,
                 ar.stage_meta + (size_t(nd) * LT + t0) * 4, 4LL * (t1 - t0));
  }
}

template <int EPL, bool PUT>
__global__ void __launch_bounds__(512, 1)
inter_dispatch_kernel(InterDispatchArgs ia, InterLaunch lc) {
  const DispatchArgs& a = ia.a;
  __shared__ float sm_scales[16][kSmScales];
  const InterFrame fr = inter_frame(ia, a.peers, lc.chunk, kInterDispatch);
  const int me = fr.me, R = fr.R, N = fr.N, G = fr.G, my_node = fr.my_node, my_g = fr.my_g;
  const int T = fr.T, t0 = fr.t0, chunk = fr.chunk, NC = fr.NC;
  const int LT = fr.lay.T;  // token stride of every flag and data area (>= T)
  const InterLayout& lay = fr.lay;
  const InterDispatchAreas ar = inter_dispatch_areas(
      lay.op_base(kInterDispatch, fr.epoch & 1u), N, G, LT, a.row_bytes, a.s_row_bytes);
  const unsigned long long tag = chunk_tag(fr.epoch, 0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int v = row_vec_bytes(a.row_bytes);
  const int sv = a.s_row_bytes ? row_vec_bytes(a.s_row_bytes) : 1;
  const long long RB = a.row_bytes, SB = a.s_row_bytes;

  if (warp < lc.send_warps) {
    // ---- sender: the network leg out ----
    float* sm = sm_scales[warp & 15];
    const int nw = gridDim.x * lc.send_warps;
    unsigned int put_nodes = 0;  // bit nd: forwarder (nd, my_g) is reached by puts
    if constexpr (PUT)
      for (int nd = 0; nd < N; ++nd)
        if (by_put(ia.put_mask, nd * G + my_g)) put_nodes |= 1u << nd;
    for (int j = blockIdx.x * lc.send_warps + warp; j < NC; j += nw) {
      for (int t = j * chunk; t < min(T, (j + 1) * chunk); ++t) {
        // lane m < N: the mask of node m's ranks that want t
        unsigned int m = 0;
        if (lane < N)
          for (int gg = 0; gg < G; ++gg)
            if (a.send_mask[static_cast<long long>(t0 + t) * R + lane * G + gg]) m |= 1u << gg;
        const unsigned int nodes = __ballot_sync(0xffffffffu, m != 0);
        const size_t slot = size_t(my_node) * LT + t;
        if (lane < N) {
          if (PUT && ((put_nodes >> lane) & 1u))  // staged: the chunk's words go in one put
            *reinterpret_cast<uint32_t*>(own_ptr(a.peers, ar.stage_meta + (size_t(lane) * LT + t) * 4)) = m;
          else
            *reinterpret_cast<uint32_t*>(net_dst(a.peers, lane * G + my_g, ar.net_meta + slot * 4)) = m;
        }
        const unsigned int put_t = PUT ? nodes & put_nodes : 0u;  // nodes t goes to by puts
        char* dst[kMaxRanks];
        char* dsts[kMaxRanks];
        int n = 0;
        for (int nd = 0; nd < N; ++nd) {
          if (!((nodes >> nd) & 1u) || ((put_t >> nd) & 1u)) continue;
          dst[n] = net_dst(a.peers, nd * G + my_g, ar.net_rows + slot * RB);
          dsts[n] = net_dst(a.peers, nd * G + my_g, ar.net_scales + slot * SB);
          ++n;
        }
        if (put_t) {  // one staged copy (n < N here), put to each of those nodes below
          dst[n] = own_ptr(a.peers, ar.stage_rows + size_t(t) * RB);
          dsts[n] = own_ptr(a.peers, ar.stage_scales + size_t(t) * SB);
          ++n;
        }
        if (n)
          move_row_slice<EPL>(a, t0 + t,
                              static_cast<const char*>(a.x) + static_cast<long long>(t0 + t) * a.x_row_bytes,
                              dst, dsts, n, 0, 1, v, sv, lane, sm);
        if constexpr (PUT) put_token_row(a.peers, put_t, G, my_g, ar, slot, t, RB, SB);
      }
      __syncwarp();
      if constexpr (PUT) put_chunk_meta(a.peers, put_nodes, N, G, my_node, my_g, ar, LT, j * chunk,
                                        min(T, (j + 1) * chunk));
      if (lane < N)
        send_signal<PUT, SignalOrder::kFenceFirst>(
            a.peers, ia.put_mask, lane * G + my_g,
            lay.d_net_ready + (size_t(my_node) * LT + j) * 8, tag);
      __syncwarp();
    }
  } else if (warp < lc.send_warps + lc.fwd_warps) {
    // ---- forwarder: network area -> the node's ranks over NVLink ----
    const int nw = gridDim.x * lc.fwd_warps;
    const char* net_rows = peer_ptr(a.peers, me, ar.net_rows);
    const char* net_scales = peer_ptr(a.peers, me, ar.net_scales);
    const uint32_t* net_meta = reinterpret_cast<const uint32_t*>(peer_ptr(a.peers, me, ar.net_meta));
    for (int it = blockIdx.x * lc.fwd_warps + warp - lc.send_warps; it < NC * N; it += nw) {
      const int j = it / N, ns = it % N, s = ns * G + my_g;  // chunk-major: early chunks first
      const size_t flag = lay.d_net_ready + (size_t(ns) * LT + j) * 8;
      wait_local(a.peers, flag, tag, a.host_err, a.timeout_ns);
      puts_visible_warp<PUT>(a.peers, flag, lane);
      for (int t = j * chunk; t < min(T, (j + 1) * chunk); ++t) {
        const size_t slot = size_t(ns) * LT + t;
        const unsigned int m = net_meta[slot];
        if (!m) continue;
        char* dst[kMaxRanks];
        char* dsts[kMaxRanks];
        int n = 0;
        const size_t out_slot = size_t(s) * LT + t;
        for (int gg = 0; gg < G; ++gg) {
          if (!((m >> gg) & 1u)) continue;
          dst[n] = nvl_dst(a.peers, my_node * G + gg, ar.nvl_rows + out_slot * RB);
          dsts[n] = nvl_dst(a.peers, my_node * G + gg, ar.nvl_scales + out_slot * SB);
          ++n;
        }
        warp_copy_row_any(net_rows + slot * RB, reinterpret_cast<void* const*>(dst), n, 0, RB, v,
                          lane);
        if (SB)
          warp_copy_row_any(net_scales + slot * SB, reinterpret_cast<void* const*>(dsts), n, 0, SB,
                            sv, lane);
      }
      __syncwarp();
      if (lane < G)
        nvl_signal(a.peers, my_node * G + lane, lay.d_nvl_ready + (size_t(s) * LT + j) * 8, tag);
      __syncwarp();
    }
  } else {
    // ---- receiver: nvl area -> out (slot_row), zero rows while waiting ----
    const int rw = warp - lc.send_warps - lc.fwd_warps;
    const int nrw = gridDim.x * lc.recv_warps, gw = blockIdx.x * lc.recv_warps + rw;
    const char* nvl_rows = peer_ptr(a.peers, me, ar.nvl_rows);
    const char* nvl_scales = peer_ptr(a.peers, me, ar.nvl_scales);
    char* rows[kMaxDst];
    char* srows[kMaxDst];
    ZeroCursor zc(t0 == 0 ? gw : a.C, nrw);  // padding rows: the first window's
    for (int it = gw;;) {
      if (it >= NC * R) {  // only zero rows left
        const int z = zc.pop(a, lane);
        if (z < 0) break;
        warp_zero_row_any(static_cast<char*>(a.out) + static_cast<long long>(z) * RB, RB, lane);
        if (SB) warp_zero_row_any(static_cast<char*>(a.out_scales) + static_cast<long long>(z) * SB, SB, lane);
        continue;
      }
      const int j = it / R, s = it % R;
      const size_t flag = lay.d_nvl_ready + (size_t(s) * LT + j) * 8;
      if (!ready_local(a.peers, flag, tag)) {
        const int z = zc.pop(a, lane);
        if (z >= 0) {
          warp_zero_row_any(static_cast<char*>(a.out) + static_cast<long long>(z) * RB, RB, lane);
          if (SB) warp_zero_row_any(static_cast<char*>(a.out_scales) + static_cast<long long>(z) * SB, SB, lane);
          continue;
        }
        wait_local(a.peers, flag, tag, a.host_err, a.timeout_ns);
      }
      for (int t = j * chunk; t < min(T, (j + 1) * chunk); ++t) {
        const int n = gather_rows(a, s, t0 + t, rows, srows, lane);
        if (n == 0) continue;
        const size_t slot = size_t(s) * LT + t;
        warp_copy_row_any(nvl_rows + slot * RB, reinterpret_cast<void* const*>(rows), n, 0, RB, v,
                          lane);
        if (SB)
          warp_copy_row_any(nvl_scales + slot * SB, reinterpret_cast<void* const*>(srows), n, 0,
                            SB, sv, lane);
      }
      it += nrw;
    }
  }
  inter_finish<PUT>(fr.ctrl, fr.epoch);
}

template <int EPL>
cudaError_t launch_epl(const InterDispatchArgs& a, const InterLaunch& lc, cudaStream_t stream) {
  const KernelLaunch k{lc.num_blocks, lc.threads(), 0, stream};
  if (a.put_mask) return launch(k, inter_dispatch_kernel<EPL, true>, a, lc);
  return launch(k, inter_dispatch_kernel<EPL, false>, a, lc);
}

}  // namespace

InterLaunch make_inter_launch(int T, int layout_T, int num_blocks, int chunk) {
  InterLaunch lc;
  lc.num_blocks = num_blocks < 1 ? 1 : num_blocks;
  if (chunk <= 0) {  // one chunk per sender warp at least, at most 4 tokens
    const int warps = lc.num_blocks * lc.send_warps;
    chunk = (inter_window(T, layout_T) + warps - 1) / warps;
    chunk = chunk < 1 ? 1 : chunk > 4 ? 4 : chunk;
  }
  lc.chunk = chunk;
  return lc;
}

const char* inter_dispatch_check(const InterDispatchArgs& ia) {
  const DispatchArgs& a = ia.a;
  const int R = a.peers.num_ranks;
  if (ia.nodes < 1 || R < 1 || R > kMaxRanks || R % ia.nodes != 0)
    return "internode dispatch: the ranks must split into `nodes` nodes of equal size";
  if (a.T < 1) return "internode dispatch: T must be >= 1";
  if (a.K > kMaxDst) return "internode dispatch: top-k above 32";
  if (a.mode == kDispatchCombineBwd)
    return "internode dispatch: the fused combine backward is not implemented";
  if ((a.mode == kDispatchCastBf16 || a.mode == kDispatchCastF32) && a.hidden % 128 != 0)
    return "internode dispatch: hidden % 128";
  const int G = R / ia.nodes;
  const InterLayout lay = inter_layout(ia.sym_bytes, ia.nodes, G, a.T, ia.layout_T);
  const InterDispatchAreas ar = inter_dispatch_areas(0, ia.nodes, G, lay.T, a.row_bytes, a.s_row_bytes);
  if (ar.end > lay.op_bytes / 2)
    return "internode dispatch: the buffer is smaller than internode_buffer_bytes()";
  return "";
}

cudaError_t launch_inter_dispatch(const InterDispatchArgs& a, const InterLaunch& lc,
                                  cudaStream_t stream) {
  if (*inter_dispatch_check(a) || lc.threads() > 512 || lc.chunk < 1)
    return cudaErrorInvalidValue;
  return for_each_inter_window(a, [&](const InterDispatchArgs& w) {
    if (w.a.mode != kDispatchCopy) return launch_epl<16>(w, lc, stream);
    return launch_epl<8>(w, lc, stream);
  });
}

}  // namespace jax_ep
