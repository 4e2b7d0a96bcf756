"""PEP 517 backend: scikit-build-core, deciding first whether to build the CUDA extension.

``pip install .`` on a machine without a GPU installs pure Python in seconds
(no nvcc run, no NVSHMEM download); on a GPU host with nvcc it builds
``jax_ep._C``. ``JAX_EP_NATIVE=1`` forces the build (CI compiles the kernels on
a GPU-less machine this way), ``JAX_EP_NATIVE=0`` skips it. Only a native build
asks for nanobind, jaxlib (FFI headers) and the NVSHMEM wheel at build time;
the decision reaches CMake as ``-DJAX_EP_NATIVE=ON/OFF``.

``JAX_EP_TESTING=1`` makes the test build: the extension with the test and
bench helpers of cc/testing (the GPU tests need them; wheels leave them out).
It reaches CMake as ``-DJAX_EP_TESTING=ON/OFF`` on every build, so a build
directory configured for one never hands its cached choice to the other.
"""
from __future__ import annotations

import glob
import os
import shutil

from scikit_build_core import build as _skb

_NATIVE_REQUIRES = ["nanobind>=2.4,<4", "jaxlib>=0.10.2,<0.13", "nvidia-nvshmem-cu13==3.4.5"]


def _has_nvcc() -> bool:
    cuda = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return bool(shutil.which("nvcc") or os.path.exists(os.path.join(cuda, "bin", "nvcc")))


def _has_gpu() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def native_build() -> bool:
    """Build the CUDA extension? ``JAX_EP_NATIVE`` = 1/0 decides, else a GPU and nvcc."""
    v = os.environ.get("JAX_EP_NATIVE", "").strip().lower()
    if v in ("1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    return _has_gpu() and _has_nvcc()


def testing_build() -> bool:
    """The test build (cc/testing compiled in)? ``JAX_EP_TESTING`` = 1; default no."""
    return os.environ.get("JAX_EP_TESTING", "").strip().lower() in ("1", "on", "true", "yes")


def _settings(config_settings):
    cs = dict(config_settings or {})
    cs.setdefault("cmake.define.JAX_EP_NATIVE", "ON" if native_build() else "OFF")
    cs.setdefault("cmake.define.JAX_EP_TESTING", "ON" if testing_build() else "OFF")
    return cs


def get_requires_for_build_wheel(config_settings=None):
    extra = _NATIVE_REQUIRES if native_build() else []
    return list(_skb.get_requires_for_build_wheel(_settings(config_settings))) + extra


def get_requires_for_build_editable(config_settings=None):
    extra = _NATIVE_REQUIRES if native_build() else []
    return list(_skb.get_requires_for_build_editable(_settings(config_settings))) + extra


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _skb.build_wheel(wheel_directory, _settings(config_settings), metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _skb.build_editable(wheel_directory, _settings(config_settings), metadata_directory)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _skb.prepare_metadata_for_build_wheel(metadata_directory, _settings(config_settings))


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _skb.prepare_metadata_for_build_editable(metadata_directory, _settings(config_settings))


get_requires_for_build_sdist = _skb.get_requires_for_build_sdist
build_sdist = _skb.build_sdist
