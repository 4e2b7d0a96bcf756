"""Peers come from the mesh's real devices (DESIGN §4), checked without GPUs.

``_ffi.ep_groups_of`` turns a mesh's device array into the PE rows the kernels
read; the lowering test checks that the attribute a jitted shard_map actually
carries follows a permuted device list (on CPU, a device's id stands in for its
process, as it would with one GPU per process)."""
import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_ep import _ffi


class _Dev:
    def __init__(self, pe):
        self.process_index = pe


def _devs(pes):
    return np.vectorize(_Dev, otypes=[object])(np.asarray(pes))


def test_groups_natural_and_permuted():
    g = _ffi.ep_groups_of(_devs(np.arange(4)), ("ep",), "ep")
    assert g.tolist() == [[0, 1, 2, 3]]
    g = _ffi.ep_groups_of(_devs([3, 1, 0, 2]), ("ep",), "ep")
    assert g.tolist() == [[3, 1, 0, 2]]  # position p = axis_index p, whatever its process


def test_groups_sub_axis_both_orders():
    pes = np.array([[5, 2, 7, 0], [1, 6, 3, 4]])  # mesh (data=2, ep=4), permuted
    assert _ffi.ep_groups_of(_devs(pes), ("data", "ep"), "ep").tolist() == pes.tolist()
    assert _ffi.ep_groups_of(_devs(pes), ("data", "ep"), "data").tolist() == pes.T.tolist()
    # ('ep', 'data') axis order: the same devices transposed give the same groups
    assert _ffi.ep_groups_of(_devs(pes.T), ("ep", "data"), "ep").tolist() == pes.tolist()


def test_groups_3d_mesh():
    pes = np.random.default_rng(0).permutation(8).reshape(2, 2, 2)
    g = _ffi.ep_groups_of(_devs(pes), ("a", "ep", "b"), "ep")
    want = [[pes[i, 0, j], pes[i, 1, j]] for i in range(2) for j in range(2)]
    assert g.tolist() == want


def test_groups_errors():
    with pytest.raises(ValueError, match="bound axes"):
        _ffi.ep_groups_of(_devs(np.arange(2)), ("ep",), "expert")
    with pytest.raises(ValueError, match="one GPU per process"):
        _ffi.ep_groups_of(_devs([0, 0]), ("ep",), "ep")


def _lowered_groups(mesh, axis, spec):
    def body(v):
        return _ffi.call("jax_ep_ping", [(v.shape, v.dtype)], v, ep_axis=axis,
                         has_side_effect=True)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    text = f.lower(np.zeros((mesh.size, 4), np.int32)).as_text()
    m = re.search(r"ep_groups = dense<\[([0-9, ]+)\]>", text)
    n = re.search(r"num_ranks = (\d+) : i32", text)
    assert m and n, text[:2000]
    vals = [int(v) for v in m.group(1).split(",")]
    return np.array(vals).reshape(-1, int(n.group(1))).tolist()


@pytest.mark.parametrize("perm_seed", [None, 1, 2])
def test_lowering_uses_real_devices(monkeypatch, perm_seed):
    monkeypatch.setattr(_ffi, "pe_of_device", lambda d: d.id)
    devs = np.array(jax.devices()[:8])
    if perm_seed is not None:
        devs = devs[np.random.default_rng(perm_seed).permutation(8)]
    ids = np.vectorize(lambda d: d.id)(devs)
    mesh = Mesh(devs.reshape(2, 4), ("data", "ep"))
    assert _lowered_groups(mesh, "ep", P(("data", "ep"))) == ids.reshape(2, 4).tolist()
    mesh = Mesh(devs.reshape(4, 2), ("ep", "data"))
    assert _lowered_groups(mesh, "ep", P(("ep", "data"))) == ids.reshape(4, 2).T.tolist()
    mesh = Mesh(devs[::-1], ("ep",))
    assert _lowered_groups(mesh, "ep", P("ep")) == [ids[::-1].tolist()]


def test_unknown_axis_at_trace_time():
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))

    def body(v):
        return _ffi.call("jax_ep_ping", [(v.shape, v.dtype)], v, ep_axis="expert")[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    with pytest.raises(ValueError, match="bound axes"):
        f.trace(np.zeros((2, 4), np.int32))


def test_lowering_not_reused_across_device_orders(monkeypatch):
    """One jit under set_mesh(A), then set_mesh(B) with the same shape and permuted
    devices: B's lowering must carry B's peers (the devices are in JAX's cache key)."""
    monkeypatch.setattr(_ffi, "pe_of_device", lambda d: d.id)
    devs = np.array(jax.devices()[:8])
    perm = devs[np.random.default_rng(3).permutation(8)]
    meshes = [Mesh(devs.reshape(2, 4), ("data", "ep")), Mesh(perm.reshape(2, 4), ("data", "ep"))]

    def body(v):
        return _ffi.call("jax_ep_ping", [(v.shape, v.dtype)], v, ep_axis="ep",
                         has_side_effect=True)[0]

    spec = P(("data", "ep"))
    f = jax.jit(jax.shard_map(body, in_specs=spec, out_specs=spec))
    for mesh in meshes:
        with jax.set_mesh(mesh):
            text = f.lower(np.zeros((8, 1), np.int32)).as_text()
        got = [int(v) for v in re.search(r"ep_groups = dense<\[([0-9, ]+)\]>", text).group(1).split(",")]
        assert got == np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1).tolist()


class _GpuDev:
    def __init__(self, ordinal):
        self.local_hardware_id = ordinal
        self.process_index = 0   # one process drives them all


def test_peer_memory_groups_use_cuda_ordinals(monkeypatch):
    """With the peer-memory transport (one process, several GPUs) a group names
    its GPUs by CUDA ordinal, in axis order: permuted device lists, ('ep',
    'data') order and EP on a sub-axis map as with one process per GPU; the
    NVSHMEM mapping (by process) would put every position on PE 0."""
    from jax_ep import runtime

    devs = np.vectorize(_GpuDev, otypes=[object])
    with pytest.raises(ValueError, match="one GPU per process"):
        _ffi.ep_groups_of(devs([1, 0]), ("ep",), "ep")          # NVSHMEM: both on process 0
    monkeypatch.setitem(runtime._state, "initialized", True)
    monkeypatch.setitem(runtime._state, "symmetric_memory", "peer_memory")
    assert runtime.symmetric_memory() == "peer_memory"
    assert _ffi.ep_groups_of(devs([1, 0]), ("ep",), "ep").tolist() == [[1, 0]]
    ords = np.array([[5, 2, 7, 0], [1, 6, 3, 4]])                # (data=2, ep=4), permuted
    assert _ffi.ep_groups_of(devs(ords), ("data", "ep"), "ep").tolist() == ords.tolist()
    assert _ffi.ep_groups_of(devs(ords.T), ("ep", "data"), "ep").tolist() == ords.tolist()
    assert _ffi.ep_groups_of(devs(ords), ("data", "ep"), "data").tolist() == ords.T.tolist()
    with pytest.raises(ValueError, match="several mesh positions"):
        _ffi.ep_groups_of(devs([3, 3]), ("ep",), "ep")


def test_initialize_symmetric_memory_argument():
    from jax_ep import runtime

    with pytest.raises(ValueError, match="symmetric_memory must be one of"):
        runtime.initialize(symmetric_memory="nccl")


def test_initialize_on_a_live_runtime_refuses_another_symmetric_memory(monkeypatch):
    """A live runtime's transport is not silently kept when another is asked for."""
    from jax_ep import runtime

    monkeypatch.setitem(runtime._state, "initialized", True)
    monkeypatch.setitem(runtime._state, "symmetric_memory", "nvshmem")
    with pytest.raises(ValueError, match="already up with .nvshmem."):
        runtime.initialize(symmetric_memory="peer_memory")
    monkeypatch.setitem(runtime._state, "symmetric_memory", "peer_memory")
    with pytest.raises(ValueError, match="finalize"):
        runtime.initialize(symmetric_memory="nvshmem")


def test_check_device_error_keeps_the_peer_memory_word(monkeypatch):
    """check_device_error reads the shared error words of the peer-memory
    transport without clearing them (the FFI handlers keep it set: every GPU's
    next call fails); one GPU per process takes (clears) it."""
    from jax_ep import extension, runtime

    calls = []

    class FakeC:
        def device_error(self):
            calls.append("peek")
            return 1

        def take_device_error(self):
            calls.append("take")
            return 1

        def error_op_name(self, op):
            return ("dispatch", "combine")[op]

    monkeypatch.setattr(extension, "load", lambda: FakeC())
    monkeypatch.setitem(runtime._state, "initialized", True)
    for transport, want in (("peer_memory", "peek"), ("nvshmem", "take")):
        monkeypatch.setitem(runtime._state, "symmetric_memory", transport)
        with pytest.raises(RuntimeError, match="a previous dispatch kernel timed out"):
            runtime.check_device_error()
        assert calls[-1] == want
