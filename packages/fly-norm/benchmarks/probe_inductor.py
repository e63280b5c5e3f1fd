"""Probe: torch.compile's softmax backward next to fly-norm's, and the Triton source inductor generates for it.

    python probe_inductor.py --widths 2048 4096 16384 --out DIR

bf16 rows, M * N = 2^27 as the benchmark, both backwards through autograd as the benchmark times them (the
forward run once, its graph kept). Writes DIR/probe-inductor.json (times, % of the copy measured in the same
run, relative error of each dx to fp64) and DIR/inductor-softmax-bwd-N.py (every module inductor wrote for
that width: the kernels with their launch heuristics). Design probe, not the benchmark.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import fly_norm
import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps


def main() -> None:
    from torch._inductor.utils import run_and_get_code  # after flydsl (it imports triton)

    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", nargs="*", type=int, default=[2048, 4096, 16384])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--elements", type=int, default=1 << 27, help="M * N (a smoke run on the CPU: small)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    copy = copy_gbps(1 << 29) if dev == "cuda" else float("nan")
    rows = [dict(copy_GBps=copy)]
    for n in args.widths:
        m = args.elements // n
        x = torch.randn(m, n, dtype=torch.bfloat16, device=dev) * 2
        dy = torch.randn_like(x)
        xd = x.double().requires_grad_()
        ref = torch.autograd.grad(torch.softmax(xd, -1), xd, dy.double())[0]
        compiled = torch.compile(lambda t: torch.softmax(t, -1), fullgraph=True)
        providers = {"flydsl": lambda t: fly_norm.softmax(t, -1), "torch.compile": compiled}
        for name, f in providers.items():
            leaf = x.detach().requires_grad_()
            if name == "torch.compile":
                y, code = run_and_get_code(lambda leaf=leaf, f=f: f(leaf))
                (args.out / f"inductor-softmax-fwd-{n}.py").write_text("\n\n# ----\n\n".join(code))
            else:
                y = f(leaf)

            def run(y=y, leaf=leaf, g=dy):
                return torch.autograd.grad(y, leaf, g, retain_graph=True)[0]

            if name == "torch.compile":
                dx, code = run_and_get_code(run)
                (args.out / f"inductor-softmax-bwd-{n}.py").write_text("\n\n# ----\n\n".join(code))
            else:
                dx = run()
            err = ((dx.double() - ref).norm() / ref.norm()).item()
            us = bench(run).median_us
            r = dict(N=n, M=m, provider=name, us=us, frac_copy=3 * 2 * m * n / (us * 1e-6) / 1e9 / copy, rel_err=err)
            print(r, flush=True)
            rows.append(r)
        del x, xd, ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    (args.out / "probe-inductor.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
