"""The FlyDSL benchmark harness (DESIGN.md section 8): specs, checked timing, ceilings, reports.

A family describes each op as a :class:`Bench` (cases, ``setup``, providers,
a bytes/flops model and a reference) and calls :func:`main_for` from its
``benchmarks/run.py``; see :mod:`flydsl_common.bench.harness` for the details.
"""

from .harness import (
    COPY_GBPS,
    MATMUL_BF16_TFLOPS,
    Bench,
    BenchResult,
    Case,
    CompiledPeer,
    Provider,
    Results,
    Row,
    Skip,
    environment,
    gpu_slug,
    main_for,
    measure_ceilings,
    run,
    write_all,
)

__all__ = [
    "COPY_GBPS",
    "MATMUL_BF16_TFLOPS",
    "Bench",
    "BenchResult",
    "Case",
    "CompiledPeer",
    "Provider",
    "Results",
    "Row",
    "Skip",
    "environment",
    "gpu_slug",
    "main_for",
    "measure_ceilings",
    "run",
    "write_all",
]
