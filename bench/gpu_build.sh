#!/bin/bash
# Builds jax_ep._C in place on the GPU machine (no network, no README needed):
# cmake into build/gpu, then copy the module next to jax_ep/.
set -e
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! ls jax_ep/_C*.so >/dev/null 2>&1 || [ "${JAX_EP_REBUILD:-1}" = 1 ]; then
  cmake -S . -B build/gpu -G Ninja -DPython_EXECUTABLE=$(command -v $PY) >build_gpu_cmake.log 2>&1 || { cat build_gpu_cmake.log; exit 1; }
  cmake --build build/gpu -j "$(nproc)" 2>&1 | grep -E "error|warning: .*dispatch|FAILED" || true
  cp build/gpu/_C*.so jax_ep/
fi
$PY -c "import jax_ep.runtime as r; assert r.extension_available(), r.unavailable_reason(); print('jax_ep._C ok')"
