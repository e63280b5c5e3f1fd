"""Can this Triton compile a row reduction over a thread block cluster (``num_ctas`` > 1) for sm_90?

    python tools/cluster_probe.py

A row of 64K columns split over the CTAs of one cluster would be reduced
through distributed shared memory instead of L2 (the route PERF.md names for
the forwards past 32K columns). Compiles, without a GPU, a one-row RMS
normalization as a [1, N] block (our kernels' shape) and as an [N] vector, at
1, 2 and 4 CTAs a program, and prints what the compiler says.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _rows_2d(x_ptr, y_ptr, N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N)[None, :]
    x = tl.load(x_ptr + row * N + cols).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / N + 1e-6)
    tl.store(y_ptr + row * N + cols, (x * r[:, None]).to(tl.bfloat16))


@triton.jit
def _rows_1d(x_ptr, y_ptr, N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + row * N + cols).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / N + 1e-6)
    tl.store(y_ptr + row * N + cols, (x * r).to(tl.bfloat16))


def main() -> None:
    target = GPUTarget("cuda", 90, 32)
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "N": "constexpr"}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    print("triton", triton.__version__)
    for kernel in (_rows_2d, _rows_1d):
        for ctas in (1, 2, 4):
            try:
                triton.compile(ASTSource(kernel, sig, {"N": 65536}, attrs), target=target,
                               options={"num_warps": 32, "num_ctas": ctas})  # fmt: skip
                outcome = "compiles"
            except Exception as e:  # noqa: BLE001 - the probe reports what the compiler says
                outcome = f"fails: {str(e).splitlines()[0][:120]}"
            print(f"{kernel.fn.__name__} num_ctas={ctas}: {outcome}")


if __name__ == "__main__":
    main()
