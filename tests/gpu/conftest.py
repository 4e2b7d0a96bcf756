"""GPU tests: multi-process jobs spawned by the tests themselves (harness.py).

They are marked ``gpu`` and skip with a one-line reason when there are fewer
than ``$JAX_EP_TEST_NPROCS`` (default 2) GPUs or jax_ep._C is not built.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
