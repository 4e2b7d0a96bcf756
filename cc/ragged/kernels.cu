// The ragged all-to-all kernel (jax_ep.ragged_all_to_all; the reference is
// jax_ep/ragged/reference.py, the semantics docs/ragged.md). One launch per
// call, two phases, no host synchronisation:
//
// Send: every block scans this rank's slice sizes (a slice past operand or
// its receiver's output, or with a negative offset or size, counts 0 rows,
// declares -1 and raises kErrRaggedBounds) and its warps store the rows of
// every slice, spread evenly over the grid, into the receiver's area of this
// call's parity at the row where they land (P2P through the peer pointer, or
// staged in this rank's stage area and put). Each slice's word (start row,
// rows) goes to its receiver. The last block to finish (every block fenced,
// and completed its puts, before it arrived: last_block) raises this rank's
// flag on every receiver, tagged with the call's epoch.
//
// Receive: every block waits for every sender's flag (device-side timeout
// raising kErrTimeout, never a hang), reads the slice words, checks each
// against recv_sizes (a mismatch, or a sender's -1, raises kErrRaggedSizes
// and writes nothing for that slice) and copies the received rows from the
// area into the result at the same rows. The last block to finish records
// the call's epoch.
//
// Epochs and parity: call e uses parity e % 2 for its flags, words and area.
// Two suffice: a sender's call e + 2 into this rank's parity-e area comes
// after its call e + 1 finished, which waited for this rank's flag of e + 1,
// raised after this rank's call e copied everything out (calls of one rank
// run one after another on its stream). Every rank must make the same
// sequence of calls (SPMD programs do): the epoch is this rank's count.
//
// Every block of the grid must be resident at once (its receive phase spins
// until the last block of the send phase signals): the grid is at most one
// block per SM.

#include "common/grid_work.cuh"
#include "common/preload.h"
#include "common/row_copy.cuh"
#include "common/sync.cuh"
#include "ragged/kernels.h"
#include "transport/nvshmem_put.cuh"
#include "transport/peer.cuh"

namespace jax_ep {

namespace {

__device__ __forceinline__ RaggedCtrl* ragged_ctrl(const RaggedArgs& a) {
  return reinterpret_cast<RaggedCtrl*>(own_ptr(a.peers, a.lay.ctrl));
}

// Rows slice p declares to its receiver: send_sizes[p], or -1 when it runs
// past operand or the receiver's output (every rank has the same rows).
__device__ __forceinline__ long long declared(const RaggedArgs& a, int p) {
  const long long in = a.input_offsets[p], n = a.send_sizes[p], at = a.output_offsets[p];
  const bool ok = in >= 0 && n >= 0 && at >= 0 && in + n <= a.in_rows && at + n <= a.out_rows;
  return ok ? n : -1;
}

// Byte offset of sender s's word for slice k of call parity par, in any rank's region.
__device__ __forceinline__ size_t word_off(const RaggedLayout& y, int par, int s, int k) {
  return y.words + ((static_cast<size_t>(par) * kMaxRanks + s) * kRaggedMaxSlices + k) * 8;
}

__device__ __forceinline__ size_t flag_off(const RaggedLayout& y, int par, int s) {
  return y.flags + (static_cast<size_t>(par) * kMaxRanks + s) * 8;
}

// Rows [0, sm[K]) of the slices whose sizes the block scanned into sm, spread
// over the grid's warps (column slices when there are fewer rows than warps):
// calls row(i, p, j, b0, b1) for row j of slice p, bytes [b0, b1).
template <typename RowFn>
__device__ __forceinline__ void for_each_row(const long long* sm, int K, long long row_bytes,
                                             RowFn row) {
  const long long total = sm[K];
  const int v = row_vec_bytes(row_bytes);
  const long long nvec = row_bytes / v;
  const int slices = warp_slices(total, (nvec + 127) / 128);
  for (long long it = global_warp(); it < total * slices; it += num_warps()) {
    const long long i = it / slices;
    const int sl = static_cast<int>(it % slices);
    const int p = locate(sm, K, i);
    long long b0, b1;
    vec_slice(nvec, v, sl, slices, &b0, &b1);
    row(p, i - sm[p], b0, b1, v);
  }
}

// Send phase: rows and words of every slice, then (last block) the flags.
template <bool PUT>
__device__ void send_phase(const RaggedArgs& a, long long* sm, unsigned int epoch) {
  const int lane = threadIdx.x % 32, me = a.peers.rank, R = a.peers.num_ranks;
  const int S = a.slices, K = R * S, par = epoch & 1u;
  for (int p = threadIdx.x; p < K; p += blockDim.x) {
    const long long n = declared(a, p);
    if (n < 0 && blockIdx.x == 0) raise_error(a.host_err, kErrRaggedBounds);
    sm[p] = n < 0 ? 0 : n;
  }
  block_exclusive_scan(sm, K);
  const long long rb = a.row_bytes;
  for_each_row(sm, K, rb, [&](int p, long long j, long long b0, long long b1, int v) {
    const int d = p / S;
    const long long src_row = a.input_offsets[p] + j;
    const size_t off = a.lay.area[par] + static_cast<size_t>(a.output_offsets[p] + j) * rb;
    const char* src = static_cast<const char*>(a.operand) + src_row * rb;
    const bool put = PUT && by_put(a.put_mask, d);   // warp-uniform
    char* dst = put ? own_ptr(a.peers, a.lay.stage + static_cast<size_t>(src_row) * rb)
                    : peer_ptr(a.peers, d, off);
    warp_copy_row_any(src, reinterpret_cast<void* const*>(&dst), 1, b0, b1 - b0, v, lane);
    if constexpr (PUT) {
      if (put) {
        __syncwarp();
        put_row_warp(a.peers, d, off + b0, dst + b0, b1 - b0);
      }
    }
  });
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < K; p += gridDim.x * blockDim.x) {
    const int d = p / S;
    const size_t w = word_off(a.lay, par, me, p % S);
    const int start = a.output_offsets[p], n = static_cast<int>(declared(a, p));
    if (PUT && by_put(a.put_mask, d)) {   // by value: nothing to stage
      put_int32(a.peers, d, w, start);
      put_int32(a.peers, d, w + 4, n);
    } else {
      *reinterpret_cast<int2*>(peer_ptr(a.peers, d, w)) = make_int2(start, n);
    }
  }
  if constexpr (PUT) {   // the block's puts complete before it arrives
    __syncthreads();
    if (threadIdx.x == 0) quiet_puts();
  }
  if (last_block(&ragged_ctrl(a)->send_done))
    for (int d = threadIdx.x; d < R; d += blockDim.x)
      send_signal<PUT, SignalOrder::kOrderedByCaller>(a.peers, a.put_mask, d,
                                                      flag_off(a.lay, par, me),
                                                      chunk_tag(epoch, 0));
}

// Receive phase: wait for every sender, check its words, copy its rows out.
__device__ void receive_phase(const RaggedArgs& a, long long* sm, unsigned int epoch) {
  const int lane = threadIdx.x % 32, R = a.peers.num_ranks;
  const int S = a.slices, K = R * S, par = epoch & 1u;
  const auto* flags =
      reinterpret_cast<const unsigned long long*>(own_ptr(a.peers, flag_off(a.lay, par, 0)));
  for (int s = threadIdx.x; s < R; s += blockDim.x)
    wait_tag(flags + s, chunk_tag(epoch, -1), a.host_err, a.timeout_ns);
  __syncthreads();
  puts_visible_block(a.put_mask, flags);
  const auto* words = reinterpret_cast<const int2*>(own_ptr(a.peers, word_off(a.lay, par, 0, 0)));
  for (int q = threadIdx.x; q < K; q += blockDim.x) {
    const int2 w = words[(q / S) * kRaggedMaxSlices + q % S];   // (start, rows)
    const bool ok = w.y >= 0 && w.y == a.recv_sizes[q] && w.x >= 0 &&
                    static_cast<long long>(w.x) + w.y <= a.out_rows;
    if (!ok && blockIdx.x == 0) raise_error(a.host_err, kErrRaggedSizes);
    sm[q] = ok ? w.y : 0;
  }
  block_exclusive_scan(sm, K);
  const long long rb = a.row_bytes;
  const char* area = own_ptr(a.peers, a.lay.area[par]);
  for_each_row(sm, K, rb, [&](int q, long long j, long long b0, long long b1, int v) {
    const long long row = words[(q / S) * kRaggedMaxSlices + q % S].x + j;
    void* dst = static_cast<char*>(a.out) + row * rb;
    warp_copy_row_any(area + row * rb, &dst, 1, b0, b1 - b0, v, lane);
  });
  RaggedCtrl* ctrl = ragged_ctrl(a);
  if (last_block(&ctrl->recv_done) && threadIdx.x == 0)
    *reinterpret_cast<volatile unsigned int*>(&ctrl->epoch) = epoch;
}

template <bool PUT>
__global__ void __launch_bounds__(32 * kRaggedWarps) ragged_kernel(RaggedArgs a) {
  extern __shared__ long long sm_rows[];   // [K + 1]: slice rows, then their prefix
  const unsigned int epoch = ld_volatile(&ragged_ctrl(a)->epoch) + 1u;
  send_phase<PUT>(a, sm_rows, epoch);
  receive_phase(a, sm_rows, epoch);
}

size_t smem_bytes(int K) { return (static_cast<size_t>(K) + 1) * sizeof(long long); }

}  // namespace

cudaError_t preload_ragged_kernels() {   // common/preload.h says why
  static KernelPreload preload;
  return preload.once({reinterpret_cast<const void*>(ragged_kernel<false>),
                       reinterpret_cast<const void*>(ragged_kernel<true>)});
}

cudaError_t launch_ragged_all_to_all(const RaggedArgs& a, int num_blocks, cudaStream_t s) {
  const int R = a.peers.num_ranks;
  if (num_blocks < 1 || R < 1 || R > kMaxRanks || (a.put_mask >> R) != 0 || a.slices < 1 ||
      a.slices > kRaggedMaxSlices || a.row_bytes < 0 || a.in_rows < 0 || a.out_rows < 0 ||
      a.in_rows * a.row_bytes > a.lay.area_bytes || a.out_rows * a.row_bytes > a.lay.area_bytes)
    return cudaErrorInvalidValue;
  const size_t smem = smem_bytes(R * a.slices);
  if (a.put_mask) ragged_kernel<true><<<num_blocks, 32 * kRaggedWarps, smem, s>>>(a);
  else ragged_kernel<false><<<num_blocks, 32 * kRaggedWarps, smem, s>>>(a);
  return cudaGetLastError();
}

}  // namespace jax_ep
