"""Where a kernel's instructions go: ncu's SASS source page summarized.

    ncu -o r -k <kernel> --launch-count 1 --section SourceCounters python ...
    ncu -i r.ncu-rep --page source --print-source sass --csv > sass.csv
    python scripts/sass_counts.py sass.csv [--per N]

SASS lines executed the same number of times form one block (a loop body,
or one branch of it); each block of 1% or more of the warp instructions gets
a row: its execution count, its lines, its warp instructions (divided by
``--per``, e.g. the kernel's tile-steps) and its most executed opcodes.
"""
from __future__ import annotations

import argparse
import collections
import csv


def opcode(src: str) -> str:
    words = src.split()
    op = words[1] if words[0].startswith("@") else words[0]
    return op.split(".")[0] + (".MOV" if ".MOV" in op else "")


def blocks(path):
    """{execution count: Counter(opcode -> warp instructions)} of the SASS lines."""
    rows = [r for r in csv.reader(open(path)) if r]
    head = next(i for i, r in enumerate(rows) if "Source" in r and "Instructions Executed" in r)
    src, cnt = rows[head].index("Source"), rows[head].index("Instructions Executed")
    out = collections.defaultdict(collections.Counter)
    for r in rows[head + 1:]:
        if len(r) > cnt and r[cnt].isdigit() and r[src].strip():
            out[int(r[cnt])][opcode(r[src])] += int(r[cnt])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--per", type=float, default=1.0,
                    help="divide warp instructions by this (e.g. the kernel's tile-steps)")
    args = ap.parse_args()
    b = blocks(args.csv)
    total = sum(sum(c.values()) for c in b.values())
    print(f"warp instructions: {total:,} ({total / args.per:,.1f} per unit)")
    print("| executed | lines | warp instr. per unit | share | top opcodes (per unit) |")
    print("|---|---|---|---|---|")
    for n, ops in sorted(b.items(), key=lambda kv: -sum(kv[1].values())):
        w = sum(ops.values())
        if w < 0.01 * total:
            continue
        top = ", ".join(f"{o} {c / args.per:,.1f}" for o, c in ops.most_common(8))
        lines = round(w / n)
        print(f"| {n:,} | {lines} | {w / args.per:,.1f} | {w / total:.0%} | {top} |")


if __name__ == "__main__":
    main()
