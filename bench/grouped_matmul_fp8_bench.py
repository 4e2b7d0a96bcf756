"""Benchmark the fp8 grouped matmul on one GPU beside the bf16 one and dense matmuls.

    python bench/grouped_matmul_fp8_bench.py [--reps 10] [--clusters 1,2]

DeepSeek-V3 per-rank shapes (G = 128 experts, M = 32768 rows, ~256 per
expert): up x [M, 7168] @ w [G, 7168, 4096], down x [M, 2048] @ w [G, 2048, 7168]
(``--proj dx_up,dx_down``: the dx kernel's shapes, ``dy [M, 4096]`` into 7168
outputs and ``dy [M, 7168]`` into 2048); uniform and skewed group sizes,
and (``--kinds layer``) the V3 layer's, padded to 64 rows
(``grouped_matmul_bench.group_sizes``). Rows of one table, one run:

- ``fp8 nt``: ``pallas_fp8.gmm_fp8_nt`` on a weight stored K-major ``[G, N, K]``
  (``fp8 nt c2``: on 2-CTA clusters, ``cluster=2``; one row per ``--clusters`` entry);
- ``fp8 api``: ``jax_ep.grouped_matmul(x, w, gs, x_scales=, w_scales=)`` (the
  default config: the device's tuned clusters) on
  ``w [G, K, N]`` (the forward transposes the fp8 weight first);
- ``fp8 nt [name]``: a kernel variant's ``gmm_fp8_nt`` (``--variants
  name=module``, e.g. a copy of ``pallas_fp8.py`` as ``jax_ep.gmm.pallas_fp8_x``)
  in the same run, its output compared bit for bit with ``fp8 nt``'s; ``fp8
  nt [cuda]``: the native extension's kernel (``cuda_fp8``) where it is built,
  ``fp8 nt [cuda tma]`` the same storing its tiles by TMA (``tma_store=True``);
- ``bf16``: ``jax_ep.grouped_matmul`` on bf16 operands;
- ``dense fp8`` / ``dense bf16``: XLA's ``x @ w[0]`` over the same rows (fp8:
  e4m3 operands, bf16 out; XLA:GPU calls cuBLASLt): the tensor-core roofs. A
  dense matmul reads one weight; the grouped one streams all G of them
  (V3 up: 3.8 GB of fp8 weights for 32768 rows). At uniform sizes ``dense
  fp8`` and ``fp8 api`` are timed alternately, rep by rep (the per-rep
  ratios are printed): a GPU's clock moves with power and heat between
  runs, and dense fp8 moved 0.615-0.805 ms at V3 down between runs on one
  H100 while the grouped call moved far less (0.895-0.970);
- ``roof: read w fp8``: an XLA reduction over the fp8 weights ``[G, N, K]``,
  one read of the bytes the grouped matmul must stream at least once;
  ``roof: bytes`` (derived, not timed): every byte the call moves (the
  weights, x and its scales read once, the bf16 output written once) at that
  read's rate; the output is a large share at V3 down (0.47 GB beside 1.9 GB
  of weights); ``roof``: the larger of it and ``dense fp8``, about the time
  no fp8 grouped matmul of these rows beats.

``--steps``: a second table per projection (uniform sizes), what the fp8
layer pays beside the bf16 one:

- ``bf16 fwd+bwd``: ``grouped_matmul`` and its gradients (dx, dw) in bf16;
- ``fp8 fwd+bwd, w quantized in the call``: the fp8 layer's expert matmul as
  the layer runs it (``x`` cast as dispatch casts it, ``w`` quantized to
  128 x 128 blocks in both layouts by ``quantize_weights_pair``, the forward
  and dx in fp8, dw in bf16), ``x``, ``w`` and ``dy`` chained so every cast
  runs in every call;
- ``fp8 fwd+bwd, w quantized once``: the same on both layouts quantized
  before the timed chain (``quantize_weights(quantized=...)``, as
  ``moe_layer_step --impls jax_ep_fp8_wq``: weights quantized less often
  than used, as in inference or gradient accumulation);
- ``..., dw fp8``: the same two with ``GroupedMatmulConfig(fp8_dw=True)``;
  ``..., cuda...``: the same on the native extension's kernels
  (``fp8_kernel="cuda"``) where it is built;
- ``dw bf16`` / ``dw fp8`` / ``dw fp8 kernel``: dw alone: the bf16 kernel on
  ``x * xs`` and ``dy`` rounded to bf16 (what the default fp8 path runs); the
  fp8 path's dw with ``fp8_dw`` (the recast of both operands per column,
  ``fp8_columns``, then the kernel); the fp8 dw kernel alone on recast operands;
  ``dw recast (auto)`` / ``(xla)``: the recast alone, on the column kernel
  (``cuda_quant``, where the extension is built) / on XLA's passes;
- ``quantize w gkn`` / ``gnk`` / ``both``: ``quantize_weights`` alone, the
  forward's K-major copy, and both layouts in one call (what the layer needs);
  ``quantize w pair, one pass``: ``quantize_weights_pair`` (on a GPU with the
  extension its kernel, ``cc/quant/``: one read of ``w`` for both copies);
- ``roof: cast``: ``w.astype(float8_e4m3fn)``, one read of the bf16 weight and
  one write of an fp8 copy, the fewest bytes a quantization per layout moves.

``--decode``: a third table, the experts' up projection at decode on the
low-latency dispatch's packed layout (``DECODE``: V3-decode at EP 8, one
rank: L = 32 experts, C = R·Tmax = 1024 rows each, ~32 of them tokens):

- ``fp8 masked`` / ``fp8 masked [cuda]`` / ``bf16 masked``: ``grouped_matmul``
  on the masked layout ``[L, C, K]`` with ``group_sizes=count``: each expert's
  own rows; ``bf16 masked, expected_rows``: the same with
  ``GroupedMatmulConfig(expected_rows=32)``, the small-group tiles;
- ``fp8 all rows``: the contiguous layout over all ``L·C`` rows (what a
  caller without the masked layout runs);
- ``bf16 einsum``: a batched ``[L, C, K] @ [L, K, N]`` (the layout as a dense batch);
- ``roof: read w fp8``: an XLA reduction over the fp8 weights, one read of
  the bytes every form must stream at least once.
The GB/s column is the fp8 weight bytes (``L·K·N``) over the time.

Timing as ``grouped_matmul_bench.per_call_ms``: calls chained in one jit,
(t(n2) - t(n1)) / (n2 - n1), median of --reps. TF/s = 2 * rows * K * N / t.
Writes the table to $OUT/grouped_matmul_fp8.md when OUT is set.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_ep  # noqa: E402
from grouped_matmul_bench import G, M, PROJ, group_sizes, paired_ms, per_call_ms  # noqa: E402
from jax_ep import extension  # noqa: E402
from jax_ep.gmm import GroupedMatmulConfig, fp8_columns  # noqa: E402
from jax_ep.gmm import fp8 as gm_fp8  # noqa: E402
from jax_ep.gmm.ops import offsets  # noqa: E402
from jax_ep.gmm.cuda_fp8 import gmm_fp8_nt_cuda, tgmm_fp8_nt_cuda  # noqa: E402
from jax_ep.gmm.pallas_fp8 import gmm_fp8_nt  # noqa: E402
from jax_ep.gmm.pallas_fp8_dw import tgmm_fp8_nt  # noqa: E402
from jax_ep.gmm.tiles import FwdTiles  # noqa: E402

# --proj also takes the dx shapes in the kernel's NT form: dx of up contracts
# N 4096 into K 7168 outputs, dx of down 7168 into 2048 (the fp8 dx kernel
# runs these; "bf16" is the bf16 grouped matmul of the same shape)
NT_PROJ = {**PROJ, "dx_up": PROJ["up"][::-1], "dx_down": PROJ["down"][::-1]}


def operands(k, n, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (M, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (G, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    xq, xs = jax_ep.quantize_activations(x)
    wq, ws = jax_ep.quantize_weights(w)                       # [G, K, N], [G, K/128, N/128]
    vq, vs = jax_ep.quantize_weights(w, layout="gnk")         # the K-major copy
    return x, w, xq, xs, wq, ws, vq, vs


def bytes_moved(rows, k, n):
    """What a grouped call must move at least: the fp8 weights (all G), the
    rows' fp8 x and f32 scales read once, their bf16 output written once."""
    return G * k * n + rows * (k + 4 * (k // 128)) + 2 * rows * n


def nt_name(cluster):
    return "fp8 nt" if cluster == 1 else f"fp8 nt c{cluster}"


def variant_kernels(spec):
    """``name=module,...`` -> {name: that module's gmm_fp8_nt}."""
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, module = item.partition("=")
        out[name] = importlib.import_module(module).gmm_fp8_nt
    return out


def _same_bits(ref, got, rows):
    """Whether the first ``rows`` rows of two bf16 outputs are bit-identical."""
    return bool(jnp.array_equal(ref[:rows].view(jnp.uint16), got[:rows].view(jnp.uint16)))


def rows_for(proj, kind, reps, clusters=(1,), variants=None, cuda=True):
    k, n = NT_PROJ[proj]
    x, w, xq, xs, wq, ws, vq, vs = jax.block_until_ready(operands(k, n))
    gs = jnp.asarray(group_sizes(kind))
    rows = int(np.sum(group_sizes(kind)))
    flops = 2.0 * rows * k * n
    t = {}
    for c in clusters:
        t[nt_name(c)] = per_call_ms(
            lambda a, s, v, vsc, g, c=c: gmm_fp8_nt(a, s, v, vsc, offsets(g, M), cluster=c),
            (xq, xs, vq, vs, gs), 2, 6, reps)
    kernels = dict(variants or {})
    if cuda:   # the native extension's kernel, its bf16 tiles stored from registers / by TMA
        kernels["cuda"] = gmm_fp8_nt_cuda
        kernels["cuda tma"] = functools.partial(gmm_fp8_nt_cuda, tma_store=True)
    ref = gmm_fp8_nt(xq, xs, vq, vs, offsets(gs, M)) if kernels else None
    for name, kernel in kernels.items():
        same = _same_bits(ref, kernel(xq, xs, vq, vs, offsets(gs, M)), rows)
        print(f"fp8 nt [{name}] ({proj}, {kind}): bits equal to fp8 nt: {same}", flush=True)
        t[f"fp8 nt [{name}]" + ("" if same else " (bits differ)")] = per_call_ms(
            lambda a, s, v, vsc, g, f=kernel: f(a, s, v, vsc, offsets(g, M)),
            (xq, xs, vq, vs, gs), 2, 6, reps)
    api = lambda a, s, w_, wsc, g: jax_ep.grouped_matmul(a, w_, g, x_scales=s, w_scales=wsc)
    if kind == "uniform":
        # dense fp8 timed alternately with the API, rep by rep: the ratio
        # between the two then does not follow the GPU's clock between runs
        dense = lambda a, v0: jax.lax.dot_general(a, v0, (((1,), (1,)), ((), ())),
                                                  preferred_element_type=jnp.bfloat16)
        t["fp8 api"], dense_ms, r = paired_ms(api, (xq, xs, wq, ws, gs), dense, (xq, vq[0]),
                                              2, 6, reps)
        print(f"{proj}: dense fp8 / fp8 api per rep, timed alternately: "
              f"{' '.join(f'{v:.3f}' for v in r)}", flush=True)
    else:
        t["fp8 api"] = per_call_ms(api, (xq, xs, wq, ws, gs), 2, 6, reps)
    t["bf16"] = per_call_ms(lambda a, w_, g: jax_ep.grouped_matmul(a, w_, g), (x, w, gs), 2, 6, reps)
    if kind == "uniform":
        t["dense fp8"] = dense_ms
        t["dense bf16"] = per_call_ms(lambda a, w0: a @ w0, (x, w[0]), 2, 6, reps)
        t["roof: read w fp8"] = per_call_ms(
            lambda v: jnp.max(v.astype(jnp.float32), axis=(1, 2)), (vq,), 2, 6, reps)
        t["roof: bytes"] = t["roof: read w fp8"] * bytes_moved(rows, k, n) / (G * k * n)
        t["roof"] = max(t["dense fp8"], t["roof: bytes"])
    return [(proj, kind, name, ms, flops / ms / 1e9) for name, ms in t.items()]


class Printed(dict):
    """Times by row name, each printed as it is measured (a run cut short keeps them)."""

    def __setitem__(self, name, ms):
        print(name, f"{ms:.3f} ms", flush=True)
        super().__setitem__(name, ms)


def step_rows(proj, reps, kernels=("pallas",)):
    """``--steps``: (proj, op, ms, GB/s or None) for one projection, uniform sizes."""
    k, n = PROJ[proj]
    x, w, *_ = jax.block_until_ready(operands(k, n))
    gs = jnp.asarray(group_sizes("uniform"))
    dy = jax.random.normal(jax.random.key(2), (M, n), jnp.float32).astype(jnp.bfloat16)

    def grads(y_of):   # (dx, dw) of sum(y * dy)
        return lambda x_, w_, d: jax.vjp(y_of, x_, w_)[1](d)

    # both layouts of w quantized once, outside the timed chain (XLA does not
    # hoist a quantization out of the chain's loop: such rows timed the same)
    pair = jax.block_until_ready(jax.jit(jax_ep.quantize_weights_pair)(w))

    def fp8_y(cfg, once):   # the default config: fp8 dx, bf16 dw
        def y(x_, w_):
            xq, xs = jax_ep.quantize_activations(x_)
            if once:   # the cached pair, gradient still to w_ (as moe_layer.quantize_experts)
                wq, ws = jax_ep.quantize_weights(w_, quantized=pair[0])
                w_t = pair[1]
            else:      # both layouts in the call, as the fp8 layer quantizes in its step
                (wq, ws), w_t = jax_ep.quantize_weights_pair(w_)
            return jax_ep.grouped_matmul(xq, wq, gs, x_scales=xs, w_scales=ws, w_transposed=w_t,
                                         config=cfg)
        return y

    bf16 = grads(lambda x_, w_: jax_ep.grouped_matmul(x_, w_, gs))
    t, gbs = Printed(), {}
    # the chained operands (first) are recomputed from in every call; dy is
    # chained too: its casts (dx's, and dw's with fp8_dw) run in every call
    t["bf16 fwd+bwd"] = per_call_ms(lambda xwd: bf16(*xwd), ((x, w, dy),), 2, 6, reps)
    configs = [(f"{', ' + k if k != 'pallas' else ''}{dw}",
                GroupedMatmulConfig(fp8_kernel=k, fp8_dw=bool(dw)))
               for k in kernels for dw in ("", ", dw fp8")]
    for tag, cfg in configs:
        in_call, once = grads(fp8_y(cfg, False)), grads(fp8_y(cfg, True))
        t[f"fp8 fwd+bwd{tag}, w quantized in the call"] = per_call_ms(
            lambda xwd, f=in_call: f(*xwd), ((x, w, dy),), 2, 6, reps)
        t[f"fp8 fwd+bwd{tag}, w quantized once"] = per_call_ms(
            lambda xd, w_, f=once: f(xd[0], w_, xd[1]), ((x, dy), w), 2, 6, reps)
    t.update(dw_rows(x, gs, dy, reps, kernels))
    one_layout = w.size * (w.dtype.itemsize + 1)   # bytes: read bf16, write fp8
    quant = {"quantize w gkn": (lambda w_: jax_ep.quantize_weights(w_), 1),
             "quantize w gnk": (lambda w_: jax_ep.quantize_weights(w_, layout="gnk"), 1),
             "quantize w both": (lambda w_: (jax_ep.quantize_weights(w_),
                                             jax_ep.quantize_weights(w_, layout="gnk")), 2),
             "quantize w pair, one pass": (lambda w_: jax_ep.quantize_weights_pair(w_), 2),
             "roof: cast": (lambda w_: w_.astype(jnp.float8_e4m3fn), 1)}
    for name, (fn, layouts) in quant.items():
        t[name] = per_call_ms(fn, (w,), 2, 6, reps)
        # both layouts at best read w once: one read, two writes
        gbs[name] = (one_layout + (layouts - 1) * w.size) / t[name] / 1e6
    return [(proj, name, ms, gbs.get(name)) for name, ms in t.items()]


def dw_rows(x, gs, dy, reps, kernels=("pallas",)):
    """dw alone: bf16 (the default fp8 path's), fp8 with its recast, the fp8 dw
    kernel alone (per kernel family: ``pallas``, ``cuda``)."""
    xq, xs = jax_ep.quantize_activations(x)
    a, a_s, c, c_s, seg = fp8_columns.dw_operands(xq, xs, dy, gs)
    # x and dy chained: each call recasts both (the kernel alone: none)
    t = Printed()
    t["dw bf16"] = per_call_ms(
        lambda xd: gm_fp8.dw_bf16(GroupedMatmulConfig(), xd[0], xs, gs, xd[1]), ((xq, dy),),
        2, 6, reps)
    for k in kernels:
        tag = "" if k == "pallas" else f" [{k}]"
        cfg = GroupedMatmulConfig(fp8_dw=True, fp8_kernel=k)
        kernel = tgmm_fp8_nt if k == "pallas" else tgmm_fp8_nt_cuda
        t["dw fp8" + tag] = per_call_ms(
            lambda xd, c_=cfg: gm_fp8.dw_fp8(c_, xd[0], xs, gs, xd[1]), ((xq, dy),), 2, 6, reps)
        t["dw fp8 kernel" + tag] = per_call_ms(
            lambda ac, f=kernel: f(ac[0], a_s, ac[1], c_s, seg), ((a, c),), 2, 6, reps)
    # the recast alone: the column kernel where the extension is built, XLA's passes
    for impl in ("auto", "xla"):
        t[f"dw recast ({impl})"] = per_call_ms(
            lambda xd, i=impl: fp8_columns.dw_operands(xd[0], xs, xd[1], gs, impl=i)[:4],
            ((xq, dy),), 2, 6, reps)
    return t


def step_table(rows):
    lines = ["| proj | op | ms | vs bf16 fwd+bwd | GB/s (fewest bytes) |", "|---|---|---|---|---|"]
    base = {p: ms for p, name, ms, _ in rows if name == "bf16 fwd+bwd"}
    for p, name, ms, gbs in rows:
        ratio = f"{base[p] / ms:.2f}×" if "fwd+bwd" in name else "—"
        lines.append(f"| {p} | {name} | {ms:.3f} | {ratio} | "
                     + (f"{gbs:.0f} |" if gbs else "— |"))
    return "\n".join(lines)


# tiles to time with --sweep (variants measured slower and deleted: docs/decisions.md)
SWEEP = [(128, 128, 128, 5, 1), (128, 128, 128, 5, 8), (128, 128, 128, 4, 4)]


def sweep_rows(reps, clusters=(1,)):
    """``fp8 nt`` at the up projection, uniform sizes, over SWEEP's tiles (and ``clusters``)."""
    k, n = PROJ["up"]
    _, _, xq, xs, _, _, vq, vs = jax.block_until_ready(operands(k, n))
    gs = jnp.asarray(group_sizes("uniform"))
    flops = 2.0 * M * k * n
    rows = []
    for t in SWEEP:
        tiles = FwdTiles(*t)
        for c in clusters:
            ms = per_call_ms(lambda a, s, v, vsc, g: gmm_fp8_nt(a, s, v, vsc, offsets(g, M),
                                                                tiles=tiles, cluster=c),
                             (xq, xs, vq, vs, gs), 2, 6, reps)
            rows.append(("up", "uniform", f"{nt_name(c)} {t}", ms, flops / ms / 1e9))
            print(*rows[-1], flush=True)
    return rows


# V3-decode at EP 8, one rank: L local experts, C = R * Tmax rows each, up projection
DECODE = dict(L=32, C=1024, K=7168, N=4096, mean_rows=32)


def decode_counts(kind, seed=0):
    """Rows per expert at decode: ``mean_rows`` each, or Zipf-like with a quarter empty."""
    d = DECODE
    if kind == "uniform":
        return np.full(d["L"], d["mean_rows"], np.int32)
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, d["L"] + 1) ** 1.2
    rng.shuffle(p)
    p[rng.permutation(d["L"])[: d["L"] // 4]] = 0
    total = d["L"] * d["mean_rows"]
    return np.minimum(np.floor(p / p.sum() * total), d["C"]).astype(np.int32)


def decode_rows(kind, reps, cuda=True):
    d = DECODE
    L, C, k, n = d["L"], d["C"], d["K"], d["N"]
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (L, C, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (L, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    xq, xs = jax_ep.quantize_activations(x.reshape(L * C, k))
    xq, xs = xq.reshape(L, C, k), xs.reshape(L, C, -1)
    wq, ws = jax_ep.quantize_weights(w)
    cnt = jnp.asarray(decode_counts(kind))
    full = jnp.full((L,), C, jnp.int32)
    fp8 = lambda cfg: (lambda a, s, w_, wsc, g: jax_ep.grouped_matmul(
        a, w_, g, x_scales=s, w_scales=wsc, config=cfg))
    t = {"fp8 masked": per_call_ms(fp8(None), (xq, xs, wq, ws, cnt), 2, 6, reps)}
    if cuda:
        t["fp8 masked [cuda]"] = per_call_ms(fp8(GroupedMatmulConfig(fp8_kernel="cuda")),
                                             (xq, xs, wq, ws, cnt), 2, 6, reps)
    t["bf16 masked"] = per_call_ms(lambda a, w_, g: jax_ep.grouped_matmul(a, w_, g),
                                   (x, w, cnt), 2, 6, reps)
    small = GroupedMatmulConfig(expected_rows=d["mean_rows"])
    t["bf16 masked, expected_rows"] = per_call_ms(
        lambda a, w_, g: jax_ep.grouped_matmul(a, w_, g, config=small), (x, w, cnt), 2, 6, reps)
    t["fp8 all rows"] = per_call_ms(
        lambda a, s, w_, wsc, g: jax_ep.grouped_matmul(
            a.reshape(L * C, k), w_, g, x_scales=s.reshape(L * C, -1), w_scales=wsc),
        (xq, xs, wq, ws, full), 2, 6, reps)
    t["bf16 einsum"] = per_call_ms(lambda a, w_: jnp.einsum("lck,lkn->lcn", a, w_), (x, w),
                                   2, 6, reps)
    t["roof: read w fp8"] = per_call_ms(
        lambda w_: jnp.max(w_.astype(jnp.float32), axis=(1, 2)), (wq,), 2, 6, reps)
    gb = L * k * n / 1e9
    return [(kind, name, ms, gb / ms * 1e3) for name, ms in t.items()]


def decode_table(rows):
    lines = [f"decode, up projection: {DECODE}",
             "| sizes | op | µs | fp8 weight GB/s |", "|---|---|---|---|"]
    lines += [f"| {k} | {n} | {ms * 1e3:.1f} | {gbs:.0f} |" for k, n, ms, gbs in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--proj", default="up,down",
                    help=f"shapes of the main table, of {', '.join(NT_PROJ)} (dx_*: the dx "
                         "kernel's; --steps times up and down only)")
    ap.add_argument("--kinds", default="uniform,skew",
                    help="group-size kinds of the main table: uniform, skew, layer (the V3 "
                         "layer's groups padded to 64 rows, grouped_matmul_bench.group_sizes); "
                         "'': no main table, e.g. with --steps")
    ap.add_argument("--sweep", action="store_true", help="also time SWEEP's tiles")
    ap.add_argument("--clusters", default="1",
                    help="CTAs per cluster of the fp8 nt rows, e.g. 1,2 (2: rows 'fp8 nt c2')")
    ap.add_argument("--steps", action="store_true",
                    help="also time fp8 vs bf16 fwd+bwd per projection and the weight quantization")
    ap.add_argument("--decode", action="store_true",
                    help="also time the decode table (the masked layout; DECODE)")
    ap.add_argument("--kernels", default="pallas",
                    help="fp8 kernel families timed, e.g. pallas,cuda (cuda: where the native "
                         "extension is built)")
    ap.add_argument("--variants", default="",
                    help="name=module,...: kernel variants timed beside 'fp8 nt' (rows 'fp8 nt [name]')")
    args = ap.parse_args()
    variants = variant_kernels(args.variants)
    families = [k for k in args.kernels.split(",")
                if k == "pallas" or (k == "cuda" and extension.load() is not None)]
    cuda = "cuda" in families
    clusters = [int(c) for c in args.clusters.split(",")]
    print(jax.devices()[0].device_kind, jax.__version__)
    rows = []
    for proj in args.proj.split(","):
        for kind in filter(None, args.kinds.split(",")):
            new = rows_for(proj, kind, args.reps, clusters, variants, cuda)
            for r in new:   # as they come: a run cut short keeps its rows
                print(*r, flush=True)
            rows += new
    if args.sweep:
        rows += sweep_rows(args.reps, clusters)
    dense = {(p, n): tf for p, _, n, _, tf in rows if n.startswith("dense")}
    bf16 = {(p, k): tf for p, k, n, _, tf in rows if n == "bf16"}
    roof = {p: tf for p, _, n, _, tf in rows if n == "roof"}
    lines = ["| proj | sizes | op | ms | TF/s | vs bf16 grouped | vs dense fp8 | vs roof |",
             "|---|---|---|---|---|---|---|---|"]
    ratio = lambda tf, d: f"{tf / d:.2f}" if d else "—"
    for p, k, n, ms, tf in rows:
        lines.append(f"| {p} | {k} | {n} | {ms:.3f} | {tf:.0f} | {tf / bf16[(p, k)]:.2f}× | "
                     f"{ratio(tf, dense.get((p, 'dense fp8')))} | {ratio(tf, roof.get(p))} |")
    table = "\n".join(lines)
    if args.steps:
        steps = [r for proj in args.proj.split(",") if proj in PROJ
                 for r in step_rows(proj, args.reps, families)]
        table += "\n\n" + step_table(steps)
    if args.decode:
        table += "\n\n" + decode_table([r for kind in args.kinds.split(",")
                                         for r in decode_rows(kind, args.reps, cuda)])
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "grouped_matmul_fp8.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
