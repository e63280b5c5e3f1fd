"""A decode-size GEMM (or what bounds it) run a few times, for Nsight Compute to profile one launch.

    python ncu_target.py gemm M N K        fly_gemm.gemm, bf16, weights [N, K] as the benchmark
    python ncu_target.py cublas M N K      torch.matmul on the same operands
    python ncu_target.py read MIB          probe.py's read-only kernel over MIB MiB (its default config)

ncu flushes the caches before each profiled launch (``--cache-control all``, its default), so the weights
come from memory as in the benchmark; its duration is the kernel's own, without the launch gaps a
back-to-back timing includes. tools/ncu_profile.sh drives it (``NCU_TARGET`` set to this file).
"""

from __future__ import annotations

import argparse

import torch

import flydsl.arch  # noqa: F401 - choose compiled vs interpreted Triton first
from fly_gemm import gemm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("gemm", "cublas", "read"))
    ap.add_argument("sizes", type=int, nargs="+")
    ap.add_argument("--runs", type=int, default=4)
    a = ap.parse_args()
    if a.what == "read":
        from probe import _read_us  # the read-only kernel, checked and timed once there

        x = torch.randint(-100, 100, (a.sizes[0] << 18,), dtype=torch.int32, device="cuda")
        for _ in range(a.runs):
            _read_us(x)
    else:
        m, n, k = a.sizes
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        f = (lambda: gemm(x, w)) if a.what == "gemm" else (lambda: torch.matmul(x, w.t()))
        for _ in range(a.runs):
            f()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
