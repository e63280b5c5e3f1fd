"""Registration of fly-norm with the ``flydsl`` CLI (entry point ``flydsl.families: norm``).

Cheap to import: kernels are imported inside the callables.
"""

from __future__ import annotations

from flydsl.families import DemoCase, DemoRun, Family

from ._version import __version__


def _tunables():
    from .autotune import TUNABLES

    return list(TUNABLES.values())


def _rms_case(device) -> DemoRun:
    import torch
    import torch.nn.functional as F

    from .reference import rms_norm_ref
    from .rmsnorm import rms_norm

    x = torch.randn(512, 4096, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    w = torch.randn(4096, device=device, dtype=x.dtype)
    return DemoRun(lambda: rms_norm(x, w, 1e-6), lambda: rms_norm_ref(x, w, 1e-6),
                   lambda: F.rms_norm(x, (4096,), w, 1e-6), "F.rms_norm", 2e-2)


def _ln_case(device) -> DemoRun:
    import torch
    import torch.nn.functional as F

    from .layernorm import layer_norm
    from .reference import layer_norm_ref

    x = torch.randn(512, 4096, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    w, b = torch.randn(4096, device=device, dtype=x.dtype), torch.randn(4096, device=device, dtype=x.dtype)
    return DemoRun(lambda: layer_norm(x, w, b, 1e-5), lambda: layer_norm_ref(x, w, b, 1e-5),
                   lambda: F.layer_norm(x, (4096,), w, b, 1e-5), "F.layer_norm", 2e-2)


def _softmax_case(device) -> DemoRun:
    import torch

    from .reference import softmax_ref
    from .softmax import softmax

    x = torch.randn(512, 4096, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return DemoRun(lambda: softmax(x, -1), lambda: softmax_ref(x, -1), lambda: torch.softmax(x, -1),
                   "torch.softmax", 2e-2)


def _demo_cases():
    return [
        DemoCase("rms_norm 512x4096", _rms_case),
        DemoCase("layer_norm 512x4096", _ln_case),
        DemoCase("softmax 512x4096", _softmax_case),
    ]


def _bench(argv) -> int:
    from .bench import main

    return main(list(argv))


FAMILY = Family(
    name="norm",
    distribution="fly-norm",
    module="fly_norm",
    version=__version__,
    description="LayerNorm, RMSNorm, softmax (fwd + bwd, fused residual, quantized)",
    tunables=_tunables,
    demo_cases=_demo_cases,
    bench=_bench,
)
