// jax_ep._C: the nanobind module. Exposes the runtime lifecycle
// (runtime/lifecycle.h) and the FFI handler capsules (ffi_targets.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <functional>
#include <string>
#include <utility>

#include "common/device_error.h"
#include "common/graph_capture.h"
#include "common/testing_hooks.h"
#include "ffi_targets.h"
#include "internode/region_layout.h"
#include "intranode/launch_config.h"
#include "intranode/ring_layout.h"
#include "low_latency/region_layout.h"
#include "ragged/region_layout.h"
#include "runtime/lifecycle.h"
#include "runtime/runtime.h"
#include "xla/ffi/api/api.h"
#if JAX_EP_TESTING
#include "testing/loopback.h"
#include "testing/loopback_internode.h"
#include "testing/loopback_ll.h"
#include "testing/loopback_put.h"
#endif

#define JAX_EP_DECLARE_TARGET(name, sym) XLA_FFI_DECLARE_HANDLER_SYMBOL(sym);
JAX_EP_FFI_TARGETS(JAX_EP_DECLARE_TARGET)
#undef JAX_EP_DECLARE_TARGET

namespace nb = nanobind;

NB_MODULE(_C, m) {
  m.doc() = "jax_ep native runtime (NVSHMEM) and XLA FFI targets";
  m.attr("NOT_INITIALIZED_MESSAGE") = jax_ep::kNotInitialized;
  m.attr("MAX_RANKS") = jax_ep::kMaxRanks;
  m.attr("RAGGED_MAX_SLICES") = jax_ep::kRaggedMaxSlices;
  m.attr("TESTING") = bool(JAX_EP_TESTING);
  // Codes the Python side passes as FFI attributes (one source: these enums).
  // Sizes (one source: intranode/ring_layout.h, low_latency/region_layout.h).
  m.def("symmetric_buffer_bytes", &jax_ep::symmetric_buffer_bytes, nb::arg("num_ranks"),
        nb::arg("tokens"), nb::arg("row_bytes"), nb::arg("scale_row_bytes"),
        "Symmetric buffer (bytes) whose staging rings hold dispatch and combine of "
        "num_ranks x tokens rows of row_bytes (+ scale rows of scale_row_bytes) without "
        "wrapping, capped at DEFAULT_BUFFER_BYTES (beyond that the rings wrap).");
  m.def("ring_depth", &jax_ep::ring_depth, nb::arg("num_ranks"), nb::arg("tokens"),
        nb::arg("num_blocks"), nb::arg("chunk"), nb::arg("row_bytes"), nb::arg("scale_row_bytes"),
        nb::arg("stage_half_bytes"),
        "Ring slots per (peer, block) that a staging half holds (0: not one).");
  m.attr("DEFAULT_BUFFER_BYTES") = jax_ep::kDefaultBufferBytes;
  m.attr("CTRL_BYTES") = jax_ep::kCtrlBytes;  // control region at the buffer's end
  m.def(
      "staging_error",
      [](bool combine, int num_ranks, int tokens, int num_sms, int device_sms, int chunk,
         long long row_bytes, long long scale_row_bytes, size_t sym_bytes) {
        jax_ep::LaunchConfig lc;
        return jax_ep::plan_launch(combine ? jax_ep::kOpCombine : jax_ep::kOpDispatch, num_ranks,
                                   tokens, num_sms, device_sms, chunk, row_bytes, scale_row_bytes,
                                   sym_bytes, &lc);
      },
      nb::arg("combine"), nb::arg("num_ranks"), nb::arg("tokens"), nb::arg("num_sms"),
      nb::arg("device_sms"), nb::arg("chunk"), nb::arg("row_bytes"), nb::arg("scale_row_bytes"),
      nb::arg("sym_bytes"),
      "Why a dispatch / combine of this shape cannot run in a symmetric buffer of sym_bytes "
      "(\"\": it can); the FFI handlers' check, for trace time.");
  m.def("stage_half_bytes", &jax_ep::stage_half_bytes, nb::arg("sym_bytes"),
        "Staging bytes per op and call parity in a symmetric buffer of sym_bytes.");
  m.def("ll_region_bytes", &jax_ep::ll_region_bytes, nb::arg("num_ranks"), nb::arg("num_experts"),
        nb::arg("max_tokens"), nb::arg("topk"), nb::arg("row_bytes"), nb::arg("scale_row_bytes"),
        nb::arg("combine_row_bytes"), nb::arg("stage") = false,
        "Bytes of the low-latency region (both ops, both call parities, control; "
        "stage: with the put transport's staging).");

  m.def("registrations", [] {
    nb::dict d;
#define JAX_EP_ADD_TARGET(name, sym) d[name] = nb::capsule(reinterpret_cast<void*>(&sym));
    JAX_EP_FFI_TARGETS(JAX_EP_ADD_TARGET)
#undef JAX_EP_ADD_TARGET
    return d;
  }, "{target name: PyCapsule of its XLA FFI handler}");
  m.def("device_error", &jax_ep::peek_device_error,
        "The first error the kernels left (0: none; KernelError code in the low 8 bits, ErrorOp "
        "above), left as it is.");
  m.def("take_device_error", &jax_ep::take_device_error,
        "The first error the kernels left, as device_error, then cleared.");
  m.def("error_op_name", &jax_ep::error_op_name, "The op family of an error's ErrorOp index.");
  m.def("graph_capture_count", &jax_ep::graph_capture_count,
        "Low-latency FFI calls this process made while XLA captured a CUDA graph.");
  m.def("command_buffer_targets", [] {
    nb::list l;
#define JAX_EP_ADD_NAME(name, sym) l.append(name);
    JAX_EP_GRAPH_TARGETS(JAX_EP_ADD_NAME)
#undef JAX_EP_ADD_NAME
    return nb::tuple(l);
  }, "Names of the targets registered command-buffer compatible (cc/ffi_targets.h).");

  m.def("nvshmem_status", &jax_ep::nvshmem_status);
  m.def("nvshmem_unique_id", [] {
    std::string id = jax_ep::nvshmem_unique_id();
    return nb::bytes(id.data(), id.size());
  });
  m.def("nvshmem_init",
        [](nb::bytes uid, int rank, int nranks, int device) {
          std::string s(uid.c_str(), uid.size());
          nb::gil_scoped_release release;  // blocks until every PE has joined
          return jax_ep::nvshmem_init(s, rank, nranks, device);
        },
        nb::arg("uid"), nb::arg("rank"), nb::arg("nranks"), nb::arg("device"));
  // ll_shape: (E, Tmax, K, hidden) of the low-latency region, or all zero for none.
  auto ll_of = [](const std::array<int, 4>& v) { return jax_ep::LlShape::of(v); };
  // inter_shape: (nodes, ranks, T, hidden) of the internode region, or all
  // zero for none (the default, as before the region existed).
  auto inter_of = [](const std::array<int, 4>& v) { return jax_ep::InterShape::of(v); };
  // ragged_shape: (KiB of each area, 0, 0, 0) of the ragged region, or all zero for none.
  auto ragged_of = [](const std::array<int, 4>& v) { return jax_ep::RaggedShape::of(v); };
  constexpr std::array<int, 4> kNone = {0, 0, 0, 0};
  m.def("runtime_attach",
        [ll_of, inter_of, ragged_of](int device, size_t bytes, std::array<int, 4> ll_shape,
                                     std::array<int, 4> inter_shape,
                                     std::array<int, 4> ragged_shape) {
          nb::gil_scoped_release release;
          jax_ep::runtime_attach(device, bytes, ll_of(ll_shape), inter_of(inter_shape),
                                 ragged_of(ragged_shape));
        },
        nb::arg("device"), nb::arg("bytes"), nb::arg("ll_shape"), nb::arg("inter_shape") = kNone,
        nb::arg("ragged_shape") = kNone);
  m.def("peer_memory_attach",
        [ll_of, inter_of, ragged_of](std::vector<int> ordinals, size_t bytes,
                                     std::array<int, 4> ll_shape, std::array<int, 4> inter_shape,
                                     std::array<int, 4> ragged_shape) {
          nb::gil_scoped_release release;
          jax_ep::peer_memory_attach(ordinals, bytes, ll_of(ll_shape), inter_of(inter_shape),
                                     ragged_of(ragged_shape));
        },
        nb::arg("ordinals"), nb::arg("bytes"), nb::arg("ll_shape"),
        nb::arg("inter_shape") = kNone, nb::arg("ragged_shape") = kNone,
        "Peer-memory transport: one zeroed buffer per CUDA device, peer access between all.");
  m.def("internode_region_bytes", &jax_ep::internode_region_bytes, nb::arg("nodes"),
        nb::arg("ranks"), nb::arg("tokens"), nb::arg("hidden"),
        "Bytes of the runtime's internode region for (nodes, EP ranks, T, hidden) "
        "(internode/region_layout.h); 0 for one node.");
  m.def("ll_region_size",
        [ll_of](std::array<int, 4> ll_shape) { return jax_ep::ll_region_size(ll_of(ll_shape)); },
        nb::arg("ll_shape"),
        "Bytes of the runtime's low-latency region for (E, Tmax, K, hidden) "
        "(low_latency/region_layout.h).");
  m.def("ragged_region_size",
        [ragged_of](std::array<int, 4> ragged_shape) {
          return jax_ep::ragged_region_size(ragged_of(ragged_shape));
        },
        nb::arg("ragged_shape"),
        "Bytes of the runtime's ragged region for (KiB of each area, 0, 0, 0) "
        "(ragged/region_layout.h).");
  m.def("runtime_detach", [] {
    nb::gil_scoped_release release;
    jax_ep::runtime_detach();
  });
  m.def("nvshmem_finalize", [] {
    nb::gil_scoped_release release;
    jax_ep::nvshmem_fini();
  });
  m.def("device_free_bytes", &jax_ep::device_free_bytes, nb::arg("device"));
#if JAX_EP_TESTING
  // Bench breakdown (bench/ep_bench.py through jax_ep.intranode.native.debug_skip).
  m.def("set_debug_skip", &jax_ep::set_debug_skip, nb::arg("skip"),
        "Intranode dispatch / combine of this process from now on: bit 0 sends no data, "
        "bit 1 skips the receive-side gather / reduce (0: the full op).");
  // Tests only (tests/gpu/test_loopback.py): every rank's kernel on one GPU.
  auto names = [](auto const& arr) {
    nb::list l;
    for (const char* n : arr) l.append(n);
    return nb::tuple(l);
  };
  m.attr("LOOPBACK_DISPATCH_PTRS") = names(jax_ep::kLoopbackDispatchPtrs);
  m.attr("LOOPBACK_DISPATCH_INTS") = names(jax_ep::kLoopbackDispatchInts);
  m.attr("LOOPBACK_COMBINE_PTRS") = names(jax_ep::kLoopbackCombinePtrs);
  m.attr("LOOPBACK_COMBINE_INTS") = names(jax_ep::kLoopbackCombineInts);
  // One binding for every loopback entry point: run(ptrs, ints, sym_bytes,
  // num_ranks, iters, &seconds) -> error string, GIL released while it runs.
  using LoopbackRun = std::function<std::string(const std::vector<uint64_t>&,
                                                const std::vector<int64_t>&, size_t, int, int,
                                                double*)>;
  auto bind_loopback = [&m](const char* name, LoopbackRun run) {
    m.def(name,
          [run](const std::vector<uint64_t>& ptrs, const std::vector<int64_t>& ints,
                size_t sym_bytes, int num_ranks, int iters) {
            double sec = 0;
            std::string err;
            {
              nb::gil_scoped_release release;
              err = run(ptrs, ints, sym_bytes, num_ranks, iters, &sec);
            }
            return nb::make_tuple(err, sec);
          },
          nb::arg("ptrs"), nb::arg("ints"), nb::arg("sym_bytes"), nb::arg("num_ranks"),
          nb::arg("iters") = 1);
  };
  bind_loopback("loopback_dispatch", jax_ep::loopback_dispatch);
  bind_loopback("loopback_combine", jax_ep::loopback_combine);
  // Internode kernels on emulated nodes (tests/gpu/test_loopback_internode.py):
  // the layouts above plus three ints, `nodes`, `put` and `layout_T`.
  bind_loopback("loopback_internode_dispatch", jax_ep::loopback_inter_dispatch);
  bind_loopback("loopback_internode_combine", jax_ep::loopback_inter_combine);
  m.def("internode_buffer_bytes", &jax_ep::internode_buffer_bytes, nb::arg("nodes"),
        nb::arg("ranks_per_node"), nb::arg("tokens"), nb::arg("row_bytes"),
        nb::arg("scale_row_bytes"), nb::arg("combine_row_bytes"));
  // Low-latency kernels (tests/gpu/test_loopback_ll.py): one pointer / int
  // layout for dispatch, combine and the round trip (dispatch then combine).
  m.attr("LOOPBACK_LL_PTRS") = names(jax_ep::kLoopbackLlPtrs);
  m.attr("LOOPBACK_LL_INTS") = names(jax_ep::kLoopbackLlInts);
  for (auto [name, ops] : {std::pair{"loopback_ll_dispatch", int(jax_ep::kLlOpDispatch)},
                           std::pair{"loopback_ll_combine", int(jax_ep::kLlOpCombine)},
                           std::pair{"loopback_ll_round_trip",
                                     int(jax_ep::kLlOpDispatch | jax_ep::kLlOpCombine)}})
    bind_loopback(name, [ops](const std::vector<uint64_t>& p, const std::vector<int64_t>& i,
                              size_t sym, int r, int it, double* sec) {
      return jax_ep::loopback_ll(p, i, sym, r, it, ops, sec);
    });
  // Put mode (cc/testing/loopback_put.h): stand-in buffers in the NVSHMEM heap
  // of this process, the only PE.
  m.def("loopback_sym_alloc", &jax_ep::loopback_sym_alloc, nb::arg("nbytes"),
        "A zeroed buffer from the NVSHMEM symmetric heap (one PE): its device address.");
  m.def("loopback_sym_free", &jax_ep::loopback_sym_free, nb::arg("ptr"));
#endif  // JAX_EP_TESTING
  m.def("runtime_info", []() -> nb::object {
    jax_ep::Runtime* rt = jax_ep::runtime();
    if (!rt) return nb::none();
    nb::dict d;
    d["my_pe"] = rt->my_pe;
    d["n_pes"] = rt->n_pes;
    d["sym_bytes"] = rt->region(jax_ep::kRegionNormal).bytes;
    d["transport"] = rt->transport == jax_ep::Transport::kNvshmem ? "nvshmem" : "peer_memory";
    nb::list ords;
    for (int i = 0; i < rt->num_devices; ++i) ords.append(rt->ordinals[i]);
    d["devices"] = ords;
    d["device"] = rt->device;
    d["num_sms"] = rt->num_sms;
    const jax_ep::BufferRegion& ll = rt->region(jax_ep::kRegionLowLatency);
    d["ll_shape"] = nb::make_tuple(ll.shape[0], ll.shape[1], ll.shape[2], ll.shape[3]);
    d["ll_bytes"] = ll.bytes;
    const jax_ep::BufferRegion& inter = rt->region(jax_ep::kRegionInternode);
    d["inter_shape"] = nb::make_tuple(inter.shape[0], inter.shape[1], inter.shape[2],
                                      inter.shape[3]);
    d["inter_bytes"] = inter.bytes;
    const jax_ep::BufferRegion& ragged = rt->region(jax_ep::kRegionRagged);
    d["ragged_area_bytes"] = static_cast<long long>(ragged.shape[0]) * 1024;
    d["ragged_bytes"] = ragged.bytes;
    return d;
  });
}
