#!/usr/bin/env bash
# The grouped matmul's Pallas Mosaic-GPU kernels in interpret mode, on a machine
# without a GPU (CI runs this after the README's test command). Interpret mode
# needs jax >= 0.11, so Python >= 3.12, which CI's default python3 (3.11, jax
# 0.10.2) lacks: this runs tests/test_grouped_matmul.py and the fp8 kernel's
# test_grouped_matmul_fp8.py (and the lowering
# tests' remat cases, which jax 0.10 refuses) under the first Python
# >= 3.12 it finds, in a throwaway venv with the jax the GPU machine runs.
# No such Python, or a venv that cannot be installed, fails (with the remedy):
# the kernels' only CPU check must not pass by not running. A failing test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
JAX_VERSION="${JAX_EP_INTERPRET_JAX:-0.11.2}"
VENV="${JAX_EP_INTERPRET_VENV:-/tmp/jax_ep_interpret_venv}"

candidates=(python3.13 python3.12)
root="$(pyenv root 2>/dev/null || true)"
[ -n "$root" ] && candidates+=("$root"/versions/3.1[2-9]*/bin/python3)
PY=""
for c in "${candidates[@]}"; do
  if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
    PY="$c"
    break
  fi
done
if [ -z "$PY" ]; then
  echo "ci_pallas_interpret: FAILED: no Python >= 3.12 here (tried ${candidates[*]}); install one" \
       "(e.g. pyenv install 3.12) to run the Pallas interpret-mode tests" >&2
  exit 1
fi
if ! { [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"; } ||
   ! "$VENV/bin/python" -m pip install -q "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" pytest; then
  echo "ci_pallas_interpret: FAILED: could not install jax $JAX_VERSION into $VENV under $PY" \
       "(network? a broken venv: delete $VENV); Pallas interpret-mode tests not run" >&2
  exit 1
fi
echo "ci_pallas_interpret: $("$VENV/bin/python" -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__)')"
# the source tree's jax_ep (pure Python here: no extension is built for this Python)
# + the FFI lowering tests, whose remat cases jax 0.10 refuses (they skip there)
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --full tests/test_grouped_matmul.py \
  tests/test_grouped_matmul_fp8.py tests/test_grouped_matmul_masked.py \
  tests/test_native_lowering.py
