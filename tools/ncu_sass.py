"""Summarize the per-SASS-line CSVs that tools/ncu_profile.sh writes (``ncu --page source --print-source sass``).

    python tools/ncu_sass.py OUT/ncu/softmax_65536.sass.csv [...] [--elements 134217728] [--top 8]

For each file: the instructions executed in all (and per element, given ``--elements``: thread instructions
over elements), the hot loop's opcode histogram (the lines run the number of times that accounts for the
most work, the loop body's count: one iteration's instructions, per warp; a branch taken inside the body
is left out), and the lines with the most warp-stall samples, each with its
two largest stall reasons. Runs anywhere (no GPU, no ncu): it reads the CSV.
"""

from __future__ import annotations

import argparse
import collections
import csv
from pathlib import Path


def _int(text: str) -> int:
    try:
        return int(text.replace(",", ""))
    except ValueError:
        return 0


def _opcode(source: str) -> str:
    words = source.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def summarize(path: Path, elements: int, top: int) -> str:
    rows = list(csv.reader(path.open()))
    head, data = rows[1], rows[2:]
    src, ex = head.index("Source"), head.index("Instructions Executed")
    samples = head.index("Warp Stall Sampling (All Samples)")
    reasons = [(i, c[len("stall_"):]) for i, c in enumerate(head) if c.startswith("stall_") and "(" not in c]
    counts = [_int(r[ex]) for r in data]
    total = sum(counts)
    total_samples = sum(_int(r[samples]) for r in data) or 1
    out = [f"{path.name}: {total:,} warp instructions, {total_samples:,} stall samples"]
    if elements:
        out[0] += f", {32 * total / elements:.1f} thread instructions an element"
    lines = collections.Counter(n for n in counts if n)
    runs = max(lines, key=lambda n: n * lines[n], default=0)  # the count that accounts for the most work
    loop = collections.Counter(_opcode(r[src]) for r, n in zip(data, counts, strict=True) if n == runs)
    out.append(f"  hot loop ({sum(loop.values())} lines run {runs:,} times each): "
               + ", ".join(f"{op} {n}" for op, n in loop.most_common(20)))  # fmt: skip
    ranked = sorted(range(len(data)), key=lambda k: _int(data[k][samples]), reverse=True)[:top]
    for k in ranked:
        r = data[k]
        why = sorted(((_int(r[i]), name) for i, name in reasons), reverse=True)[:2]
        share = 100 * _int(r[samples]) / total_samples
        out.append(f"  {share:5.1f}% line {k:5d} {r[src].strip()[:56]:56s} "
                   + " ".join(f"{name}={n}" for n, name in why if n))  # fmt: skip
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="+", type=Path)
    ap.add_argument("--elements", type=int, default=0, help="elements the profiled launch processed")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    for p in args.csv:
        print(summarize(p, args.elements, args.top))


if __name__ == "__main__":
    main()
