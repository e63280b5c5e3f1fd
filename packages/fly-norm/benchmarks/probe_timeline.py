"""Probe: where a backward call's device time goes, kernel by kernel.

    python probe_timeline.py --ops layer_norm rms_norm --widths 16384 32768 --out DIR

For each op and width (bf16, M * N = 2^27), the backward through autograd as the benchmark times it, run
back to back: the time an iteration (CUDA events over the loop) and, from torch.profiler, every device
activity an iteration launches (kernels and memsets) with its mean duration. What is left of the iteration
after the activities is the gaps between them (launch latency, a grid's ramp and tail). Design probe, not
the benchmark.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

import fly_norm
from flydsl_common.bench import copy_gbps

_OPS = {
    "layer_norm": (2, lambda x, p: fly_norm.layer_norm(x, p[0], p[1])),
    "rms_norm": (1, lambda x, p: fly_norm.rms_norm(x, p[0])),
    "softmax": (0, lambda x, p: fly_norm.softmax(x)),
}


def _backward(y, leaves, dy):
    return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)


def _iteration_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _activities(fn, iters: int) -> list[dict]:
    """Each device activity's name, count an iteration and mean duration (us)."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    count = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time
            count[ev.name] += 1
    return [
        {"name": k[:120], "per_iter": count[k] / iters, "mean_us": total[k] / count[k]}
        for k in sorted(total, key=total.get, reverse=True)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", nargs="+", default=list(_OPS))
    ap.add_argument("--widths", nargs="+", type=int, default=[16384, 32768])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    copy = copy_gbps(2 * 2 * (1 << 27), torch.device("cuda"))
    rows = []
    for op in args.ops:
        n_params, f = _OPS[op]
        for n in args.widths:
            m = (1 << 27) // n
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            params = [torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(n_params)]
            dy = torch.randn_like(x)
            fn = _backward(f(x, params), [x, *params], dy)
            it = _iteration_us(fn, args.iters)
            acts = _activities(fn, args.iters)
            busy = sum(a["per_iter"] * a["mean_us"] for a in acts)
            nbytes = 2 * 3 * m * n + 2 * 2 * n_params * n + 8 * m
            row = {
                "op": op, "N": n, "M": m, "iteration_us": it, "activities_us": busy, "gaps_us": it - busy,
                "pct_of_copy": 100 * nbytes / (it * 1e-6) / (copy * 1e9), "activities": acts,
            }  # fmt: skip
            rows.append(row)
            print(f"{op} N={n}: iteration {it:.1f} us, activities {busy:.1f}, gaps {it - busy:.1f}, "
                  f"{row['pct_of_copy']:.1f}% of copy")  # fmt: skip
            for a in acts:
                print(f"    {a['per_iter']:.0f} x {a['mean_us']:7.2f} us  {a['name']}")
            del x, params, dy, fn
            torch.cuda.empty_cache()
    (args.out / "probe-timeline.json").write_text(json.dumps({"copy_gbps": copy, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
