"""Calling jax_ep's XLA FFI targets from per-rank code inside ``jax.shard_map``.

``call(target, results, *args, ep_axis=..., **attrs)`` wraps ``jax.ffi.ffi_call``:

* varying axes (vma): under ``check_vma=True`` every operand of a primitive
  must vary over the same mesh axes and results need a type. Operands are
  brought to the union of their axes (``pcast(..., to="varying")``) and each
  result gets that union, which is right for a per-rank kernel.
* the EP group: with ``ep_axis`` the call gets the attributes ``ep_groups`` (i32
  array: every group of the mesh along that axis, one row of PEs each, in axis
  order) and ``num_ranks``, which ``GetPeerTable`` in cc/ffi_common.h reads.

Works with jax 0.10.x and 0.11.x (both spell the type as
``ShapeDtypeStruct(manual_axis_type=...)``; a later ``vma=`` keyword is also
accepted).
"""
from __future__ import annotations

import inspect
from typing import Optional, Sequence

import jax
import numpy as np

from . import runtime  # noqa: F401  (importing it registers the FFI targets)

_SDS_PARAMS = frozenset(inspect.signature(jax.ShapeDtypeStruct.__init__).parameters)


def vma_of(x) -> frozenset:
    """Mesh axes over which ``x`` varies (empty outside shard_map / check_vma=False)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
        vma = getattr(mat, "varying", None)
    return frozenset(vma or ())


def to_vma(x, axes: frozenset):
    """``x`` marked as varying over ``axes`` (a superset of its own)."""
    missing = tuple(sorted(axes - vma_of(x)))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying")


def result_type(shape, dtype, like=None, vma: Optional[frozenset] = None):
    """A ``ShapeDtypeStruct`` with the varying axes of ``like`` (or ``vma``)."""
    if vma is None:
        vma = vma_of(like) if like is not None else frozenset()
    if not vma:
        return jax.ShapeDtypeStruct(shape, dtype)
    if "vma" in _SDS_PARAMS:
        return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset(vma))
    # jax 0.10/0.11: the manual-axis type is only valid together with a
    # sharding on the (abstract, manual) mesh of the enclosing shard_map.
    from jax._src import core
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.get_abstract_mesh()
    mat = core.ManualAxisType(varying=frozenset(vma))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()),
                                manual_axis_type=mat)


def ep_groups(axis_name: str, mesh=None) -> np.ndarray:
    """PE lists of every EP group along ``axis_name``: int32 ``[G, R]``.

    PE of a device = its ``process_index`` (one GPU per process). Uses
    ``mesh`` when given, else the concrete mesh in context
    (``jax.sharding.use_mesh``/``jax.set_mesh``); inside ``shard_map`` only the
    abstract mesh is known, and then the devices are taken to be in process
    order along the flattened mesh (what ``jax.make_mesh`` builds with one
    device per process).
    """
    from jax._src import mesh as mesh_lib

    if mesh is None:
        concrete = mesh_lib.get_concrete_mesh()
        if concrete is not None and not getattr(concrete, "empty", True):
            mesh = concrete
    if mesh is not None and hasattr(mesh, "devices"):
        names = tuple(mesh.axis_names)
        pes = np.vectorize(lambda d: d.process_index, otypes=[np.int32])(mesh.devices)
    else:
        abstract = mesh_lib.get_abstract_mesh()
        names = tuple(abstract.axis_names)
        if axis_name not in names:
            raise ValueError(f"jax_ep: axis {axis_name!r} is not an axis of the current mesh {names}")
        shape = tuple(abstract.axis_sizes)
        pes = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    if axis_name not in names:
        raise ValueError(f"jax_ep: axis {axis_name!r} is not an axis of the mesh {names}")
    ax = names.index(axis_name)
    return np.ascontiguousarray(np.moveaxis(pes, ax, -1).reshape(-1, pes.shape[ax]), dtype=np.int32)


def call(target: str, results: Sequence, *args, ep_axis: Optional[str] = None, mesh=None,
         has_side_effect: bool = False, **attrs):
    """Call FFI ``target`` per rank. ``results``: ``(shape, dtype)`` pairs.

    Returns a tuple of arrays, one per result, each varying over the union of
    the operands' axes. ``attrs`` are static (Python/NumPy scalars, NumPy
    arrays). With ``ep_axis`` the ``ep_groups``/``num_ranks`` attributes of
    that axis are added.
    """
    vma = frozenset().union(*(vma_of(a) for a in args)) if args else frozenset()
    args = tuple(to_vma(a, vma) for a in args)
    like = args[0] if args else None
    out_types = tuple(result_type(s, d, like=like, vma=vma) for s, d in results)
    if ep_axis is not None:
        groups = ep_groups(ep_axis, mesh)
        attrs["ep_groups"] = groups.reshape(-1)
        attrs["num_ranks"] = np.int32(groups.shape[1])
    fn = jax.ffi.ffi_call(target, out_types, has_side_effect=has_side_effect)
    return tuple(fn(*args, **attrs))
