"""Codes shared by the Python side and the CUDA kernels: the one source.

The FFI attributes ``mode`` and ``fp8_scale_mode`` (jax_ep_dispatch),
``ll_transport`` (the low-latency targets), ``net_transport`` (the internode
targets) and the row dtype codes of the kernels are these numbers. At build time CMake runs this file as a script and
compiles the C++ enums from its output (``jax_ep_abi.h``: ``DispatchMode``,
``RowDtype``, ``Fp8ScaleMode``, ``LlTransport``, ``NetTransport``), so the two sides cannot
drift. Sizes of the symmetric buffer live on the C++ side
(``cc/low_latency/region_layout.h``) and reach Python through
``jax_ep._C.symmetric_buffer_bytes``. No imports beyond the standard library:
the build runs it before jax_ep is installed.
"""

# name -> (C++ enumerator, code, what it does)
DISPATCH_MODES = {
    "copy": ("kDispatchCopy", 0, "x rows (any dtype) and optional scale rows, as bits"),
    "cast_bf16": ("kDispatchCastBf16", 1, "x bf16 -> fp8 e4m3 + f32 scales per 128 channels"),
    "cast_f32": ("kDispatchCastF32", 2, "x f32 -> same"),
    # Backward of expert_major combine, fused: x = d_out [T, W] (y's dtype) is
    # sent like a copy; for every received row of token t and each of its slot
    # rows c: out[c] = dy[c] = cast(w[c] * f32(g_t)), dw[c] = sum_h f32(g_t[h])
    # * f32(y[c, h]). Padding rows get dy = 0 and every row with row_src -1
    # gets dw = 0 (tail dy rows only with zero_tail).
    "combine_bwd": ("kDispatchCombineBwd", 3, "backward of expert_major combine (fused)"),
}

# How the fp8 cast picks its per-128-channel scale (jax_ep.fp8_cast): amax / 448
# with 448 / amax as an IEEE division or as XLA:GPU divides (div.full.f32), or
# the smallest power of two with 448 * scale >= amax (UE8M0: an exact cast).
FP8_SCALE_MODES = {
    "ieee": ("kFp8ScaleIeee", 0, "scale = amax * fl(1/448), q = x * (448 / amax), IEEE division"),
    "xla_gpu": ("kFp8ScaleXlaGpu", 3, "the same with 448 / amax as div.full.f32 (XLA:GPU)"),
    "ue8m0": ("kFp8ScaleUe8m0", 4, "scale = 2^k, smallest with 448 * 2^k >= amax; q = x * 2^-k"),
}

# How the low-latency kernels reach each rank of the EP group (attribute
# ll_transport of the four jax_ep_ll_* targets; EpConfig.ll_transport).
LL_TRANSPORTS = {
    "auto": ("kLlTransportAuto", 0, "P2P stores where the peer is mapped, NVSHMEM puts where not"),
    "p2p": ("kLlTransportP2p", 1, "P2P stores to every rank (every peer must be mapped)"),
    "put": ("kLlTransportPut", 2, "NVSHMEM puts to every rank, this one included"),
}

# How the internode kernels' network leg (between nodes) reaches each rank
# (attribute net_transport of jax_ep_internode_{dispatch,combine};
# EpConfig.net_transport). The NVLink leg is always P2P stores.
NET_TRANSPORTS = {
    "auto": ("kNetTransportAuto", 0, "P2P stores where the peer is mapped, NVSHMEM puts where not"),
    "p2p": ("kNetTransportP2p", 1, "P2P stores only (every network peer must be mapped)"),
    "put": ("kNetTransportPut", 2, "NVSHMEM puts for the whole network leg, this rank included"),
}

ROW_DTYPES = {
    "bfloat16": ("kBf16", 0, "bf16 rows"),
    "float32": ("kF32", 1, "f32 rows"),
    "float16": ("kF16", 2, "f16 rows"),
}


def dispatch_mode(name: str) -> int:
    return DISPATCH_MODES[name][1]


def row_dtype(name: str) -> int:
    return ROW_DTYPES[name][1]


def fp8_scale_mode(name: str) -> int:
    return FP8_SCALE_MODES[name][1]


def ll_transport(name: str) -> int:
    return LL_TRANSPORTS[name][1]


def net_transport(name: str) -> int:
    return NET_TRANSPORTS[name][1]


def _enum(name: str, table: dict) -> str:
    lines = [f"enum {name} : int {{"]
    lines += [f"  {cpp} = {code},  // {doc}" for cpp, code, doc in table.values()]
    return "\n".join(lines + ["};"])


def render_header() -> str:
    """The C++ header the build compiles (``jax_ep_abi.h``)."""
    return "\n".join([
        "// Generated from jax_ep/abi.py by CMake: do not edit.",
        "#pragma once", "", "namespace jax_ep {", "",
        _enum("DispatchMode", DISPATCH_MODES), "",
        _enum("RowDtype", ROW_DTYPES), "",
        _enum("Fp8ScaleMode", FP8_SCALE_MODES), "",
        _enum("LlTransport", LL_TRANSPORTS), "",
        _enum("NetTransport", NET_TRANSPORTS), "",
        "}  // namespace jax_ep", ""])


if __name__ == "__main__":
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else None
    text = render_header()
    if out:
        with open(out, "w") as f:
            f.write(text)
    else:
        print(text, end="")
