// Layout of the internode (hierarchical) dispatch / combine region: R = N
// nodes x G ranks per node, rank r = node r / G, local index r % G (nodes are
// consecutive ranks of the EP axis; docs/internode.md).
//
// First version: dedicated receive areas (no bounded rings), one row slot per
// (sender, token), so nothing is ever reused inside a call and no credits are
// needed. The region (from byte 0 of the buffer given) is
//
//   ctrl          InterCtrl[2]            dispatch, combine (local counters)
//   d_net_ready   u64 [N][T]   forwarder: source node ns raised chunk j
//   d_nvl_ready   u64 [R][T]   receiver:  the forwarder of source rank s raised chunk j
//   c_nvl_ready   u64 [G][N][T] forwarder: contributor g' raised chunk j of source node ns
//   c_net_ready   u64 [N][T]   source:    the forwarder of node n raised chunk j
//   dispatch data 2 parity halves of op_bytes / 2
//   combine data  2 parity halves of op_bytes / 2
//
// Flags are indexed by chunk (chunk >= 1 token, so at most T chunks) and hold
// epoch-tagged words (common/sync.cuh chunk_tag), monotonic over calls: never reset.
// Per parity half, dispatch: net_rows [N][T] (+ net_scales, net_meta u32: the
// G-bit mask of the node's ranks that want the token), nvl_rows [R][T] (+
// nvl_scales); combine: cnvl_rows [G][N][T] (+ cnvl_meta u8: the contributor
// received the token), cnet_rows [N][T]. Sizes: the per-parity bytes below;
// the region is laid out for T = the window (calls of more tokens run as
// several kernels, one per window: launch_inter_dispatch / _combine).
// Staging of the network leg by NVSHMEM puts (appended last, so the areas
// above keep their offsets): a put reads its source from the symmetric heap,
// so a row bound for a node reached by puts is written here first. Dispatch:
// stage_rows [T] (+ stage_scales; a token's row is the same for every node,
// one staged copy is put to each), stage_meta u32 [N][T] (the mask differs
// per node); combine: cstage_rows [N][T] (the node partial for source node ns).
#pragma once

#include <cuda_runtime.h>  // __host__ __device__

#include <cstddef>
#include <cstdint>

#include "runtime/regions.h"
#include "runtime/runtime.h"

namespace jax_ep {

// Shape the internode region is sized for (jax_ep.initialize(config=...) with
// an EpConfig of num_nodes > 1): nodes, EP ranks, T (the layout's fixed T,
// the window: longer calls run as windows of it), hidden. nodes <= 1: no region.
struct InterShape {
  int nodes = 0, ranks = 0, T = 0, hidden = 0;
  RegionShape dims() const { return {nodes, ranks, T, hidden}; }
  static InterShape of(const RegionShape& d) { return {d[0], d[1], d[2], d[3]}; }
};

// The kernels compute the layout themselves (from the call's shape): every
// function here is __host__ __device__.
__host__ __device__ inline size_t inter_align(size_t n) {
  return (n + kRegionAlign - 1) & ~(kRegionAlign - 1);
}

struct InterCtrl {
  unsigned int epoch;  // last finished epoch (local only)
  unsigned int done;   // blocks finished in the current call
  unsigned int pad[30];
};
enum InterOp : int { kInterDispatch = 0, kInterCombine = 1 };

// Per-parity data of dispatch: rows of row_bytes, scale rows of s_row_bytes.
struct InterDispatchAreas {
  size_t net_rows = 0, net_scales = 0, net_meta = 0, nvl_rows = 0, nvl_scales = 0;
  size_t stage_rows = 0, stage_scales = 0, stage_meta = 0, end = 0;
};
__host__ __device__ inline InterDispatchAreas inter_dispatch_areas(size_t base, int N, int G, int T,
                                               long long row_bytes, long long s_row_bytes) {
  InterDispatchAreas d;
  const size_t nt = size_t(N) * size_t(T), rt = size_t(N) * size_t(G) * size_t(T);
  size_t o = inter_align(base);
  d.net_rows = o;
  o = inter_align(o + nt * size_t(row_bytes));
  d.net_scales = o;
  o = inter_align(o + nt * size_t(s_row_bytes));
  d.net_meta = o;
  o = inter_align(o + nt * sizeof(uint32_t));
  d.nvl_rows = o;
  o = inter_align(o + rt * size_t(row_bytes));
  d.nvl_scales = o;
  o = inter_align(o + rt * size_t(s_row_bytes));
  d.stage_rows = o;
  o = inter_align(o + size_t(T) * size_t(row_bytes));
  d.stage_scales = o;
  o = inter_align(o + size_t(T) * size_t(s_row_bytes));
  d.stage_meta = o;
  o = inter_align(o + nt * sizeof(uint32_t));
  d.end = o;
  return d;
}

// Per-parity data of combine: rows of row_bytes.
struct InterCombineAreas {
  size_t cnvl_rows = 0, cnvl_meta = 0, cnet_rows = 0, cstage_rows = 0, end = 0;
};
__host__ __device__ inline InterCombineAreas inter_combine_areas(size_t base, int N, int G, int T,
                                             long long row_bytes) {
  InterCombineAreas c;
  const size_t nt = size_t(N) * size_t(T), gnt = size_t(G) * nt;
  size_t o = inter_align(base);
  c.cnvl_rows = o;
  o = inter_align(o + gnt * size_t(row_bytes));
  c.cnvl_meta = o;
  o = inter_align(o + gnt);
  c.cnet_rows = o;
  o = inter_align(o + nt * size_t(row_bytes));
  c.cstage_rows = o;
  o = inter_align(o + nt * size_t(row_bytes));
  c.end = o;
  return c;
}

struct InterLayout {
  int N = 0, G = 0, T = 0;
  size_t ctrl = 0, d_net_ready = 0, d_nvl_ready = 0, c_nvl_ready = 0, c_net_ready = 0;
  size_t data = 0;      // start of the two op regions
  size_t op_bytes = 0;  // each op's region (two parity halves of op_bytes / 2)
  __host__ __device__ size_t op_base(int op, int parity) const {
    return data + size_t(op) * op_bytes + size_t(parity) * (op_bytes / 2);
  }
};

// Flag words per flag array: (N x T, N*G x T, G*N x T, N x T), or with
// fixed_T > 0 (the runtime's region, internode/ffi_handlers.cc) kMaxRanks x fixed_T
// for every array: then no flag offset depends on the call's T or node split,
// so calls of any shape share the region and a flag word only ever holds tags
// (a data word left where a later call's flag lies could pass for a tag).
struct InterFlagRows {
  size_t t = 1, net = 0, nvl = 0, cnvl = 0, cnet = 0;
};
__host__ __device__ inline InterFlagRows inter_flag_rows(int N, int G, int T, int fixed_T) {
  InterFlagRows f;
  if (fixed_T > 0) {
    f.t = size_t(fixed_T);
    f.net = f.nvl = f.cnvl = f.cnet = size_t(kMaxRanks);
  } else {
    f.t = size_t(T > 0 ? T : 1);
    f.net = f.cnet = size_t(N);
    f.nvl = f.cnvl = size_t(N) * size_t(G);
  }
  return f;
}

// Bytes before the data: control and flags.
inline size_t inter_head_bytes(int N, int G, int T, int fixed_T = 0) {
  const InterFlagRows f = inter_flag_rows(N, G, T, fixed_T);
  size_t o = inter_align(2 * sizeof(InterCtrl));
  o = inter_align(o + f.net * f.t * 8);
  o = inter_align(o + f.nvl * f.t * 8);
  o = inter_align(o + f.cnvl * f.t * 8);
  o = inter_align(o + f.cnet * f.t * 8);
  return o;
}

// The region in a buffer of sym_bytes: the data after the head, split evenly
// between the two ops (op_bytes 0 when the head does not fit). fixed_T > 0:
// the layout of the runtime's region (see InterFlagRows); y.T is then fixed_T,
// the token stride of every flag and data area (a kernel moves at most
// fixed_T tokens: longer calls run as windows of it).
__host__ __device__ inline InterLayout inter_layout(size_t sym_bytes, int N, int G, int T,
                                                    int fixed_T = 0) {
  InterLayout y;
  y.N = N;
  y.G = G;
  const InterFlagRows f = inter_flag_rows(N, G, T, fixed_T);
  y.T = int(f.t);
  size_t o = 0;
  y.ctrl = o;
  o = inter_align(o + 2 * sizeof(InterCtrl));
  y.d_net_ready = o;
  o = inter_align(o + f.net * f.t * 8);
  y.d_nvl_ready = o;
  o = inter_align(o + f.nvl * f.t * 8);
  y.c_nvl_ready = o;
  o = inter_align(o + f.cnvl * f.t * 8);
  y.c_net_ready = o;
  o = inter_align(o + f.cnet * f.t * 8);
  y.data = o;
  y.op_bytes = sym_bytes > o ? ((sym_bytes - o) / 2) & ~(2 * kRegionAlign - 1) : 0;
  return y;
}

// The buffer that holds both ops for N x G ranks and T tokens: dispatch rows
// of row_bytes (+ s_row_bytes of fp8 scales), combine rows of comb_row_bytes.
// Per rank and parity: dispatch (N + R + 1) * T rows, combine (G + 2) * N * T
// rows (each with its staging).
inline size_t internode_buffer_bytes(int N, int G, int T, long long row_bytes,
                                     long long s_row_bytes, long long comb_row_bytes) {
  const size_t d = inter_dispatch_areas(0, N, G, T > 0 ? T : 1, row_bytes, s_row_bytes).end;
  const size_t c = inter_combine_areas(0, N, G, T > 0 ? T : 1, comb_row_bytes).end;
  const size_t half = inter_align(d > c ? d : c);
  return inter_head_bytes(N, G, T) + 4 * half + 4 * kRegionAlign;
}

// The runtime's internode region (Runtime::region(kRegionInternode), jax_ep.initialize with
// an EpConfig of num_nodes > 1): the fixed_T = T layout, data sized for N
// nodes of ceil(R / N) ranks (a smaller EP group with N nodes fits too), rows
// of the widest dtype: dispatch f32 rows of `hidden` (+ hidden / 128 f32
// scales), combine f32 rows. 0 when N <= 1.
inline size_t internode_region_bytes(int N, int R, int T, int hidden) {
  if (N <= 1 || R < 1 || T < 1 || hidden < 1) return 0;
  const int G = (R + N - 1) / N;
  const long long row = 4LL * hidden, srow = 4LL * (hidden / 128);
  const size_t d = inter_dispatch_areas(0, N, G, T, row, srow).end;
  const size_t c = inter_combine_areas(0, N, G, T, row).end;
  const size_t half = inter_align(d > c ? d : c);
  return inter_head_bytes(N, G, T, T) + 4 * half + 4 * kRegionAlign;
}

}  // namespace jax_ep
