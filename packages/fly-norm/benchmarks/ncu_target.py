"""A fly-norm op run a few times, for Nsight Compute to profile one launch: python ncu_target.py OP N [--bwd]

OP: rms_norm, layer_norm, softmax or copy (the ceiling: torch's elementwise x * 1 into another tensor, a
kernel that reads and writes each element once; a same-dtype ``copy_`` is a memcpy, which ncu does not
profile). bf16, M * N = 2^27 as the benchmark. The backward runs through autograd, as the benchmark times
it. tools/ncu_profile.sh drives it.
"""

from __future__ import annotations

import argparse

import torch

import fly_norm
import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("op", choices=("rms_norm", "layer_norm", "softmax", "copy"))
    ap.add_argument("n", type=int)
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--runs", type=int, default=4)
    a = ap.parse_args()
    m = (1 << 27) // a.n
    x = torch.randn(m, a.n, device="cuda", dtype=torch.bfloat16, requires_grad=a.bwd)
    w = torch.randn(a.n, device="cuda", dtype=torch.bfloat16, requires_grad=a.bwd)
    b = torch.randn(a.n, device="cuda", dtype=torch.bfloat16, requires_grad=a.bwd)
    out = torch.empty_like(x)
    ops = {
        "rms_norm": lambda: fly_norm.rms_norm(x, w),
        "layer_norm": lambda: fly_norm.layer_norm(x, w, b),
        "softmax": lambda: fly_norm.softmax(x),
        "copy": lambda: torch.mul(x.detach(), 1, out=out),
    }
    f = ops[a.op]
    if a.bwd:
        y = f()
        dy = torch.randn_like(x)
        leaves = [x, w, b] if a.op == "layer_norm" else [x, w] if a.op == "rms_norm" else [x]
        f = lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)  # noqa: E731
    for _ in range(a.runs):
        f()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
