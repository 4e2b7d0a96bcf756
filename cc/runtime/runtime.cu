// Native runtime: NVSHMEM bootstrap or the peer-memory buffers, and peer tables.
// Compiled by nvcc into the same module as the kernels: NVSHMEM keeps its
// device-side state per module and fills it in nvshmem_init.
#include "runtime/lifecycle.h"
#include "runtime/runtime.h"

#include "common/device_error.h"
#include "internode/region_layout.h"
#include "intranode/ring_layout.h"
#include "low_latency/kernels.h"
#include "low_latency/region_layout.h"
#include "ragged/kernels.h"
#include "ragged/region_layout.h"
#include "runtime/regions.h"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace jax_ep {
namespace {

Runtime g_runtime;
Runtime* g_live = nullptr;
std::vector<void*> g_pe_base;  // nvshmem_ptr(sym_base, pe) for every PE, cached

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("jax_ep: ") + what + " failed: " + cudaGetErrorString(e));
}

}  // namespace

Runtime* runtime() { return g_live; }

namespace {

int device_slot(const Runtime& rt, int ordinal) {
  for (int i = 0; i < rt.num_devices; ++i)
    if (rt.ordinals[i] == ordinal) return i;
  return -1;
}

}  // namespace

int Runtime::sms_of(int device_ordinal) const {
  if (transport == Transport::kNvshmem) return num_sms;
  const int i = device_slot(*this, device_ordinal);
  return i >= 0 ? dev_sms[i] : num_sms;
}

bool Runtime::peer_table(const int32_t* group, int group_size, int device_ordinal,
                         PeerTable* out, const char** err, bool allow_unmapped) const {
  if (group_size < 1 || group_size > kMaxRanks) {
    *err = "EP group size outside [1, kMaxRanks]";
    return false;
  }
  const bool nvshmem = transport == Transport::kNvshmem;
  const int me = member_id(device_ordinal);
  PeerTable t;
  t.num_ranks = group_size;
  t.rank = -1;
  for (int i = 0; i < group_size; ++i) {
    const int m = group[i];
    if (nvshmem) {
      if (m < 0 || m >= n_pes) {
        *err = "EP group names a PE outside [0, n_pes)";
        return false;
      }
      t.peers[i] = g_pe_base[m];
      t.pe[i] = m;
    } else {
      const int slot = device_slot(*this, m);
      if (slot < 0) {
        *err = "EP group names a GPU this process's runtime did not set up (peer memory)";
        return false;
      }
      t.peers[i] = dev_base[slot];
    }
    if (m == me) {
      if (t.rank >= 0) {
        *err = "the EP group names this GPU twice";
        return false;
      }
      t.rank = i;
    }
    if (!t.peers[i] && !allow_unmapped) {
      *err = "a member of the EP group is not reachable by CUDA P2P (NVLink) from this GPU";
      return false;
    }
  }
  if (t.rank < 0) {
    *err = nvshmem ? "this PE is not a member of the EP group"
                   : "this GPU is not a member of the EP group";
    return false;
  }
  *out = t;
  return true;
}

int nvshmem_status() { return nvshmemx_init_status(); }

std::string nvshmem_unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  int rc = nvshmemx_get_uniqueid(&id);
  if (rc != 0) throw std::runtime_error("jax_ep: nvshmemx_get_uniqueid failed (" + std::to_string(rc) + ")");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

bool nvshmem_init(const std::string& uid, int rank, int nranks, int device) {
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  int provided = 0;
  if (nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) {
    // Someone else (XLA with --xla_gpu_experimental_enable_nvshmem) owns
    // NVSHMEM: a nested init only takes a reference and sets up this module's
    // device state.
    int rc = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, 0, nullptr, version);
    if (rc != 0) throw std::runtime_error("jax_ep: attaching to the existing NVSHMEM failed (" + std::to_string(rc) + ")");
    return false;
  }
  if (uid.size() != sizeof(nvshmemx_uniqueid_t))
    throw std::runtime_error("jax_ep: NVSHMEM unique id has the wrong size");
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.data(), sizeof(id));
  int rc = nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr);
  if (rc != 0) throw std::runtime_error("jax_ep: nvshmemx_set_attr_uniqueid_args failed (" + std::to_string(rc) + ")");
  // The body of nvshmemx_init_attr without its exit() on failure.
  nvshmemx_init_init_attr_ver_only(attr);
  rc = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID,
                            &attr, version);
  if (rc != 0)
    throw std::runtime_error("jax_ep: nvshmemx_init_attr(UNIQUEID) failed (" + std::to_string(rc) +
                             "); see NVSHMEM_DEBUG=WARN output");
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != nranks)
    throw std::runtime_error("jax_ep: NVSHMEM came up as PE " + std::to_string(nvshmem_my_pe()) + "/" +
                             std::to_string(nvshmem_n_pes()) + ", expected " + std::to_string(rank) +
                             "/" + std::to_string(nranks) +
                             " (an earlier NVSHMEM world is still bootstrapped in this process)");
  return true;
}

static void check_buffer_bytes(size_t bytes) {
  if (bytes < 2 * kCtrlBytes)
    throw std::runtime_error("jax_ep: buffer_bytes (" + std::to_string(bytes) + ") must be at "
                             "least " + std::to_string(2 * kCtrlBytes) + " (the control region "
                             "and some staging)");
}

// The allocation's regions (runtime/regions.h): the normal region of `bytes`,
// then the low-latency region (ll.E > 0), then the internode region
// (inter.nodes > 1), then the ragged region (ragged.area_kib > 0), each at the
// next kRegionAlign boundary. Returns the allocation's size.
static size_t lay_out_regions(size_t bytes, const LlShape& ll, const InterShape& inter,
                              const RaggedShape& ragged, Runtime* rt) {
  BufferRegion* r = rt->regions;
  r[kRegionNormal].bytes = bytes;
  size_t end = bytes;
  // The low-latency region keeps the shape and offset it was given even when
  // empty (runtime_info reports the shape as passed).
  BufferRegion& lr = r[kRegionLowLatency];
  lr.shape = ll.dims();
  lr.off = align_up(end);
  lr.bytes = ll_region_size(ll);
  if (lr.bytes) end = lr.off + lr.bytes;
  // The internode region records its shape and offset only when it has bytes.
  BufferRegion& ir = r[kRegionInternode];
  ir.bytes = internode_region_bytes(inter.nodes, inter.ranks, inter.T, inter.hidden);
  if (ir.bytes) {
    ir.shape = inter.dims();
    ir.off = align_up(end);
    end = ir.off + ir.bytes;
  }
  BufferRegion& gr = r[kRegionRagged];
  gr.bytes = ragged_region_size(ragged);
  if (gr.bytes) {
    gr.shape = ragged.dims();
    gr.off = align_up(end);
    end = gr.off + gr.bytes;
  }
  return end;
}

// Before any kernel of ours can spin (and outside any graph capture): load
// the kernels of the regions laid out (CUDA loads lazily; low_latency/kernels.cu).
static void preload_kernels(const Runtime& rt) {
  if (rt.region(kRegionLowLatency).bytes)
    cuda_check(preload_ll_kernels(), "loading the low-latency kernels");
  if (rt.region(kRegionRagged).bytes)
    cuda_check(preload_ragged_kernels(), "loading the ragged all-to-all kernel");
}

void runtime_attach(int device, size_t bytes, const LlShape& ll, const InterShape& inter,
                    const RaggedShape& ragged) {
  if (g_live) throw std::runtime_error("jax_ep: runtime already attached");
  check_buffer_bytes(bytes);
  Runtime rt;
  const size_t total = lay_out_regions(bytes, ll, inter, ragged, &rt);
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  void* base = nvshmem_malloc(total);  // collective
  if (!base)
    throw std::runtime_error(
        "jax_ep: nvshmem_malloc(" + std::to_string(total >> 20) +
        " MiB) failed: the NVSHMEM symmetric heap does not fit in the GPU memory JAX left free. "
        "Lower XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. 0.6) or set XLA_PYTHON_CLIENT_PREALLOCATE=false "
        "before JAX starts, or pass a smaller buffer_bytes to jax_ep.initialize()");
  cuda_check(cudaMemset(base, 0, total), "cudaMemset(symmetric buffer)");
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  rt.my_pe = nvshmem_my_pe();
  rt.n_pes = nvshmem_n_pes();
  rt.sym_base = base;
  rt.device = device;
  cuda_check(cudaDeviceGetAttribute(&rt.num_sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  g_pe_base.assign(rt.n_pes, nullptr);
  for (int pe = 0; pe < rt.n_pes; ++pe)
    g_pe_base[pe] = pe == rt.my_pe ? base : nvshmem_ptr(base, pe);
  preload_kernels(rt);
  nvshmem_barrier_all();  // every PE has zeroed its buffer before anyone uses it
  g_runtime = rt;
  g_live = &g_runtime;
}

void peer_memory_attach(const std::vector<int>& ordinals, size_t bytes, const LlShape& ll,
                        const InterShape& inter, const RaggedShape& ragged) {
  if (g_live) throw std::runtime_error("jax_ep: runtime already attached");
  check_buffer_bytes(bytes);
  const int n = static_cast<int>(ordinals.size());
  if (n < 1 || n > kMaxDevices)
    throw std::runtime_error("jax_ep: peer memory needs 1.." + std::to_string(kMaxDevices) +
                             " GPUs, got " + std::to_string(n));
  int prev = 0;
  cuda_check(cudaGetDevice(&prev), "cudaGetDevice");
  Runtime rt;
  rt.transport = Transport::kPeerMemory;
  rt.my_pe = 0;
  rt.n_pes = 1;
  const size_t total = lay_out_regions(bytes, ll, inter, ragged, &rt);
  rt.num_devices = n;
  try {
    for (int i = 0; i < n; ++i) {
      const int d = ordinals[i];
      rt.ordinals[i] = d;
      cuda_check(cudaSetDevice(d), "cudaSetDevice");
      for (int j = 0; j < n; ++j) {  // every pair: the kernels store into each other's buffer
        if (ordinals[j] == d) continue;
        int can = 0;
        cuda_check(cudaDeviceCanAccessPeer(&can, d, ordinals[j]), "cudaDeviceCanAccessPeer");
        if (!can)
          throw std::runtime_error("jax_ep: GPU " + std::to_string(d) + " cannot access GPU " +
                                   std::to_string(ordinals[j]) + " by CUDA P2P (NVLink / PCIe "
                                   "peer access); the peer-memory transport needs every pair");
        cudaError_t e = cudaDeviceEnablePeerAccess(ordinals[j], 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
        else cuda_check(e, "cudaDeviceEnablePeerAccess");
      }
      void* base = nullptr;
      cudaError_t e = cudaMalloc(&base, total);
      if (e != cudaSuccess) {
        cudaGetLastError();
        throw std::runtime_error(
            "jax_ep: cudaMalloc(" + std::to_string(total >> 20) + " MiB) on GPU " +
            std::to_string(d) + " failed: the buffer does not fit in the GPU memory JAX left "
            "free. Lower XLA_PYTHON_CLIENT_MEM_FRACTION or pass a smaller buffer_bytes");
      }
      rt.dev_base[i] = base;
      cuda_check(cudaMemset(base, 0, total), "cudaMemset(peer buffer)");  // epochs start at 0
      cuda_check(cudaDeviceGetAttribute(&rt.dev_sms[i], cudaDevAttrMultiProcessorCount, d),
                 "cudaDeviceGetAttribute");
    }
    for (int i = 0; i < n; ++i) {
      cuda_check(cudaSetDevice(rt.ordinals[i]), "cudaSetDevice");
      cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // zeroed before any use
      preload_kernels(rt);
      // every rank must pick the same grid (ring layout): same SM count
      if (rt.dev_sms[i] != rt.dev_sms[0])
        throw std::runtime_error("jax_ep: the peer-memory transport needs GPUs with one SM "
                                 "count (GPU " + std::to_string(rt.ordinals[i]) + " has " +
                                 std::to_string(rt.dev_sms[i]) + ", GPU " +
                                 std::to_string(rt.ordinals[0]) + " " +
                                 std::to_string(rt.dev_sms[0]) + ")");
    }
  } catch (...) {
    for (int i = 0; i < n; ++i)
      if (rt.dev_base[i]) {
        cudaSetDevice(rt.ordinals[i]);
        cudaFree(rt.dev_base[i]);
      }
    cudaSetDevice(prev);
    throw;
  }
  cuda_check(cudaSetDevice(prev), "cudaSetDevice");
  clear_device_error();  // a timeout of an earlier runtime is not this one's
  rt.device = rt.ordinals[0];
  rt.num_sms = rt.dev_sms[0];
  rt.sym_base = rt.dev_base[0];
  g_runtime = rt;
  g_live = &g_runtime;
}

void runtime_detach() {
  if (!g_live) return;
  if (g_runtime.transport == Transport::kPeerMemory) {
    int prev = 0;
    cudaGetDevice(&prev);
    g_live = nullptr;
    cudaError_t first = cudaSuccess;
    for (int i = 0; i < g_runtime.num_devices; ++i) {  // best effort: free every buffer
      cudaError_t e = cudaSetDevice(g_runtime.ordinals[i]);
      if (e == cudaSuccess) e = cudaDeviceSynchronize();  // XLA's work may still run
      if (e == cudaSuccess) e = cudaFree(g_runtime.dev_base[i]);
      if (first == cudaSuccess) first = e;
    }
    cudaSetDevice(prev);
    g_runtime = Runtime();
    cuda_check(first, "freeing the peer-memory buffers");
    return;
  }
  cuda_check(cudaSetDevice(g_runtime.device), "cudaSetDevice");
  // Work queued by XLA on other streams may still touch the buffer.
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  g_live = nullptr;
  nvshmem_free(g_runtime.sym_base);  // collective
  g_runtime = Runtime();
  g_pe_base.clear();
}

void nvshmem_fini() { nvshmem_finalize(); }

size_t device_free_bytes(int device) {
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  size_t free_b = 0, total_b = 0;
  cuda_check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  return free_b;
}

}  // namespace jax_ep
