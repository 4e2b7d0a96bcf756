"""The one-time compile check: ``"auto"`` runs a Pallas kernel only where a
small instance of it compiles on this device (once per configuration)."""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from .registry import VARIANTS


@functools.lru_cache(maxsize=None)
def compiles(variant: str, op: str, tiles, dtype_name: str, cluster: int = 1) -> bool:
    """Whether ``VARIANTS[variant]`` compiles ``op`` with ``tiles`` on ``cluster``
    CTAs per cluster; False (with a warning naming what runs instead) on failure."""
    v = VARIANTS[variant]
    dt = jnp.dtype(dtype_name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f, shapes = v.probe(op, tiles, dt, cluster)
            args = [s if isinstance(s, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(s, dt)
                    for s in shapes[:-1]]
            args.append(jax.ShapeDtypeStruct(shapes[-1], jnp.int32))
            jax.jit(f).lower(*args).compile()
        return True
    except Exception as e:  # noqa: BLE001 -- any failure means "use what runs instead"
        instead = "a 1-CTA cluster" if cluster > 1 else v.fallback
        warnings.warn(f"jax_ep.grouped_matmul: the {variant} {op} kernel with tiles {tiles} "
                      f"(cluster {cluster}) does not compile here ({type(e).__name__}: "
                      f"{str(e)[:200]}); using {instead} instead")
        return False
