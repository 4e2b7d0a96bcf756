"""Per-kernel device time of a jitted call, from a JAX profiler trace.

``kernel_table(fn, steps)`` runs ``fn()`` (which must block until its result
is ready) under ``jax.profiler.trace``, reads the trace with
``jax.profiler.ProfileData`` and sums the GPU kernel events of the device's
stream lines by kernel name. Times are divided by ``steps`` (the chained steps
that one call of ``fn`` runs), so they read as µs per step. Used by
``moe_layer_step.py --profile`` to say where a layer step's time goes
(the CUPTI trace adds a little per kernel: use it for the split, and the
untraced medians for the totals)."""
from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile


def _stats(ev):
    try:
        return {str(k): v for k, v in ev.stats}
    except Exception:  # noqa: BLE001 -- stats are best effort
        return {}


def _short(name: str, width: int = 70) -> str:
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 1] + "…"


def kernel_table(fn, steps: int, top: int = 40):
    """-> dict(kernels=[{name, op, calls, us}] (per step, largest first, ``top``
    of them), rest_us / rest_n (the others' sum per step and their number),
    kernel_us (sum of all kernels per step), span_us (first kernel start to
    last kernel end, per step), streams (line names seen))."""
    import jax
    from jax.profiler import ProfileData

    d = tempfile.mkdtemp(prefix="jax_ep_trace.")
    try:
        with jax.profiler.trace(d):
            fn()
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return {"error": "no xplane.pb written"}
        data = ProfileData.from_file(paths[0])
        agg, streams = {}, []
        t0, t1 = None, None
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if not line.name.startswith("Stream"):
                    continue
                streams.append(f"{plane.name} {line.name}")
                for ev in line.events:
                    st = _stats(ev)
                    op = str(st.get("hlo_op", ""))
                    a = agg.setdefault((ev.name, op), {"name": _short(ev.name), "calls": 0,
                                                       "ns": 0.0, "op": _short(op, 40)})
                    a["calls"] += 1
                    a["ns"] += ev.duration_ns
                    t0 = ev.start_ns if t0 is None else min(t0, ev.start_ns)
                    end = ev.start_ns + ev.duration_ns
                    t1 = end if t1 is None else max(t1, end)
        if not agg:
            return {"error": "no GPU kernel events in the trace (not a GPU run?)"}
        rows = sorted(agg.values(), key=lambda a: -a["ns"])
        total = sum(a["ns"] for a in rows)
        kern = [{"name": a["name"], "op": a["op"], "calls": a["calls"] / steps,
                 "us": a["ns"] / 1e3 / steps} for a in rows[:top]]
        rest = sum(a["ns"] for a in rows[top:])
        return {"kernels": kern, "rest_us": rest / 1e3 / steps, "rest_n": len(rows[top:]),
                "kernel_us": total / 1e3 / steps,
                "span_us": (t1 - t0) / 1e3 / steps,
                "distinct": len(rows), "streams": streams}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def table_md(title: str, prof: dict, step_us: float | None = None):
    """Markdown lines of one ``kernel_table`` result."""
    if not prof or prof.get("error"):
        return [f"- {title}: profile failed ({(prof or {}).get('error', 'no data')})"]
    L = [f"### {title}", "",
         f"Kernels per step: {prof['kernel_us']:.0f} µs summed over {prof['distinct']} "
         f"distinct kernels; first kernel start to last kernel end "
         f"{prof['span_us']:.0f} µs per step"
         + (f"; untraced median step {step_us:.0f} µs" if step_us else "") + ".", "",
         "| kernel | HLO op | calls/step | µs/step | % of kernel time |", "|---|---|---|---|---|"]
    for k in prof["kernels"]:
        L.append(f"| `{k['name']}` | {k['op']} | {k['calls']:.1f} | {k['us']:.1f} "
                 f"| {100 * k['us'] / max(prof['kernel_us'], 1e-9):.1f} |")
    if prof.get("rest_n"):
        L.append(f"| ({prof['rest_n']} more) | | | {prof['rest_us']:.1f} "
                 f"| {100 * prof['rest_us'] / max(prof['kernel_us'], 1e-9):.1f} |")
    return L + [""]
