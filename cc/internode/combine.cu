// Internode (hierarchical) combine, docs/internode.md: dispatch's path
// backwards, three warp roles per block, each waiting only on the stage before:
//   contributor (expert side r = (m, g')): for every (source s = (ns, g), token
//             t) it received, its partial p_r = cast(sum_k w_k * f32(y_k))
//             (rank_major: the row of y), over NVLink into the forwarder
//             (m, g)'s area [g'][ns][t], with a "received" byte; one flag per
//             (forwarder, source node, chunk), raised for every chunk.
//   forwarder (f = (m, g)): per source node ns and chunk j, once its node's G
//             flags are up: P_m = cast(sum_{g' ascending, received} f32(p_g')),
//             once across the network into source (ns, g)'s area [m][t]; one
//             network signal per (source, chunk), raised for every chunk.
//   source    (s): per chunk, once the N forwarders' signals are up: out[t] =
//             cast(sum_{m ascending, t sent to a rank of m} f32(P_m)); 0 when t
//             went nowhere.
// So out differs from the intranode sum (ranks ascending, one f32 chain) by
// the node grouping of the f32 sum and one rounding of each node partial to
// y's dtype (DeepEP's order too). With one node, or one rank per node, it is
// the intranode result bit for bit (cast is idempotent). Fixed order:
// deterministic run to run. The arithmetic is combine_rows.cuh's (no FMA).
// PUT (template): some source is reached by NVSHMEM puts (put_mask,
// legs.cuh): the forwarder stages its node partial and puts it; PUT =
// false is the P2P kernel with no NVSHMEM call.
// Windows (as internode_dispatch.cu): a kernel sums tokens [t0, t0 + tw) of
// the call; t below indexes the window (areas, flags, chunks), t0 + t the
// call's token (slot_row, send_mask, out).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/launch.h"
#include "common/row_copy.cuh"
#include "internode/legs.cuh"
#include "intranode/combine_rows.cuh"

namespace jax_ep {

namespace {

template <typename T, int V, bool PUT>
__global__ void __launch_bounds__(512, 1)
inter_combine_kernel(InterCombineArgs ia, InterLaunch lc) {
  const CombineArgs& a = ia.a;
  const InterFrame fr = inter_frame(ia, a.peers, lc.chunk, kInterCombine);
  const int me = fr.me, R = fr.R, N = fr.N, G = fr.G, my_node = fr.my_node, my_g = fr.my_g;
  const int NT = fr.T, t0 = fr.t0, chunk = fr.chunk, NC = fr.NC;
  const int LT = fr.lay.T;  // token stride of every flag and data area (>= NT)
  const InterLayout& lay = fr.lay;
  const InterCombineAreas ar =
      inter_combine_areas(lay.op_base(kInterCombine, fr.epoch & 1u), N, G, LT, a.row_bytes);
  const unsigned long long tag = chunk_tag(fr.epoch, 0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const char* y = static_cast<const char*>(a.y);
  const bool weighted = a.row_weights != nullptr && !a.rank_major;
  const long long RB = a.row_bytes;

  if (warp < lc.send_warps) {
    // ---- contributor: partials of every received (s, t) to s's forwarder here ----
    int rows[kMaxK];
    float w[kMaxK];
    const int nw = gridDim.x * lc.send_warps;
    for (int it = blockIdx.x * lc.send_warps + warp; it < NC * R; it += nw) {
      const int j = it / R, s = it % R, ns = s / G, f = my_node * G + s % G;
      const size_t base = (size_t(my_g) * N + ns) * LT;
      for (int t = j * chunk; t < min(NT, (j + 1) * chunk); ++t) {
        bool received;
        const int n = slot_rows(a, s, t0 + t, rows, w, &received, lane);
        if (lane == 0) *reinterpret_cast<uint8_t*>(nvl_dst(a.peers, f, ar.cnvl_meta + base + t)) = received;
        if (!received) continue;
        char* dst = nvl_dst(a.peers, f, ar.cnvl_rows + (base + t) * RB);
        if (n == 0) {  // every pair dropped (capacity): a zero partial, as intranode
          warp_zero_row<V>(dst, RB, lane);
        } else if (a.rank_major) {
          void* d[1] = {dst};
          warp_copy_row_multi<V>(y + static_cast<long long>(rows[0]) * RB, d, 1, 0, RB, lane);
        } else {
          warp_reduce_rows<T, V>(y, RB, rows, w, n, weighted, dst, 0, RB, lane);
        }
      }
      __syncwarp();
      if (lane == 0) nvl_signal(a.peers, f, lay.c_nvl_ready + (base + j) * 8, tag);
      __syncwarp();
    }
  } else if (warp < lc.send_warps + lc.fwd_warps) {
    // ---- forwarder: node partial, once across the network ----
    const int nw = gridDim.x * lc.fwd_warps;
    const char* cnvl_rows = peer_ptr(a.peers, me, ar.cnvl_rows);
    const uint8_t* cnvl_meta = reinterpret_cast<const uint8_t*>(peer_ptr(a.peers, me, ar.cnvl_meta));
    for (int it = blockIdx.x * lc.fwd_warps + warp - lc.send_warps; it < NC * N; it += nw) {
      const int j = it / N, ns = it % N, s = ns * G + my_g;
      const bool put = PUT && by_put(ia.put_mask, s);  // warp-uniform
      for (int gg = 0; gg < G; ++gg)
        wait_local(a.peers, lay.c_nvl_ready + ((size_t(gg) * N + ns) * LT + j) * 8, tag,
                   a.host_err, a.timeout_ns);
      for (int t = j * chunk; t < min(NT, (j + 1) * chunk); ++t) {
        const char* src[kMaxRanks];
        int q = 0;
        for (int gg = 0; gg < G; ++gg) {
          const size_t slot = (size_t(gg) * N + ns) * LT + t;
          if (cnvl_meta[slot]) src[q++] = cnvl_rows + slot * RB;
        }
        if (!q) continue;  // t reached no rank of this node: the source expects nothing
        const size_t off = ar.cnet_rows + (size_t(my_node) * LT + t) * RB;
        const size_t stage = ar.cstage_rows + (size_t(ns) * LT + t) * RB;
        char* dst = put ? own_ptr(a.peers, stage) : net_dst(a.peers, s, off);
        warp_combine_token<T, V>(src, q, -1, nullptr, RB, nullptr, nullptr, 0, false, dst, 0, RB,
                                 lane);
        if constexpr (PUT) {
          if (put) {
            __syncwarp();  // every lane's staged bytes before the warp's put reads them
            put_row_warp(a.peers, s, off, stage, RB);
          }
        }
      }
      __syncwarp();
      if (lane == 0)
        send_signal<PUT, SignalOrder::kFenceFirst>(
            a.peers, ia.put_mask, s, lay.c_net_ready + (size_t(my_node) * LT + j) * 8, tag);
      __syncwarp();
    }
  } else {
    // ---- source: sum the node partials, nodes ascending ----
    const int nw = gridDim.x * lc.recv_warps;
    const char* cnet_rows = peer_ptr(a.peers, me, ar.cnet_rows);
    for (int j = blockIdx.x * lc.recv_warps + warp - lc.send_warps - lc.fwd_warps; j < NC;
         j += nw) {
      for (int nd = 0; nd < N; ++nd)
        wait_local(a.peers, lay.c_net_ready + (size_t(nd) * LT + j) * 8, tag, a.host_err,
                   a.timeout_ns);
      puts_visible_warp<PUT>(a.peers, lay.c_net_ready + j * 8, lane);
      for (int t = j * chunk; t < min(NT, (j + 1) * chunk); ++t) {
        const bool* mb = a.send_mask + static_cast<long long>(t0 + t) * R;
        const char* src[kMaxRanks];
        int q = 0;
        for (int nd = 0; nd < N; ++nd) {
          bool any = false;
          for (int gg = 0; gg < G; ++gg) any |= mb[nd * G + gg];
          if (any) src[q++] = cnet_rows + (size_t(nd) * LT + t) * RB;
        }
        char* out = static_cast<char*>(a.out) + static_cast<long long>(t0 + t) * RB;
        if (!q) warp_zero_row<V>(out, RB, lane);
        else warp_combine_token<T, V>(src, q, -1, nullptr, RB, nullptr, nullptr, 0, false, out, 0,
                                      RB, lane);
      }
    }
  }
  inter_finish<PUT>(fr.ctrl, fr.epoch);
}

template <typename T, int V>
cudaError_t launch_v(const InterCombineArgs& a, const InterLaunch& lc, cudaStream_t stream) {
  const KernelLaunch k{lc.num_blocks, lc.threads(), 0, stream};
  if (a.put_mask) return launch(k, inter_combine_kernel<T, V, true>, a, lc);
  return launch(k, inter_combine_kernel<T, V, false>, a, lc);
}

template <typename T>
cudaError_t launch_typed(const InterCombineArgs& a, const InterLaunch& lc, cudaStream_t stream) {
  const int v = row_vec_bytes(a.a.row_bytes);
  if (v >= 16) return launch_v<T, 16>(a, lc, stream);
  if (v >= 8) return launch_v<T, 8>(a, lc, stream);
  if (v >= 4 && sizeof(T) <= 4) return launch_v<T, 4>(a, lc, stream);
  return launch_v<T, sizeof(T)>(a, lc, stream);
}

}  // namespace

const char* inter_combine_check(const InterCombineArgs& ia) {
  const CombineArgs& a = ia.a;
  const int R = a.peers.num_ranks;
  if (ia.nodes < 1 || R < 1 || R > kMaxRanks || R % ia.nodes != 0)
    return "internode combine: the ranks must split into `nodes` nodes of equal size";
  if (a.T < 1) return "internode combine: T must be >= 1";
  if (a.K > kMaxK) return "internode combine: top-k above 32";
  if (a.dtype != kBf16 && a.dtype != kF16 && a.dtype != kF32)
    return "internode combine: dtype must be bf16, f16 or f32";
  const int G = R / ia.nodes;
  const InterLayout lay = inter_layout(ia.sym_bytes, ia.nodes, G, a.T, ia.layout_T);
  if (inter_combine_areas(0, ia.nodes, G, lay.T, a.row_bytes).end > lay.op_bytes / 2)
    return "internode combine: the buffer is smaller than internode_buffer_bytes()";
  return "";
}

cudaError_t launch_inter_combine(const InterCombineArgs& a, const InterLaunch& lc,
                                 cudaStream_t stream) {
  if (*inter_combine_check(a) || lc.threads() > 512 || lc.chunk < 1) return cudaErrorInvalidValue;
  return for_each_inter_window(a, [&](const InterCombineArgs& w) {
    switch (w.a.dtype) {
      case kBf16: return launch_typed<__nv_bfloat16>(w, lc, stream);
      case kF16: return launch_typed<__half>(w, lc, stream);
      default: return launch_typed<float>(w, lc, stream);
    }
  });
}

}  // namespace jax_ep
