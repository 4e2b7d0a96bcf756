"""CPU tests of the grouped matmul's configuration: the tuned table, the
variants' constraints, the device table and the kernel choice, on fake devices
(no GPU needed)."""
import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import pytest

import gmm_recorded_choices as recorded
from jax_ep.gmm import DwTiles, FwdTiles, GroupedMatmulConfig, probe, registry, select, tuning
from jax_ep.gmm.devices import DEVICES, DeviceInfo, device_info
from jax_ep.gmm.heuristic import suggest

BF = jnp.bfloat16
SDS = jax.ShapeDtypeStruct
H200 = DEVICES["NVIDIA H200"]
# a Hopper the table does not know (PCIe H100: fewer SMs, same SM design)
OTHER_HOPPER = DeviceInfo("NVIDIA H100 PCIe", "gpu", "9.0", 114, 227 * 1024)
KERNEL = {registry.GMM: "gmm_pallas", registry.GMM_WS: "gmm_pallas_ws",
          registry.TGMM: "tgmm_pallas", registry.TGMM_WS: "tgmm_pallas_ws",
          registry.TGMM_RING: "tgmm_pallas_ring", registry.XLA: "xla"}


def operands(op, m, k, n, g, dtype=BF):
    """``(x, w)`` of ``op`` (``w`` is ``dy`` for dw), as in api.gmm / api.tgmm."""
    if op == "fwd":
        return SDS((m, k), dtype), SDS((g, k, n), dtype)
    if op == "dx":
        return SDS((m, n), dtype), SDS((g, k, n), dtype)
    return SDS((m, k), dtype), SDS((m, n), dtype)


def choice(cfg, op, m, k, n, g, dev):
    x, w = operands(op, m, k, n, g)
    try:
        p = select.plan(cfg, op, x, w, g, jnp.dtype(BF), dev)
    except ValueError:
        return ("ValueError", None, 0)
    if p.variant is registry.XLA:
        return ("xla", None, 0)
    return (KERNEL[p.variant], p.tiles.astuple(), p.cluster)


# ------------------------------------------------------------ the tuned table

def test_table_entries():
    entries, fallback = tuning.load_tuned()
    assert set(entries) == {"NVIDIA H200", "NVIDIA H100 80GB HBM3"} and fallback == "NVIDIA H200"
    # the H100 reuses the H200's measured entry (same_as), the fp8 kernel
    # family and its tile store (measured on both) included
    h200, h100 = entries["NVIDIA H200"], entries["NVIDIA H100 80GB HBM3"]
    assert h200.fp8_kernel == "cuda" and h200.fp8_tma_store_max_k_steps == 56
    assert dataclasses.replace(h100, kind=h200.kind) == h200
    assert h200.default.fwd == FwdTiles(128, 128, 64, 5, 0)
    assert h200.small.dw == DwTiles(64, 128, 64, 5, 4) and h200.small_group_rows == 96
    assert isinstance(h200.default.dw, DwTiles) and isinstance(h200.small.dx, FwdTiles)


@pytest.mark.parametrize("kind", sorted(DEVICES))
@pytest.mark.parametrize("which", ["default", "small"])
@pytest.mark.parametrize("op", ["fwd", "dx", "dw"])
def test_every_tuned_tile_is_supported(kind, which, op):
    """Every tile of the table passes its 1-warpgroup kernel's constraints
    (shared memory included) on the device, and the 2-consumer kernel runs it
    with at least 2 stages in that shared memory (the table's stages may be
    cut to what fits: 5 -> 4 for the default forward)."""
    dev, entry = DEVICES[kind], tuning.tuning_for(kind)
    t = getattr(entry, which).tiles(op)
    m = 128 * 256
    x, w = operands(op, m, 7168, 4096, 128)
    base = registry.BASE[op]
    assert base.supports(op, t, x, w, jnp.dtype(BF), dev)
    assert base.check(op, t, x, w, jnp.dtype(BF), dev) is None
    assert base.smem_bytes(t, BF) <= dev.smem_per_block
    ws = (registry.DW_PIPELINE_VARIANT[getattr(entry, which).dw_pipeline] if op == "dw"
          else registry.TWO_CONSUMER[op])
    assert ws.supports(op, t, x, w, jnp.dtype(BF), dev)
    fit = ws.fit(op, t, x, w, dev)
    assert fit is not None and 2 <= fit.stages <= t.stages
    assert ws.smem_bytes(fit, BF) <= dev.smem_per_block
    assert dataclasses.replace(fit, stages=t.stages) == t


def test_table_loader_rejects_a_missing_fallback():
    text = json.dumps({"fallback": "nope", "devices": {}})
    with pytest.raises(ValueError, match="fallback"):
        tuning.load_tuned(text)


def test_table_fp8_kernel_family():
    """The table's fp8 kernel family: "cuda" on the H200 and the H100 (faster
    than the Pallas kernel on both); a name outside FP8_KERNELS is rejected."""
    entries, _ = tuning.load_tuned()
    assert {e.fp8_kernel for e in entries.values()} == {"cuda"}
    raw = json.loads(tuning.resources.files("jax_ep.gmm").joinpath("tuned_tiles.json").read_text())
    raw["devices"]["NVIDIA H200"]["fp8_kernel"] = "triton"
    with pytest.raises(ValueError, match="fp8_kernel must be one of"):
        tuning.load_tuned(json.dumps(raw))


# ----------------------------------------------- today's choices, reproduced

@pytest.mark.parametrize("name", sorted(recorded.CHOICES))
@pytest.mark.parametrize("dev", [H200, DEVICES["NVIDIA H100 80GB HBM3"], OTHER_HOPPER, None],
                         ids=["h200", "h100", "unknown_hopper", "this_host"])
def test_choices_match_the_recorded_ones(name, dev):
    """Kernel, tiles and cluster for the bench's, the layer's and the GPU
    tests' shapes are the ones the code chose before the refactor, on every
    Hopper kind (listed or not) and on this host (interpret / lowering)."""
    cfg = GroupedMatmulConfig(**recorded.CONFIGS[name])
    dev = dev or device_info()
    for (m, k, n, g, op), want in recorded.CHOICES[name].items():
        assert choice(cfg, op, m, k, n, g, dev) == want, (name, m, k, n, g, op)


def test_auto_on_hopper_takes_the_same_kernels_where_they_compile(monkeypatch):
    """"auto" on a Hopper picks what "pallas" does where every kernel
    compiles, and steps down where one does not: the ring to the per-group
    pipeline, clusters to 1 CTA, 2 consumers to 1, the 1-warpgroup kernel to XLA."""
    monkeypatch.setattr(probe, "compiles", lambda *a: True)
    auto = GroupedMatmulConfig()
    for (m, k, n, g, op), want in recorded.CHOICES["pallas"].items():
        got = choice(auto, op, m, k, n, g, H200)
        assert got == (want if want[0] != "ValueError" else ("xla", None, 0)), (m, k, n, g, op)

    def fails(*bad):
        monkeypatch.setattr(probe, "compiles",
                            lambda v, op, t, d, c=1: (v, c) not in bad and v not in bad)
    shape = (32768, 7168, 4096, 128)
    fails(("tgmm_ring", 1), ("tgmm_ring", 2))
    assert choice(auto, "dw", *shape, H200) == ("tgmm_pallas_ws", (128, 128, 64, 4, 4), 2)
    fails(("tgmm_ring", 2))
    assert choice(auto, "dw", *shape, H200) == ("tgmm_pallas_ring", (128, 128, 64, 4, 4), 1)
    fails("tgmm_ring", "tgmm_ws")
    assert choice(auto, "dw", *shape, H200) == ("tgmm_pallas", (128, 128, 64, 4, 4), 1)
    fails("gmm_ws")
    assert choice(auto, "fwd", *shape, H200) == ("gmm_pallas", (128, 128, 64, 5, 0), 1)
    fails("gmm")
    assert choice(auto, "fwd", *shape, H200) == ("xla", None, 0)


def test_auto_without_a_hopper_runs_xla():
    cpu = DeviceInfo("cpu", "cpu", "", 132, 227 * 1024)
    ampere = DeviceInfo("NVIDIA A100-SXM4-80GB", "gpu", "8.0", 108, 163 * 1024)
    for dev in (cpu, ampere):
        assert choice(GroupedMatmulConfig(), "fwd", 32768, 7168, 4096, 128, dev)[0] == "xla"
    # interpret mode runs the kernels anywhere
    interp = GroupedMatmulConfig(interpret=True)
    assert choice(interp, "fwd", 32768, 7168, 4096, 128, cpu)[0] == "gmm_pallas_ws"


# ------------------------------------------------------ unknown device kinds

class _FakeDevice:
    def __init__(self, kind, platform="gpu", cc="9.0", cores=None):
        self.device_kind, self.platform, self.compute_capability = kind, platform, cc
        if cores is not None:
            self.core_count = cores


def test_device_info_table_runtime_and_fallback():
    assert device_info(_FakeDevice("NVIDIA H200")) == H200
    # the runtime's SM count wins over the table's
    assert device_info(_FakeDevice("NVIDIA H200", cores=66)).sm_count == 66
    # unknown kinds: the runtime's platform and capability, Hopper SXM sizes
    new = device_info(_FakeDevice("NVIDIA B200", cc="10.0", cores=148))
    assert (new.kind, new.compute_capability, new.sm_count, new.smem_per_block) == \
        ("NVIDIA B200", "10.0", 148, 227 * 1024)
    assert not registry.GMM.runs_on(new) and registry.XLA.runs_on(new)
    odd = device_info(_FakeDevice("NVIDIA GH200 480GB"))
    assert registry.GMM.runs_on(odd) and odd.sm_count == 132
    host = device_info()
    assert host.smem_per_block == 227 * 1024 and not registry.GMM.runs_on(host)


def test_unknown_kind_gets_the_fallback_tiles():
    h200 = tuning.tuning_for("NVIDIA H200")
    for kind in ("NVIDIA B200", "cpu", ""):
        assert tuning.tuning_for(kind) == h200
        assert suggest("dx", 9088, 128, kind).tiles == (h200.small.dx, h200.default.dx)
        assert suggest("dw", 32768, 128, kind).dw_pipeline == "ring"


# ------------------------------------------------------------------- tiles

def test_tiles_are_typed_and_coerced():
    cfg = GroupedMatmulConfig(fwd=[64, 128, 64, 4, 2], dw=FwdTiles(128, 128, 64, 4, 4))
    assert cfg.fwd == FwdTiles(64, 128, 64, 4, 2) and type(cfg.dw) is DwTiles
    assert cfg.fwd.block_n == 128 and cfg.dw.astuple() == (128, 128, 64, 4, 4)
    assert hash(cfg) == hash(GroupedMatmulConfig(fwd=(64, 128, 64, 4, 2), dw=(128, 128, 64, 4, 4)))
    with pytest.raises(ValueError):
        GroupedMatmulConfig(fwd=(64, 128, 64, 4))
    with pytest.raises(ValueError):
        FwdTiles(64, 128, 64, 4, 2.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.fwd.stages = 3
    # a tile of the wrong family is a reason not to run, not a crash
    x, w = operands("fwd", 1024, 512, 256, 8)
    assert "FwdTiles" in registry.GMM.check("fwd", DwTiles(128, 128, 64, 4, 4), x, w,
                                            jnp.dtype(BF), H200)


def test_one_warpgroup_tiles_past_shared_memory_are_refused():
    """A 1-warpgroup config whose stages alone exceed the device's shared
    memory: "pallas" refuses it up front, "auto" runs XLA."""
    big = (256, 256, 64, 4, 2)    # 4 stages of 64 KB
    x, w = operands("fwd", 32768, 7168, 4096, 128)
    assert "shared memory" in registry.GMM.check("fwd", FwdTiles(*big), x, w, jnp.dtype(BF), H200)
    with pytest.raises(ValueError, match="shared memory"):
        select.plan(GroupedMatmulConfig(impl="pallas", fwd=big), "fwd", x, w, 128,
                    jnp.dtype(BF), H200)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no compile attempt, no warning
        assert select.plan(GroupedMatmulConfig(fwd=big), "fwd", x, w, 128, jnp.dtype(BF),
                           H200).variant is registry.XLA
