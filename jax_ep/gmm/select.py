"""Which kernel runs an operation, with which tiles: the config, the device's
tuned tiles (``heuristic``), the variants' constraints (``registry``) and, in
``"auto"`` mode on a GPU, the one-time compile check (``probe``)."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import jax.numpy as jnp

from .. import extension
from ..fp8 import FP8_BLOCK
from . import heuristic, pallas_fp8, probe
from .config import GroupedMatmulConfig
from .devices import DeviceInfo, device_info
from .registry import (BASE, DW_PIPELINE_VARIANT, FP8_CUDA, FP8_DW_CUDA, FP8_DW_PALLAS,
                       FP8_DW_XLA, FP8_PALLAS, FP8_XLA, TWO_CONSUMER, XLA, Fp8Variant, Variant)


@dataclasses.dataclass(frozen=True)
class Plan:
    variant: Variant
    tiles: Optional[object] = None   # FwdTiles / DwTiles; None for XLA
    cluster: int = 1                 # CTAs per cluster (the 2-consumer dw kernels)

    def run(self, x, w, offsets, op, out_dtype, interpret):
        return self.variant.launch(x, w, offsets, op, self.tiles, self.cluster, out_dtype, interpret)


def plan(cfg: GroupedMatmulConfig, op: str, x, w, groups: int, out_dtype,
         dev: Optional[DeviceInfo] = None) -> Plan:
    """The kernel, tiles and cluster of ``op`` (``"fwd"``, ``"dx"``, ``"dw"``;
    ``w`` is ``dy`` for dw) over ``groups`` groups. ``impl="pallas"`` raises
    where the Pallas kernels cannot run the operands; ``"auto"`` then runs XLA."""
    if cfg.impl == "xla":
        return Plan(XLA)
    dev = dev or device_info()
    base = BASE[op]
    tiles = op_tiles(cfg, op, x, w, groups, dev)
    err = base.check(op, tiles, x, w, out_dtype, dev)
    if cfg.impl == "pallas":
        if err is not None:
            raise ValueError(f"grouped_matmul impl='pallas': {err}")
    elif err is not None or not (cfg.interpret or base.runs_on(dev)):
        return Plan(XLA)
    elif not cfg.interpret and not probe.compiles(base.name, op, tiles, x.dtype.name):
        return Plan(XLA)
    # "auto" on a device: every kernel it picks has compiled here once
    checked = cfg.impl == "auto" and not cfg.interpret
    if op == "dw":
        return _dw_plan(cfg, x, w, groups, tiles, dev, checked)
    ws = TWO_CONSUMER[op]
    if cfg.fwd_warpgroups == 2:
        t = ws.fit(op, tiles, x, w, dev)
        if t is not None and (not checked or probe.compiles(ws.name, op, t, x.dtype.name)):
            return Plan(ws, t)
    return Plan(base, tiles)


def op_tiles(cfg: GroupedMatmulConfig, op, x, w, groups: int, dev: Optional[DeviceInfo] = None):
    """The tiles ``op`` asks for: the config's, else the heuristic's first
    candidate the op's kernel supports (else its last: the device default)."""
    t = getattr(cfg, op)
    if t is not None:
        return t
    dev = dev or device_info()
    cands = heuristic.suggest(op, _rows(cfg, x, groups), groups, dev.kind).tiles
    for c in cands[:-1]:
        if BASE[op].check(op, c, x, w, x.dtype, dev) is None:
            return c
    return cands[-1]


def dw_pipeline(cfg: GroupedMatmulConfig, x, groups: int, dev: Optional[DeviceInfo] = None) -> str:
    """The 2-consumer dw kernel's pipeline: the config's, else the heuristic's."""
    if cfg.dw_pipeline is not None:
        return cfg.dw_pipeline
    dev = dev or device_info()
    return heuristic.suggest("dw", _rows(cfg, x, groups), groups, dev.kind).dw_pipeline


def _rows(cfg: GroupedMatmulConfig, x, groups: int) -> int:
    """The rows the heuristic sizes tiles for: the config's expected rows per
    group times ``groups``, else ``x``'s rows."""
    return x.shape[0] if cfg.expected_rows is None else cfg.expected_rows * groups


def _dw_plan(cfg, x, dy, groups, tiles, dev, checked) -> Plan:
    pipeline = dw_pipeline(cfg, x, groups, dev)
    ws = DW_PIPELINE_VARIANT[pipeline].fit("dw", tiles, x, dy, dev) if cfg.dw_warpgroups == 2 else None
    if ws is not None and checked:
        # a ring that does not compile falls back to the per-group pipeline
        if pipeline == "ring" and not probe.compiles("tgmm_ring", "dw", ws, x.dtype.name):
            pipeline = "per_group"
        if not probe.compiles(DW_PIPELINE_VARIANT[pipeline].name, "dw", ws, x.dtype.name):
            ws = None
    if ws is None:
        return Plan(BASE["dw"], tiles)
    v = DW_PIPELINE_VARIANT[pipeline]
    return Plan(v, ws, _dw_cluster(cfg, v, ws, dy.shape[1], x.dtype, checked))


def _dw_cluster(cfg, v: Variant, ws, n: int, dtype, checked: bool) -> int:
    """The config's CTAs per cluster where ``N % (cluster block_n) == 0`` (and,
    when checked, the kernel compiles on clusters), else 1."""
    c = cfg.dw_cluster
    if c == 1 or n % (c * ws.block_n):
        return 1
    if checked and not probe.compiles(v.name, "dw", ws, dtype.name, c):
        return 1
    return c


def plan_fp8(cfg: GroupedMatmulConfig, op: str, x, xs, v, vs, out_dtype,
             dev: Optional[DeviceInfo] = None) -> Fp8Variant:
    """The variant of the fp8 path's ``op`` in its kernel's NT form
    (``"fwd"`` / ``"dx"``: ``pallas_fp8``; ``"dw"``: ``pallas_fp8_dw``, with
    ``x, xs, v, vs`` its ``a, as, c, cs``; with ``cfg.fp8_kernel="cuda"`` the
    ``cuda_fp8`` kernels): ``"xla"`` the dequantizing reference; ``"pallas"`` the fp8
    kernel (raises where it cannot run the operands); ``"auto"`` the kernel on
    a device it is written for, where the operands fit it and a small instance
    compiles (checked once), else the reference."""
    if cfg.impl == "xla":
        return FP8_DW_XLA if op == "dw" else FP8_XLA
    dev = dev or device_info()
    cuda = _fp8_family(cfg, dev) == "cuda"
    if op == "dw":
        kernel, reference, probe_op = FP8_DW_CUDA if cuda else FP8_DW_PALLAS, FP8_DW_XLA, "dw"
    else:
        kernel, reference, probe_op = FP8_CUDA if cuda else FP8_PALLAS, FP8_XLA, "fwd+dx"
    err = kernel.check(op, x, xs, v, vs, out_dtype)
    if err is None and cuda and cfg.interpret:
        err = "the CUDA kernels have no interpret mode (fp8_kernel='pallas' has)"
    if cfg.impl == "pallas":
        if err is not None:
            raise ValueError(f"grouped_matmul impl='pallas' (fp8 {op}): {err}; use impl='auto' "
                             "or 'xla' for the dequantizing reference")
        return kernel
    if err is not None or not (cfg.interpret or kernel.runs_on(dev)):
        if cfg.fp8_kernel == "cuda":   # asked for by name: say why it does not run
            warnings.warn(f"jax_ep.grouped_matmul: fp8_kernel='cuda' cannot run the fp8 {op} "
                          f"here ({err or 'it needs a Hopper GPU'}); using the dequantizing "
                          "XLA reference")
        return reference
    if not cfg.interpret and not probe.compiles(kernel.name, probe_op, None, "float8_e4m3fn"):
        return reference
    return kernel


def _fp8_family(cfg: GroupedMatmulConfig, dev: DeviceInfo) -> str:
    """The fp8 kernel family: the config's, else the device's tuned
    choice — "pallas" where the tuned "cuda" cannot run (interpret mode, no
    native extension)."""
    family = cfg.fp8_kernel or heuristic.fp8_kernel(dev.kind)
    if cfg.fp8_kernel is None and family == "cuda" and (cfg.interpret or extension.load() is None):
        return "pallas"
    return family


def fp8_cluster(cfg: GroupedMatmulConfig, variant: Fp8Variant, v,
                dev: Optional[DeviceInfo] = None) -> int:
    """CTAs per cluster of the fp8 kernel for ``v [G, Nout, Kc]``: the
    config's (else the device's tuned choice by ``Kc``, ``heuristic``) where
    ``Nout % (cluster 128) == 0`` (``pallas_fp8.fp8_cluster``) and, in
    ``"auto"`` mode on a device, a small instance compiles on clusters
    (checked once), else 1; 1 for every variant but the Pallas kernel."""
    if variant is not FP8_PALLAS:
        return 1
    want = cfg.fp8_cluster
    if want is None:
        want = heuristic.fp8_cluster(v.shape[2] // FP8_BLOCK, (dev or device_info()).kind)
    c = pallas_fp8.fp8_cluster(v.shape[1], want)
    if c > 1 and cfg.impl == "auto" and not cfg.interpret and not probe.compiles(
            FP8_PALLAS.name, "fwd+dx", None, "float8_e4m3fn", c):
        return 1
    return c


def fp8_tma_store(cfg: GroupedMatmulConfig, variant: Fp8Variant, v, out_dtype,
                  dev: Optional[DeviceInfo] = None) -> bool:
    """Whether the CUDA fp8 kernel stores its bf16 tiles by TMA for ``v [G,
    Nout, Kc]``: the config's choice, else the device's by ``Kc / 128``
    (``heuristic.fp8_tma_store``); False for a float32 result (stored from
    registers) and for the other variants."""
    if variant is not FP8_CUDA or jnp.dtype(out_dtype) != jnp.dtype(jnp.bfloat16):
        return False
    if cfg.fp8_tma_store is not None:
        return cfg.fp8_tma_store
    return heuristic.fp8_tma_store(v.shape[2] // FP8_BLOCK, (dev or device_info()).kind)
