"""No function over 80 lines (issue 37), checked by scripts/long_functions.py.

Long functions hide which step does what; the limit keeps each one to a
single job. Checked: the Python of jax_ep/ (the grouped matmul's kernels
included), bench/ and tests/ (the checker's default set less the cc/ FFI
handlers).
"""
from __future__ import annotations

import glob
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checker():
    spec = importlib.util.spec_from_file_location(
        "long_functions", os.path.join(ROOT, "scripts", "long_functions.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_function_over_80_lines():
    checker = _checker()
    files = sorted(f for pattern in checker.PY_GLOBS
                   for f in glob.glob(os.path.join(ROOT, pattern), recursive=True))
    assert any(f.endswith(os.path.join("jax_ep", "runtime.py")) for f in files)
    assert any(f.endswith(os.path.join("jax_ep", "gmm", "pallas_dw.py")) for f in files)
    found = checker.find_long_functions(files)
    assert not found, "functions over 80 lines (split them):\n" + "\n".join(
        f"  {f.path}:{f.line} {f.name}: {f.length} lines" for f in found)


def test_checker_measures_python_and_cc(tmp_path):
    """The checker counts def..end lines in Python and signature..brace in C++."""
    checker = _checker()
    py = tmp_path / "long.py"
    py.write_text("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 80)
    cc = tmp_path / "ffi_long.cc"
    cc.write_text("static int Short(int a) { return a; }\n"
                  "xla::ffi::Error Long(int a) {\n  if (a) {\n" + "    a++;\n" * 80 + "  }\n}\n")
    found = {f.name: f.length for f in checker.find_long_functions([str(py), str(cc)])}
    assert found == {"long": 81, "Long": 84}
