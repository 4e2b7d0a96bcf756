"""The README's example runs as written (CPU, 8 fake devices, reference backend)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_readme_example_runs():
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index("## Example")
    section = text[start:text.index("\n## ", start + 1)]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("(512, 128) 0 (16, 128, 256)"), out.stdout
