"""Benchmarks of fly-gemm against the peers a user would pick, on the shared harness.

Run ``python packages/fly-gemm/benchmarks/run.py [--quick] [--only NAME]`` or
``flydsl bench gemm ...``. Every case is checked against the fp64 reference
before it is timed; the ceilings (device copy bandwidth, cuBLAS bf16 peak)
are measured in the same run.

- ``gemm_bf16``: C = A @ B^T, bf16, M from 256 to 8192 on LLM projection
  shapes (N, K from 4096 to 28672), against ``torch.matmul`` (cuBLAS);
  TFLOP/s (2 M N K flops);
- ``gemm_bf16_decode``: M = 1, 4, 16 on the same weights: a read of the
  weights dominates, so the model is bytes (weights, activations, output) and
  the ceiling the copy bandwidth;
- ``gemm_fp8``: fp8 e4m3 with per-row x per-column scales, bf16 output,
  against ``torch._scaled_mm``;
- ``gemm_int8``: int8 to the raw int32 product, against ``torch._int_mm``;
- ``gemm_bias_gelu``: bf16 with bias and exact GELU fused, against
  ``F.gelu(F.linear(x, w, b))`` eager and compiled.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from flydsl_common.bench import Bench, Case, CompiledPeer, Provider, main_for, results_dir

from .autotune import TUNE_NK
from .gemm import gemm
from .reference import gemm_ref

__all__ = ["benches", "main", "default_out_dir"]

# (N, K) of LLM projections: the shipped artifact's tuning shapes, so every benched shape is a searched one
_NK = TUNE_NK
_M_LARGE = (256, 1024, 4096, 8192)
_M_DECODE = (1, 4, 16)
# The interpreter's smoke case (N a multiple of 16: torch._scaled_mm requires it)
_QUICK = [Case("48x48x32", {"M": 48, "N": 48, "K": 32})]


def _cases(ms: Sequence[int], nks=_NK) -> list[Case]:
    return [Case(f"{m}x{n}x{k}", {"M": m, "N": n, "K": k}) for m in ms for n, k in nks]


def _mnk(case: Case) -> tuple[int, int, int]:
    return case.params["M"], case.params["N"], case.params["K"]


def _flops(case: Case) -> int:
    m, n, k = _mnk(case)
    return 2 * m * n * k


def _dtype(device) -> torch.dtype:
    # the interpreter's bf16 dot multiplies raw bit patterns: its smoke runs use fp16
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float16


def _setup_16bit(case, device):
    m, n, k = _mnk(case)
    dt = _dtype(device)
    return torch.randn(m, k, device=device, dtype=dt), torch.randn(n, k, device=device, dtype=dt)


def _bf16_bench(name: str, ms, decode: bool) -> Bench:
    def nbytes(case):
        m, n, k = _mnk(case)
        return 2 * (n * k + m * k + m * n)

    return Bench(
        name=name,
        cases=_cases(ms),
        quick_cases=_QUICK,
        setup=_setup_16bit,
        providers=[
            Provider("flydsl", lambda t: lambda: gemm(*t), is_ours=True),
            Provider("torch.matmul", lambda t: lambda: torch.matmul(t[0], t[1].t())),
        ],
        bytes=nbytes if decode else None,
        flops=_flops,
        reference=lambda t: gemm_ref(*t),
        tolerance=1e-2,
        x_param="M",
        group_by=("N", "K"),
        description="C = A @ B^T, B [N, K]; " + ("bytes: weights + activations + output" if decode else "2MNK flops"),
    )


def _scales(m: int, n: int, device):
    return torch.rand(m, device=device) + 0.5, torch.rand(n, device=device) + 0.5


def _fp8_bench() -> Bench:
    def setup(case, device):
        m, n, k = _mnk(case)
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        return (a, b, *_scales(m, n, device))

    def scaled_mm(t):
        a, b, sa, sb = t
        if a.device.type != "cuda":
            return None
        return lambda: torch._scaled_mm(a, b.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16)

    return Bench(
        name="gemm_fp8",
        cases=_cases((16, *_M_LARGE)),
        quick_cases=_QUICK,
        setup=setup,
        providers=[
            Provider("flydsl", lambda t: lambda: gemm(t[0], t[1], scale_a=t[2], scale_b=t[3]), is_ours=True),
            Provider("torch._scaled_mm", scaled_mm),
        ],
        flops=_flops,
        reference=lambda t: gemm_ref(t[0], t[1], scale_a=t[2], scale_b=t[3]),
        tolerance=1e-2,
        x_param="M",
        group_by=("N", "K"),
        description="fp8 e4m3, per-row x per-column fp32 scales, bf16 output",
    )


def _int8_bench() -> Bench:
    def setup(case, device):
        m, n, k = _mnk(case)
        a = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
        return a, torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)

    def int_mm(t):
        return None if t[0].device.type != "cuda" else (lambda: torch._int_mm(t[0], t[1].t()))

    return Bench(
        name="gemm_int8",
        cases=_cases((32, *_M_LARGE)),  # torch._int_mm needs M > 16
        quick_cases=_QUICK,
        setup=setup,
        providers=[
            Provider("flydsl", lambda t: lambda: gemm(t[0], t[1], out_dtype=torch.int32), is_ours=True),
            Provider("torch._int_mm", int_mm),
        ],
        flops=_flops,
        reference=lambda t: gemm_ref(*t),
        tolerance=1e-9,  # the int32 product is exact
        x_param="M",
        group_by=("N", "K"),
        description="int8 x int8 -> int32 (raw product)",
    )


_GELU = CompiledPeer(lambda x, w, b: F.gelu(F.linear(x, w, b)))


def _bias_gelu_bench() -> Bench:
    def setup(case, device):
        a, b = _setup_16bit(case, device)
        return a, b, torch.randn(b.shape[0], device=device, dtype=a.dtype)

    return Bench(
        name="gemm_bias_gelu",
        cases=_cases((1024, 4096, 8192)),
        quick_cases=_QUICK,
        setup=setup,
        providers=[
            Provider("flydsl", lambda t: lambda: gemm(t[0], t[1], bias=t[2], activation="gelu"), is_ours=True),
            Provider("torch", lambda t: lambda: F.gelu(F.linear(*t))),
            Provider("torch.compile", lambda t: _GELU.make(tuple(t[0].shape) + tuple(t[1].shape), *t)),
        ],
        flops=_flops,
        reference=lambda t: gemm_ref(t[0], t[1], bias=t[2], activation="gelu"),
        tolerance=1e-2,
        x_param="M",
        group_by=("N", "K"),
        description="bf16 C = gelu(A @ B^T + bias), exact (erf) GELU",
    )


def benches() -> list[Bench]:
    return [
        _bf16_bench("gemm_bf16", _M_LARGE, decode=False),
        _bf16_bench("gemm_bf16_decode", _M_DECODE, decode=True),
        _fp8_bench(),
        _int8_bench(),
        _bias_gelu_bench(),
    ]


def default_out_dir() -> Path:
    return results_dir("fly-gemm", __file__)


def main(argv: Sequence[str] | None = None) -> int:
    return main_for(benches(), list(argv or []), default_out_dir())
