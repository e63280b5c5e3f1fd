"""Registration of fly-gemm with the ``flydsl`` CLI (entry point ``flydsl.families: gemm``).

Cheap to import: kernels are imported inside the callables.
"""

from __future__ import annotations

from flydsl.families import DemoCase, DemoRun, Family

from ._version import __version__


def _gemm_case(device) -> DemoRun:
    import torch
    import torch.nn.functional as F

    from .gemm import gemm
    from .reference import gemm_ref

    gpu = device.type == "cuda"
    m, n, k = (1024, 4096, 4096) if gpu else (48, 40, 32)
    dt = torch.bfloat16
    a, b = torch.randn(m, k, device=device, dtype=dt), torch.randn(n, k, device=device, dtype=dt)
    bias = torch.randn(n, device=device, dtype=dt)
    return DemoRun(lambda: gemm(a, b, bias=bias, activation="gelu"),
                   lambda: gemm_ref(a, b, bias=bias, activation="gelu"),
                   lambda: F.gelu(F.linear(a, b, bias)), "F.gelu(F.linear)", 2e-2)  # fmt: skip


def _tunables():
    from .autotune import TUNABLE
    from .grouped_gemm import GROUPED_TUNABLE
    from .moe_config import MOE_TUNABLE

    return [TUNABLE, MOE_TUNABLE, GROUPED_TUNABLE]


def _demo_cases():
    return [DemoCase("gemm + bias + gelu", _gemm_case)]


def _bench(argv) -> int:
    from .bench import main

    return main(list(argv))


FAMILY = Family(
    name="gemm",
    distribution="fly-gemm",
    module="fly_gemm",
    version=__version__,
    description="dense / scaled GEMM with fused epilogues, MoE",
    tunables=_tunables,
    demo_cases=_demo_cases,
    bench=_bench,
)
