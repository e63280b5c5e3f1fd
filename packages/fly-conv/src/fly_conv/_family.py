"""Registration of fly-conv with the ``flydsl`` CLI (entry point ``flydsl.families: conv``).

Cheap to import: it describes the family only; kernels are imported inside the callables.
"""

from __future__ import annotations

from flydsl.families import DemoCase, DemoRun, Family

from ._version import __version__


def _conv_case(device) -> DemoRun:
    import torch
    import torch.nn.functional as F

    from .conv import conv
    from .reference import conv_ref

    gpu = device.type == "cuda"
    n, c, k, hw = (32, 128, 128, 28) if gpu else (2, 8, 16, 7)
    dt = torch.bfloat16
    x = torch.randn(n, c, hw, hw, device=device, dtype=dt).to(memory_format=torch.channels_last)
    w = torch.randn(k, c, 3, 3, device=device, dtype=dt) / (9 * c) ** 0.5
    b = torch.randn(k, device=device, dtype=dt)
    return DemoRun(lambda: conv(x, w, b, padding=1, activation="relu"),
                   lambda: conv_ref(x, w, b, padding=1, activation="relu"),
                   lambda: F.relu(F.conv2d(x, w, b, padding=1)), "F.relu(F.conv2d)", 2e-2)  # fmt: skip


def _tunables():
    from .autotune import TUNABLE

    return [TUNABLE]


def _demo_cases():
    return [DemoCase("conv2d 3x3 + bias + relu", _conv_case)]


def _bench(argv) -> int:
    from .bench import main

    return main(list(argv))


FAMILY = Family(
    name="conv",
    distribution="fly-conv",
    module="fly_conv",
    version=__version__,
    description="implicit-GEMM convolution 1D/2D/3D",
    tunables=_tunables,
    demo_cases=_demo_cases,
    bench=_bench,
)
