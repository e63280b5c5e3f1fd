"""Registration of flydsl-common with the ``flydsl`` CLI (entry point ``flydsl.families: common``).

Cheap to import: kernels are imported inside the callables.
"""

from __future__ import annotations

from flydsl.families import DemoCase, DemoRun, Family

from ._version import __version__


def _vec_add_case(device) -> DemoRun:
    import torch

    from .reference import vec_add_ref
    from .vec_add import vec_add

    a = torch.randn(1 << 20, device=device)
    b = torch.randn(1 << 20, device=device)
    out = torch.empty_like(a)
    return DemoRun(
        ours=lambda: vec_add(a, b, out=out),
        reference=lambda: vec_add_ref(a, b),
        torch_op=lambda: torch.add(a, b, out=out),
        torch_name="torch.add",
        tolerance=1e-6,
    )


def _quant_case(dtype_name: str, per_token: bool):
    def prepare(device) -> DemoRun:
        import torch

        from .quant import quantize_per_tensor, quantize_per_token
        from .reference import dequantize_ref, quantize_per_tensor_ref, quantize_per_token_ref

        qdtype = torch.int8 if dtype_name == "int8" else torch.float8_e4m3fn
        x = torch.randn(1024, 4096, device=device, dtype=torch.bfloat16)
        qmax = 127.0 if qdtype == torch.int8 else 448.0
        fn = quantize_per_token if per_token else quantize_per_tensor

        def ours():
            return fn(x, qdtype)

        def dequantized(out):
            return dequantize_ref(*out, per_token)

        def torch_op():  # what a user writes in eager torch
            xf = x.float()
            amax = xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax()
            s = amax / qmax
            q = (xf / s).clamp(-qmax, qmax)
            q = q.round().to(qdtype) if qdtype == torch.int8 else q.to(qdtype)
            return q, s

        def reference():  # the same scheme computed by torch in fp32, dequantized
            ref = quantize_per_token_ref if per_token else quantize_per_tensor_ref
            return dequantize_ref(*ref(x, qdtype), per_token)

        # Only round-to-nearest ties may differ from the reference (one step on
        # a handful of elements); the interpreter's fp8 conversion rounds ties up.
        tol = 1e-3 if qdtype == torch.int8 else 1e-2
        return DemoRun(ours, reference, torch_op, "torch eager (amax, div, clamp, cast)", tol, compare=dequantized)

    return prepare


def _demo_cases():
    cases = [DemoCase("vec_add fp32 1M", _vec_add_case)]
    for name in ("int8", "fp8"):
        cases.append(DemoCase(f"quantize_per_token bf16 1024x4096 -> {name}", _quant_case(name, True)))
        cases.append(DemoCase(f"quantize_per_tensor bf16 1024x4096 -> {name}", _quant_case(name, False)))
    return cases


def _bench(argv) -> int:
    from .bench.common_bench import main

    return main(list(argv))


FAMILY = Family(
    name="common",
    distribution="flydsl-common",
    module="flydsl_common",
    version=__version__,
    description="shared building blocks, quantization, vec-add",
    demo_cases=_demo_cases,
    bench=_bench,
)
