// fp8 NT grouped matmul on Hopper (contract: gmm/kernels.h): a persistent,
// warp-specialized kernel on a ring of fp8_ring.cuh. One CTA per SM walks the
// output tiles (256 rows of one row tile x 128 columns) t = blockIdx.x, +
// gridDim.x, ...; per tile and 128-wide k-step the producer thread loads the
// tile's x rows (the upper 128 only when the tile stores some of them), the v
// tile and the rows' scales. The tile's rows are four 64-row blocks; consumer
// warpgroup wg owns blocks wg and wg + 2, so a tile with 128 rows or fewer to
// store still keeps both consumers busy, and a block holding none of them
// issues no WGMMA. Tiles that store rows of their first 64-row block only (a
// small group, a group's last rows) come paired from the table
// (cuda_fp8.pair_one_block_tiles): a pair's stage holds both 64-row x blocks
// and both groups' weight tiles (the second in the x tile's upper half), and
// each consumer runs one of them. Per block a consumer runs the block's
// product, then adds it times xs[row] * vs[block] to the block's f32 sum (one
// FMA per register): the tensor core's fp8 partial sums are promoted every 128
// of the contraction, as DeepSeek-V3 does. While one consumer promotes, the
// other's WGMMAs run. The sums go to HBM only for the rows [lo, hi) of the
// tile: from registers, or (GmmFp8Args::tma_store, bf16 only) through a
// shared-memory copy of the tile stored by TMA where a 64-row block lies wholly
// inside [lo, hi), a ring of 3 stages then leaving room for it. The TMA store
// frees the consumers from the global-store queue (ncu, V3 down on an H100: 17%
// of their stalls). A consumer releases each stage as its last WGMMA on it
// completes, before that block's promotion, so the producer refills it
// meanwhile: what lets 3 stages keep up with 4 (tuning.py, fp8 tile store).
//
// Why 256 rows: with 128-row tiles the kernel waited on memory (ncu on an
// H100, V3 up projection at 256 rows per group: L2 throughput 95%, DRAM 77%,
// tensor work 53%): every 128 rows re-read the group's weight tile. A 256-row
// tile reads it once per 256 rows, a quarter fewer L2 bytes per flop; the sums
// of two blocks and one product buffer fit a consumer's 232 registers.
#include <type_traits>

#include "gmm/fp8_ring.cuh"
#include "gmm/kernels.h"
#include "gmm/tensor_map.h"

namespace jax_ep {
namespace {

using namespace fp8_ring;

constexpr int kRows = 2 * kBM;          // a tile's rows
using FwdRing = RingOf<kRows, 4>;       // 4 stages of 49.5 KB: what shared memory holds
constexpr uint32_t kStageTx = FwdRing::kABytes + kTileBytes + kRows * 4;
// A pair of one-block tiles: two 64-row x blocks (rows 0-63 and 64-127 of the
// stage's x tile), two weight tiles (the stage's B tile and the x tile's upper
// half) and two blocks of row scales.
constexpr uint32_t kPairTx = kTileBytes + 2 * kTileBytes + 2 * 64 * 4;
// With TMA stores: 3 stages and the bf16 tile, 4 boxes of 8 KB per consumer (64 KB in all).
using FwdTmaSmem = WithOut<RingOf<kRows, 3>, kConsumers * 4 * kBoxBytes>;
template <bool Tma>
using FwdSmem = std::conditional_t<Tma, FwdTmaSmem, FwdRing>;

// A row tile of the table at one column tile; where it stores rows of its
// first 64-row block only, perhaps paired with another such tile (p_*; p_group
// -1: none), whose block the second consumer runs beside it.
struct Tile {
  int row_start, lo, hi, group, col;
  int p_row_start = 0, p_lo = 0, p_hi = 0, p_group = -1;
  __device__ bool paired() const { return p_group >= 0; }
  // the partner as consumer 1 sees it: its block 0 at this tile's block 1
  __device__ Tile partner_view() const { return {p_row_start - 64, p_lo, p_hi, p_group, col}; }
  // whether the tile stores any of its rows [128, 256): the upper half is loaded
  __device__ bool upper() const { return row_start + kBM < hi; }
  // whether the tile stores any row of its 64-row block b
  __device__ bool block_on(int b) const {
    const int r = row_start + 64 * b;
    return group >= 0 && r < hi && r + 64 > lo;
  }
  // whether all 64 rows of block b are the tile's to store
  __device__ bool block_whole(int b) const {
    const int r = row_start + 64 * b;
    return r >= lo && r + 64 <= hi;
  }
};

__device__ __forceinline__ Tile tile_at(const GmmFp8Args& a, int t, int grid_n) {
  const int f = t / grid_n, p = a.partner[f];
  Tile tl{a.row_start[f], a.lo[f], a.hi[f], a.group[f], t % grid_n};
  if (p >= 0 && p < a.tiles) {
    tl.p_row_start = a.row_start[p];
    tl.p_lo = a.lo[p];
    tl.p_hi = a.hi[p];
    tl.p_group = a.group[p];
  }
  return tl;
}

// The consumers read the tile table a tile ahead, its entry for tile t spread
// over lanes 0-3 of each warp (row_start, lo, hi, group) and its partner's
// over lanes 4-7: each lane's load has its own address, so the values stay in
// plain registers until the broadcast at the tile's start (loaded where the
// tile starts, their latency from L2 would sit before its first WGMMAs).
__device__ __forceinline__ int tile_entry_part(const GmmFp8Args& a, int t, int grid_n) {
  const int f = t / grid_n, lane = threadIdx.x % 32;
  const int* field = lane % 4 == 0 ? a.row_start : lane % 4 == 1 ? a.lo
                     : lane % 4 == 2 ? a.hi : a.group;
  int src = lane < 4 ? f : lane < 8 ? a.partner[f] : -1;
  if (src >= a.tiles) src = -1;   // a partner past the table: none
  return src >= 0 ? field[src] : (lane % 4 == 3 ? -1 : 0);
}
__device__ __forceinline__ Tile tile_from_parts(int part, int t, int grid_n) {
  const auto at = [&](int lane) { return __shfl_sync(0xffffffffu, part, lane); };
  return {at(0), at(1), at(2), at(3), t % grid_n, at(4), at(5), at(6), at(7)};
}

// A tile's weight-block scales (contiguous over its k-steps) 32 k-steps at a
// time in the lanes of each warp, lane l holding step k0 + l, the next 32
// loaded a chunk ahead: a k-step reads its scale by a shuffle. Loaded per
// k-step, the 4-byte global load landed after the stage it scales had
// arrived (ncu: 6% of the forward's stall samples on that one wait).
class BlockScales {
 public:
  __device__ BlockScales(const float* vs, int ksteps) : vs_(vs), ksteps_(ksteps) {
    cur_ = load(0);
    next_ = load(32);
  }
  // step k's scale; every lane of the warp calls it with the same k, in order
  __device__ __forceinline__ float at(int k) {
    if (k % 32 == 0 && k > 0) {
      cur_ = next_;
      next_ = load(k + 32);
    }
    return __shfl_sync(0xffffffffu, cur_, k % 32);
  }

 private:
  __device__ __forceinline__ float load(int k0) const {
    const int k = k0 + static_cast<int>(threadIdx.x % 32);
    return k < ksteps_ ? vs_[k] : 0.f;
  }
  const float* vs_;
  int ksteps_;
  float cur_, next_;
};

template <typename R>
__device__ void produce(const GmmFp8Args& a, const Maps& m, const R& r, int tiles,
                        int grid_n, int ksteps) {
  for (const CUtensorMap* map : {&m.a, &m.b, &m.a_scales, &m.a_block, &m.a_block_scales})
    sm90::tma_prefetch(map);
  uint32_t i = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile tl = tile_at(a, t, grid_n);
    if (tl.group < 0) continue;   // a tail tile: zeros, nothing to load
    const int v_row = tl.group * a.n + tl.col * kBN;
    if (tl.paired()) {   // x blocks at rows 0 and 64, the partner's weight in the upper half
      const int p_row = tl.p_group * a.n + tl.col * kBN;
      for (int k = 0; k < ksteps; ++k, ++i) {
        const int s = r.fill(i, kPairTx);
        uint64_t* full = &r.full[s];
        uint8_t* x_tile = r.a + s * R::kABytes;
        sm90::tma_load_2d(x_tile, &m.a_block, full, k * kBK, tl.row_start);
        sm90::tma_load_2d(x_tile + kTileBytes / 2, &m.a_block, full, k * kBK, tl.p_row_start);
        sm90::tma_load_2d(r.b + s * kTileBytes, &m.b, full, k * kBK, v_row);
        sm90::tma_load_2d(x_tile + kTileBytes, &m.b, full, k * kBK, p_row);
        sm90::tma_load_2d(r.a_scales + s * kRows, &m.a_block_scales, full, tl.row_start, k);
        sm90::tma_load_2d(r.a_scales + s * kRows + 64, &m.a_block_scales, full, tl.p_row_start,
                          k);
      }
      continue;
    }
    const bool load_upper = tl.upper();
    for (int k = 0; k < ksteps; ++k, ++i) {
      const int s = r.fill(i, kStageTx - (load_upper ? 0 : kTileBytes));
      uint64_t* full = &r.full[s];
      uint8_t* x_tile = r.a + s * R::kABytes;
      sm90::tma_load_2d(x_tile, &m.a, full, k * kBK, tl.row_start);
      if (load_upper)
        sm90::tma_load_2d(x_tile + kTileBytes, &m.a, full, k * kBK, tl.row_start + kBM);
      sm90::tma_load_2d(r.b + s * kTileBytes, &m.b, full, k * kBK, v_row);
      sm90::tma_load_2d(r.a_scales + s * kRows, &m.a_scales, full, tl.row_start, k);
    }
  }
}

// Consumer: block `b`'s product for the current stage of `c`, promoted into
// `sum`; `release`: the consumer's last read of the stage, released before the
// promotion.
template <typename R>
__device__ __forceinline__ void block_kstep(float (&sum)[64], float (&prod)[64],
                                            const ConsumerRing<R>& c, int b, uint32_t w_desc,
                                            float w_scale, bool release) {
  issue_product(prod, c.a_desc(b), w_desc);
  // the rows' scales while the tensor core runs
  const float s0 = c.a_scale(b, 0) * w_scale;
  const float s1 = c.a_scale(b, 8) * w_scale;
  wait_product(prod);
  // the stage's last read is done: the producer may refill it during the promotion
  c.release(release);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    sum[4 * j + 0] = fmaf(prod[4 * j + 0], s0, sum[4 * j + 0]);
    sum[4 * j + 1] = fmaf(prod[4 * j + 1], s0, sum[4 * j + 1]);
    sum[4 * j + 2] = fmaf(prod[4 * j + 2], s1, sum[4 * j + 2]);
    sum[4 * j + 3] = fmaf(prod[4 * j + 3], s1, sum[4 * j + 3]);
  }
}

// Consumer wg's blocks block wg (where tma_lower) and block wg + 2 (where tma_upper) through
// its 32 KB of the tile buffer, stored by TMA.
template <typename R>
__device__ __forceinline__ void store_blocks_tma(const float (&lower)[64],
                                                 const float (&upper)[64], bool tma_lower,
                                                 bool tma_upper,
                                                 const Maps& m, const R& r, const Tile& tl,
                                                 int wg) {
  if (!tma_lower && !tma_upper) return;
  uint8_t* mine = r.out_tile + wg * 4 * kBoxBytes;
  const int row0 = tl.row_start + 64 * wg, row1 = row0 + kBM;
  staged_tma_store(
      wg,
      [&] {
        if (tma_lower) put_block_bf16(lower, mine);
        if (tma_upper) put_block_bf16(upper, mine + 2 * kBoxBytes);
      },
      [&] {
        const int c0 = tl.col * kBN;
        if (tma_lower) store_block_tma(&m.out, mine, c0, row0);
        if (tma_upper) store_block_tma(&m.out, mine + 2 * kBoxBytes, c0, row1);
      });
}

template <typename Out, bool Tma, typename R>
__device__ void consume(const GmmFp8Args& a, const Maps& m, const R& r, int tiles, int grid_n,
                        int ksteps, int wg) {
  float prod[64], lower[64], upper[64];   // the sums of blocks wg and wg + 2
  ConsumerRing<R> c(r);
  int part = blockIdx.x < tiles ? tile_entry_part(a, blockIdx.x, grid_n) : 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile entry = tile_from_parts(part, t, grid_n);
    if (t + gridDim.x < tiles) part = tile_entry_part(a, t + gridDim.x, grid_n);
    // in a pair consumer 1 runs the partner's block, as block 1 of its view,
    // against the partner's weight in the x tile's upper half
    const bool runs_partner = entry.paired() && wg == 1;
    const Tile tl = runs_partner ? entry.partner_view() : entry;
#pragma unroll
    for (int j = 0; j < 64; ++j) lower[j] = upper[j] = 0.f;
    const bool on_lower = tl.block_on(wg), on_upper = tl.block_on(wg + 2);
    // the tile's weight-block scales, [ksteps] (a tail tile reads none)
    BlockScales ws(a.vs + (static_cast<long long>(max(tl.group, 0)) * (a.n / kBN) + tl.col) * ksteps,
                   tl.group >= 0 ? ksteps : 0);
    for (int k = 0; tl.group >= 0 && k < ksteps; ++k, c.next()) {
      const float w_scale = ws.at(k);   // the shuffle runs while this thread waits for the stage
      c.wait_loaded();
      const uint32_t w_desc = runs_partner ? c.a_desc(2) : c.b_desc();
      if (on_lower) block_kstep(lower, prod, c, wg, w_desc, w_scale, !on_upper);
      if (on_upper) block_kstep(upper, prod, c, wg + 2, w_desc, w_scale, true);
      if (!on_lower && !on_upper) c.release();
    }
    // rows outside [lo, hi) belong to a neighbouring group (or the tail): not
    // stored; with TMA stores a block whose rows all are the tile's goes by
    // TMA, the others from registers
    const bool tma_lower = Tma && tl.block_whole(wg), tma_upper = Tma && tl.block_whole(wg + 2);
    const auto keep = [&](long long rr) { return rr >= tl.lo && rr < tl.hi; };
    Out* out = static_cast<Out*>(a.out);
    if (!tma_lower) store_tile(lower, out, a.n, tl.row_start, tl.col * kBN, wg, keep);
    if (!tma_upper) store_tile(upper, out, a.n, tl.row_start + kBM, tl.col * kBN, wg, keep);
    if constexpr (Tma) store_blocks_tma(lower, upper, tma_lower, tma_upper, m, r, tl, wg);
  }
  if constexpr (Tma) drain_tma_stores();
}

template <typename Out, bool Tma>
__global__ void __launch_bounds__(kThreads, 1)
    gmm_fp8_nt_kernel(const __grid_constant__ Maps maps, const __grid_constant__ GmmFp8Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem[];
  const int grid_n = a.n / kBN, ksteps = a.kc / kBK;
  // the counts come from device memory: never past the table
  const int tiles = min(a.counts[0] + a.counts[1], a.tiles) * grid_n;
  static_assert(!Tma || std::is_same_v<Out, __nv_bfloat16>, "TMA stores bf16 tiles");
  using S = FwdSmem<Tma>;
  run<S>(smem, [&](const S& r) { produce(a, maps, r, tiles, grid_n, ksteps); },
         [&](const S& r, int wg) { consume<Out, Tma>(a, maps, r, tiles, grid_n, ksteps, wg); });
#else
  __trap();   // built for sm_90a only (CMakeLists.txt)
#endif
}

}  // namespace

const char* gmm_fp8_shape_error(const GmmFp8Args& a) {
  if (a.kc <= 0 || a.kc % kBK) return "Kc must be a positive multiple of 128";
  if (a.n <= 0 || a.n % kBN) return "N must be a positive multiple of 128";
  if (a.m < kBM || a.m % 8) return "M must be a multiple of 8 and at least 128";
  if (a.groups <= 0) return "there must be at least one group";
  if (static_cast<long long>(a.groups) * a.n >= (1LL << 31)) return "G * N must fit in int32";
  // below 2^30, not 2^31: a CTA's next tile, t + gridDim.x, stays in int
  if (a.tiles < 0 || static_cast<long long>(a.tiles) * (a.n / kBN) >= (1LL << 30))
    return "the row-tile table's T x N/128 output tiles must be below 2^30";
  static_assert(kRows == 256, "the message below names the tile rows");
  if (a.tile_rows != kRows)   // jax_ep/gmm/cuda_fp8.py NT_TILE_ROWS and kRows disagree
    return "the row-tile table must be cut at 256 rows (cuda_fp8.NT_TILE_ROWS); the Python "
           "package and the built extension disagree: rebuild the extension";
  return "";
}

cudaError_t launch_gmm_fp8_nt(const GmmFp8Args& a, cudaStream_t stream) {
  if (!has_tensor_map_encoder()) return cudaErrorSymbolNotFound;
  Maps maps{};   // out: only for TMA stores
  const auto e4m3 = CU_TENSOR_MAP_DATA_TYPE_UINT8, f32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const auto sw128 = CU_TENSOR_MAP_SWIZZLE_128B, plain = CU_TENSOR_MAP_SWIZZLE_NONE;
  // x in 128-row boxes (a tile loads one or two); rows past m read as zeros
  if (!encode_2d(&maps.a, e4m3, a.x, a.m, a.kc, 1, kBM, kBK, sw128) ||
      !encode_2d(&maps.b, e4m3, a.v, uint64_t(a.groups) * a.n, a.kc, 1, kBN, kBK, sw128) ||
      !encode_2d(&maps.a_scales, f32, a.xs_t, a.kc / kBK, a.m, 4, 1, kRows, plain) ||
      !encode_2d(&maps.a_block, e4m3, a.x, a.m, a.kc, 1, 64, kBK, sw128) ||
      !encode_2d(&maps.a_block_scales, f32, a.xs_t, a.kc / kBK, a.m, 4, 1, 64, plain))
    return cudaErrorInvalidValue;
  if (a.out_f32) return launch<FwdRing>(gmm_fp8_nt_kernel<float, false>, maps, a, a.num_sms,
                                        a.device, stream);
  if (!a.tma_store)
    return launch<FwdRing>(gmm_fp8_nt_kernel<__nv_bfloat16, false>, maps, a, a.num_sms, a.device,
                           stream);
  if (!encode_2d(&maps.out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a.out, a.m, a.n, 2, 64, 64, sw128))
    return cudaErrorInvalidValue;
  return launch<FwdTmaSmem>(gmm_fp8_nt_kernel<__nv_bfloat16, true>, maps, a, a.num_sms, a.device,
                            stream);
}

}  // namespace jax_ep
