"""An identity that turns a second-order derivative into one clear error.

jax_ep's ``custom_vjp`` rules are differentiated as ordinary code at second
order (a gradient of a gradient, ``jax.hessian``, ``jax.jvp`` of a gradient).
Where that cannot give the right answer (fp8 values, whose tangents would be
e4m3; native kernels, which have no derivative rules) the rule passes its
inputs through :func:`first_order_only`, whose own derivative raises. A
first-order gradient never differentiates the rule, so it never gets there.
"""
from __future__ import annotations

import functools

import jax

FP8_PATH = ("reached the fp8 path, which is differentiable to first order only: float8_e4m3fn "
            "cannot carry a tangent (3 mantissa bits, saturating at 448; it would round away or "
            "become NaN). Take higher-order derivatives on the bf16 path (bf16 operands to "
            "jax_ep.grouped_matmul, dispatch without fp8)")
NATIVE_KERNELS = ("reached the native backend, whose kernels have no derivative rules of their "
                  "own. Take higher-order derivatives on backend='reference' (EpConfig), whose "
                  "rules are plain JAX")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def first_order_only(where: str, why: str, *arrays):
    """``arrays`` unchanged; a ``TypeError`` "jax_ep.<where>: a second-order
    derivative ... <why>" where a derivative would carry a tangent into them."""
    return arrays


@first_order_only.defjvp
def _first_order_only_jvp(where, why, primals, tangents):
    raise TypeError(f"jax_ep.{where}: a second-order derivative (a gradient of a gradient, "
                    f"jax.hessian, jax.jvp of a gradient) {why}")
