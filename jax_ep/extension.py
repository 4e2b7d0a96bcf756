"""The compiled extension ``jax_ep._C``: imported here and nowhere else.

:func:`load` imports it once (after loading the NVSHMEM host library it links
against) and keeps the reason when it cannot; :func:`register_targets` hands
its FFI targets to XLA, once, at import of this module, so that a jitted
custom call lowers (and fails with the not-initialised message) even before
``jax_ep.initialize()``.
"""
from __future__ import annotations

import ctypes
import glob
import importlib
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import jax
from jaxlib import xla_client

_NAME = __package__ + "._C"
_ext = {"module": None, "error": None, "registered": False}


def _preload_nvshmem() -> None:
    """Load the wheel's libnvshmem_host.so.3 globally so ``_C`` resolves it.

    The extension's RPATH finds it in an installed tree; this also covers
    in-place/editable builds, where ``_C`` does not sit next to ``nvidia/``.
    """
    try:
        import nvidia.nvshmem as m   # optional: the cuda13 extra
    except ImportError:
        return
    for d in m.__path__:
        for lib in sorted(glob.glob(os.path.join(d, "lib", "libnvshmem_host.so*"))):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                pass


def _nvshmem_release() -> str:
    try:
        return version("nvidia-nvshmem-cu13")
    except PackageNotFoundError:
        return "unknown"


def load():
    """The ``jax_ep._C`` module, or None (then :func:`error` says why)."""
    if _ext["module"] is None and _ext["error"] is None:
        _preload_nvshmem()
        try:
            _ext["module"] = importlib.import_module(_NAME)
        except ImportError as e:
            if getattr(e, "name", None) == _NAME:
                _ext["error"] = (
                    "jax_ep was installed without its CUDA extension (jax_ep._C): the reference "
                    "backend only. On a GPU host with nvcc: JAX_EP_NATIVE=1 python3 -m pip "
                    "install '.[cuda13]' (README, Install)")
            else:
                hint = ""
                if "NVSHMEM" in str(e):
                    hint = (f"; jax_ep._C must run with the nvidia-nvshmem-cu13 release it was "
                            f"built against (installed: {_nvshmem_release()})")
                _ext["error"] = f"native extension not available ({e}{hint})"
    return _ext["module"]


def available() -> bool:
    return load() is not None


def error() -> str:
    """Why the extension is missing ('' when it loaded)."""
    if available():
        return ""
    return _ext["error"] or "native extension not built (no CUDA toolkit at install time)"


def require(what: str):
    """The extension, or a RuntimeError saying ``what`` needs it and why it is missing."""
    C = load()
    if C is None:
        raise RuntimeError(f"{what} needs the native extension: {error()}")
    return C


def register_targets() -> None:
    """Register every FFI target of ``_C`` with XLA for the CUDA platform, once."""
    C = load()
    if C is None or _ext["registered"]:
        return
    graph_ok = set(C.command_buffer_targets())
    for name, capsule in C.registrations().items():
        # Production targets may be captured into XLA command buffers (CUDA
        # graphs; cc/ffi_targets.h says why that is safe).
        traits = (xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
                  if name in graph_ok else xla_client.CustomCallTargetTraits.DEFAULT)
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA", traits=traits)
    _ext["registered"] = True


try:
    register_targets()
except Exception as e:  # keep `import jax_ep` working; the reason is reported later
    _ext["error"] = f"registering the FFI targets failed ({e})"
    _ext["module"] = None
