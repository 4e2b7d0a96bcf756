"""Performance model of hierarchical (network + NVLink) dispatch / combine.

No machine here has a NIC or a second host, so multi-node speed is modelled,
not measured. For N nodes of 8 GPUs (EP = 8N, DeepSeek-V3: E = 256, K = 8,
H = 7168) and one 400 Gb/s NIC per GPU, it counts per GPU:

- NIC bytes: normal mode sends a token once per *remote node* that holds any
  of its experts (to the GPU with the same local index, DeepEP's scheme);
  dispatch rows are fp8 + per-128 f32 scales (7392 B), combine rows bf16
  (14336 B, each node reduces its experts' outputs before the network leg);
  low-latency (decode) mode sends every (token, expert) pair whose expert is
  on another node directly (no forwarding).
- NVLink bytes: the forwarding inside a node: a token that arrived from the
  network (or started on this node) goes to every other local GPU holding one
  of its experts.

Routing is sampled (Monte Carlo, i.i.d. Gaussian expert scores): "free" =
top-8 of 256; "group-limited" = DeepSeek-V3's rule, 8 groups of 32 experts,
group score = sum of its top-2 expert scores, top-4 groups, then top-8 experts
inside them (experts placed contiguously, so at 8 nodes a group is a node).

Time per op = max(NIC bytes / (B_nic * eta), NVLink bytes / B_nvl) + fill,
eta = payload share of the wire (RDMA writes of whole chunks at a 4096 B MTU
with 58 B of headers per packet, plus one 8 B ready flag and one 8 B credit
per chunk), fill = one network round trip + one chunk serialisation (the ring
pipeline's start and drain). B_nvl = the P2P store ceiling measured on 2x H200
(bench/results/2026-11-30-h200x2-ops.md: 307-344 GB/s; 300 used). Printed
"% of line rate" = modelled NIC payload GB/s / 50 GB/s.

    python bench/multinode_model.py [--tokens 4096] [--samples 4096] [--out DIR]
"""
from __future__ import annotations

import argparse
import os

import numpy as np

E, K, H, GPUS = 256, 8, 7168, 8
N_GROUPS, TOPK_GROUPS = 8, 4
ROW_FP8 = H + (H // 128) * 4      # 7392 B: e4m3 + per-128 f32 scales
ROW_BF16 = 2 * H                  # 14336 B
B_NIC = 50e9                      # 400 Gb/s
B_NVL = 300e9                     # measured P2P store ceiling, one direction
MTU, HDR = 4096, 58               # IB payload per packet, headers (LRH+GRH+BTH+RETH+ICRC+VCRC)
RTT = 4e-6                        # one RDMA round trip (write + completion seen by a poll)
CHUNK = 8                         # tokens per ring slot (cc/intranode/launch_config.cu)

# DeepEP's published figures, same shapes (V3: 4096 tokens, top-4 groups, top-8,
# fp8 dispatch, bf16 combine): V1 on H800 + CX7 (docs/legacy.md, "bottleneck
# bandwidth", deduplicated-per-node payload), V2 on SM90 + CX7 (README,
# "logical bandwidth", local traffic included, 8K tokens).
DEEPEP = {
    2: "V1 EP16: 43 / 43 GB/s; V2 EP 8x2: 90 / 81 GB/s (logical)",
    4: "V1 EP32: 58 / 57 GB/s; V2 EP 8x4: 61 / 61 GB/s (logical)",
    8: "V1 EP64: 51 / 50 GB/s",
    16: "-",
}
DEEPEP_LL = {2: "V1 LL EP16: 118 / 195 us", 4: "V1 LL EP32: 155 / 273 us",
             8: "V1 LL EP64: 173 / 314 us", 16: "V1 LL EP128: 192 / 369 us"}


def route(rng, n, limited):
    """[n, K] expert ids."""
    s = rng.standard_normal((n, E))
    if limited:
        g = s.reshape(n, N_GROUPS, E // N_GROUPS)
        gscore = np.sort(g, axis=2)[:, :, -2:].sum(axis=2)
        keep = np.argsort(-gscore, axis=1)[:, :TOPK_GROUPS]
        mask = np.zeros((n, N_GROUPS), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        s = np.where(np.repeat(mask, E // N_GROUPS, axis=1), s, -np.inf)
    return np.argsort(-s, axis=1)[:, :K]


def traffic(rng, nodes, samples, limited):
    """Per source token, averaged: remote nodes touched, remote (token, expert)
    pairs, NVLink rows forwarded (network arrivals and own-node tokens), and
    the NVLink rows of the single-node (intranode) kernels for comparison."""
    R = nodes * GPUS
    per_gpu = E // R
    idx = route(rng, samples, limited)
    gpu = idx // per_gpu                       # [n, K] destination GPU
    node = gpu // GPUS
    src_gpu = rng.integers(0, R, samples)
    src_node = src_gpu // GPUS
    remote_nodes = np.zeros(samples)
    remote_pairs = np.zeros(samples)
    nvl_rows = np.zeros(samples)
    for t in range(samples):
        nd = set(node[t].tolist())
        remote_nodes[t] = len(nd - {src_node[t]})
        remote_pairs[t] = int(np.sum(node[t] != src_node[t]))
        local_idx = src_gpu[t] % GPUS
        for m in nd:
            gpus_m = set(gpu[t][node[t] == m].tolist())
            entry = m * GPUS + local_idx       # where the token lands in node m
            nvl_rows[t] += len(gpus_m - {entry})
    return remote_nodes.mean(), remote_pairs.mean(), nvl_rows.mean()


def eta(row_bytes):
    """Payload share of the wire for one chunk of CHUNK rows."""
    payload = CHUNK * row_bytes
    packets = -(-payload // MTU)
    return payload / (payload + packets * HDR + 2 * (8 + HDR))


def op_time(T, rows_nic, rows_nvl, row_bytes):
    nic = T * rows_nic * row_bytes
    nvl = T * rows_nvl * row_bytes
    t_nic = nic / (B_NIC * eta(row_bytes))
    t_nvl = nvl / B_NVL
    fill = RTT + CHUNK * row_bytes / B_NIC
    t = max(t_nic, t_nvl) + fill
    return t, nic, nvl, nic / t / B_NIC


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="V3-train tokens per GPU")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lines = [
        f"Modelled per GPU, 8x H200 per node, one 400 Gb/s NIC per GPU (50 GB/s), NVLink "
        f"{B_NVL / 1e9:.0f} GB/s; V3 E={E} K={K} H={H}; {args.samples} sampled tokens per row.",
        "",
        f"V3-train (T {args.tokens} per GPU), normal mode: dispatch fp8 ({ROW_FP8} B rows), "
        f"combine bf16 ({ROW_BF16} B rows)",
        "",
        "| nodes | EP | routing | remote nodes / token | NIC MB (disp / comb) | NVLink MB (disp) | "
        "dispatch us | combine us | bound | % of NIC line rate | DeepEP published (disp / comb) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ll = ["", f"V3-decode (T {args.decode_tokens} per GPU), low-latency mode: every (token, "
          "expert) pair to a remote node sent directly (fp8 dispatch, bf16 combine)", "",
          "| nodes | EP | routing | remote pairs / token | NIC KB (disp / comb) | dispatch us | "
          "combine us | DeepEP published (disp / comb) |", "|---|---|---|---|---|---|---|---|"]
    for nodes in (2, 4, 8, 16):
        for limited in (False, True):
            name = "group-limited" if limited else "free"
            rn, rp, nvl = traffic(rng, nodes, args.samples, limited)
            T = args.tokens
            td, nic_d, nvl_d, frac_d = op_time(T, rn, nvl, ROW_FP8)
            tc, nic_c, _, frac_c = op_time(T, rn, nvl, ROW_BF16)
            bound = "NIC" if nic_d / (B_NIC * eta(ROW_FP8)) >= nvl_d / B_NVL else "NVLink"
            lines.append(
                f"| {nodes} | {nodes * GPUS} | {name} | {rn:.2f} | {nic_d / 1e6:.1f} / "
                f"{nic_c / 1e6:.1f} | {nvl_d / 1e6:.1f} | {td * 1e6:.0f} | {tc * 1e6:.0f} | "
                f"{bound} | {100 * frac_d:.0f} / {100 * frac_c:.0f} | "
                f"{DEEPEP[nodes] if limited else ''} |")
            Td = args.decode_tokens
            nd_b, nc_b = Td * rp * ROW_FP8, Td * rp * ROW_BF16
            t_ld = nd_b / (B_NIC * eta(ROW_FP8)) + RTT
            t_lc = nc_b / (B_NIC * eta(ROW_BF16)) + RTT
            ll.append(f"| {nodes} | {nodes * GPUS} | {name} | {rp:.2f} | {nd_b / 1e3:.0f} / "
                      f"{nc_b / 1e3:.0f} | {t_ld * 1e6:.0f} | {t_lc * 1e6:.0f} | "
                      f"{DEEPEP_LL[nodes] if limited else ''} |")
    text = "\n".join(lines + ll + [
        "",
        f"Wire efficiency per chunk of {CHUNK} rows: dispatch {eta(ROW_FP8):.3f}, combine "
        f"{eta(ROW_BF16):.3f}; fill per op {1e6 * (RTT + CHUNK * ROW_FP8 / B_NIC):.1f} / "
        f"{1e6 * (RTT + CHUNK * ROW_BF16 / B_NIC):.1f} us. Assumptions: the network leg and the "
        "NVLink forwarding overlap fully (the rings stream both), NICs are not shared and the "
        "fabric is non-blocking, routing is balanced on average (no hot expert), one rail per "
        "local GPU index. DeepEP's V1 'bottleneck bandwidth' counts fp8 payload per destination "
        "node; V2's 'logical bandwidth' includes local traffic: neither is the wire rate."])
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "multinode_model.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
