"""Calling jax_ep's XLA FFI targets from per-rank code inside ``jax.shard_map``.

``call(target, results, *args, ep_axis=..., **attrs)`` wraps ``jax.ffi.ffi_call``:

* varying axes (vma): under ``check_vma=True`` every operand of a primitive
  must vary over the same mesh axes and results need a type. Operands are
  brought to the union of their axes (``pcast(..., to="varying")``) and each
  result gets that union, which is right for a per-rank kernel.
* the EP group: with ``ep_axis`` the call gets the attributes ``ep_groups`` (i32
  array: every group of the mesh along that axis, one row of PEs each, in axis
  order) and ``num_ranks``, which ``GetPeerTable`` in cc/common/ffi_common.h reads.
  They are computed when the call is lowered, from the devices the mesh really
  holds (a permuted device list, any axis order, EP on a sub-axis), never
  assumed from process order.

Works with jax 0.10.x and 0.11.x (both spell the type as
``ShapeDtypeStruct(manual_axis_type=...)``; a later ``vma=`` keyword is also
accepted).
"""
from __future__ import annotations

import inspect
from typing import Optional, Sequence

import jax
import numpy as np
from jax._src import core
from jax._src import dispatch as jax_dispatch
from jax._src import ffi as ffi_lib
from jax._src import mesh as mesh_lib
from jax._src.interpreters import mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import hosts, runtime
from .mesh_axes import to_vma, vma_of

_SDS_PARAMS = frozenset(inspect.signature(jax.ShapeDtypeStruct.__init__).parameters)


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
    mesh = jax.sharding.get_abstract_mesh()
    mat = core.ManualAxisType(varying=frozenset(vma))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()),
                                manual_axis_type=mat)


def pe_of_device(device) -> int:
    """Member id of ``device`` in the ``ep_groups`` attribute: the NVSHMEM PE
    that drives it (its process: one GPU per process), or, with the
    peer memory (``symmetric_memory="peer_memory"``: one process, several GPUs),
    its CUDA ordinal."""
    if runtime.symmetric_memory() == "peer_memory":
        return int(device.local_hardware_id)
    return int(device.process_index)


def ep_groups_of(devices: np.ndarray, axis_names: Sequence[str], axis_name: str,
                 pe_of=pe_of_device) -> np.ndarray:
    """PE lists of every EP group along ``axis_name``: int32 ``[G, R]``.

    ``devices`` is a mesh's device array (``mesh.devices``, one axis per name in
    ``axis_names``); row g lists the PEs of one group in ``axis_name`` order, so
    position p of a row is the rank whose ``jax.lax.axis_index(axis_name)`` is p.
    Raises when a PE appears twice in one group (two mesh positions on one
    process cannot be told apart by the kernels)."""
    names = tuple(axis_names)
    if axis_name not in names:
        raise ValueError(f"jax_ep: axis {axis_name!r} is not an axis of the mesh; bound axes: "
                         f"{names}")
    pes = np.vectorize(pe_of, otypes=[np.int32])(np.asarray(devices, dtype=object))
    ax = names.index(axis_name)
    groups = np.ascontiguousarray(np.moveaxis(pes, ax, -1).reshape(-1, pes.shape[ax]),
                                  dtype=np.int32)
    for row in groups:
        if len(set(row.tolist())) != len(row):
            raise ValueError(
                f"jax_ep native backend: the EP group along {axis_name!r} puts several mesh "
                f"positions on one process (PEs {row.tolist()}); the NVSHMEM transport needs "
                "one GPU per process (use the reference backend, one process per GPU, or "
                "jax_ep.initialize(symmetric_memory='peer_memory'))")
    return groups


def _lowering_mesh(ctx, axis_name: str):
    """The concrete mesh the enclosing ``shard_map`` body is lowered for.

    At lowering time JAX knows the real device of every mesh position (the
    shard_map's mesh, or the concrete mesh behind an abstract one); that is
    the order ``axis_index`` follows, so peers derived from it are right for
    any device permutation."""
    axis_ctx = ctx.module_context.axis_context
    mesh = getattr(axis_ctx, "mesh", None)
    if not isinstance(mesh, Mesh):  # e.g. an inner shard_map over the abstract mesh
        concrete = mesh_lib.get_concrete_mesh()
        mesh = concrete if isinstance(concrete, Mesh) and not concrete.empty else None
    if mesh is None:
        raise ValueError(
            f"jax_ep native backend: the devices of the mesh over {axis_name!r} are unknown "
            "while lowering (no concrete mesh); call jax_ep inside jax.shard_map with a concrete "
            "jax.sharding.Mesh, or under jax.set_mesh(mesh)")
    return mesh


def narrow_groups(groups: np.ndarray, index_groups) -> np.ndarray:
    """``ep_groups`` rows ``[G, R]`` split by ``axis_index_groups`` (positions
    along the axis; None: unchanged): ``[G * len(index_groups), r]``, each new
    row the PEs at one index group's positions of an old row, in its order."""
    if not index_groups:
        return groups
    return np.ascontiguousarray(
        np.stack([row[list(g)] for row in groups for g in index_groups]), dtype=np.int32)


# -- the primitive ------------------------------------------------------------
# jax.ffi.ffi_call fixes its attributes when it is bound, while the PE of each
# mesh position is only known when the shard_map body is lowered (inside it
# tracing sees an abstract mesh). This primitive has ffi_call's typing and
# effects and adds the `ep_groups`/`num_ranks` attributes in its lowering.
def _freeze(attrs: dict) -> tuple:
    out = []
    for k, v in sorted(attrs.items()):
        if isinstance(v, np.ndarray):
            v = ("__ndarray__", v.dtype.str, v.shape, tuple(v.reshape(-1).tolist()))
        out.append((k, v))
    return tuple(out)


def _thaw(attrs: tuple) -> dict:
    out = {}
    for k, v in attrs:
        if isinstance(v, tuple) and v and v[0] == "__ndarray__":
            v = np.asarray(v[3], dtype=np.dtype(v[1])).reshape(v[2])
        out[k] = v
    return out


def _make_primitive():
    prim = core.Primitive("jax_ep_ffi_call")
    prim.multiple_results = True
    jax_dispatch.simple_impl(prim)

    def abstract_eval(*avals, result_avals, has_side_effect, **_):
        return ffi_lib.ffi_call_abstract_eval(*avals, result_avals=result_avals,
                                              has_side_effect=has_side_effect)

    prim.def_effectful_abstract_eval(abstract_eval)

    def lowering(ctx, *operands, target_name, result_avals, has_side_effect, ep_axis,
                 ep_index_groups, aliases, attributes):
        del result_avals
        attrs = _thaw(attributes)
        if ep_axis is not None:
            mesh = _lowering_mesh(ctx, ep_axis)
            groups = narrow_groups(
                ep_groups_of(mesh.devices, mesh.axis_names, ep_axis, pe_of=pe_of_device),
                ep_index_groups)
            hosts.check_ep_groups(target_name, groups, runtime.pe_hosts(), attrs.get("nodes"),
                                  ep_axis)
            attrs["ep_groups"] = groups.reshape(-1)
            attrs["num_ranks"] = np.int32(groups.shape[1])
        rule = jax.ffi.ffi_lowering(target_name, has_side_effect=has_side_effect,
                                    **({"operand_output_aliases": dict(aliases)} if aliases
                                       else {}))
        return rule(ctx, *operands, **attrs)

    mlir.register_lowering(prim, lowering)
    # The lowering reads the devices: make them part of JAX's lowering-cache key, or
    # a jit re-used under jax.set_mesh(B) after set_mesh(A) (same shape, permuted
    # devices) would keep A's peers.
    jax_dispatch.prim_requires_devices_during_lowering.add(prim)
    return prim


_PRIM = None


def call(target: str, results: Sequence, *args, ep_axis: Optional[str] = None,
         ep_index_groups: Optional[tuple] = None, operand_output_aliases: Optional[dict] = None,
         has_side_effect: bool = False, **attrs):
    """Call FFI ``target`` per rank. ``results``: ``(shape, dtype)`` pairs.

    Returns a tuple of arrays, one per result, each varying over the union of
    the operands' axes. ``attrs`` are static (Python/NumPy scalars, NumPy
    arrays). With ``ep_axis`` the ``ep_groups``/``num_ranks`` attributes of
    that axis are added when the call is lowered, from the real devices of the
    mesh (see :func:`ep_groups_of`), split into ``ep_index_groups`` (a tuple
    of tuples of axis positions, :func:`narrow_groups`) when given.
    ``operand_output_aliases``: {operand index: result index} pairs whose
    buffers XLA makes one (it copies the operand first when it is still used)."""
    global _PRIM
    if _PRIM is None:
        _PRIM = _make_primitive()
    vma = frozenset().union(*(vma_of(a) for a in args)) if args else frozenset()
    args = tuple(to_vma(a, vma) for a in args)
    like = args[0] if args else None
    out_types = [result_type(s, d, like=like, vma=vma) for s, d in results]
    result_avals = tuple(core.shaped_abstractify(t) for t in out_types)
    if ep_axis is not None:
        names = tuple(mesh_lib.get_abstract_mesh().axis_names)
        if ep_axis not in names:  # fail at trace time, not at lowering
            raise ValueError(f"jax_ep: axis {ep_axis!r} is not an axis of the current mesh; "
                             f"bound axes: {names}")
    return tuple(_PRIM.bind(*args, target_name=target, result_avals=result_avals,
                            has_side_effect=has_side_effect, ep_axis=ep_axis,
                            ep_index_groups=ep_index_groups,
                            aliases=tuple(sorted((operand_output_aliases or {}).items())),
                            attributes=_freeze(attrs)))
