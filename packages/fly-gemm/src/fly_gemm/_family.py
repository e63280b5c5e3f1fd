"""Registration of fly-gemm with the ``flydsl`` CLI (entry point ``flydsl.families: gemm``).

Cheap to import: it describes the family only. When kernels land, their demo
cases, tunables and benchmarks are added here and import kernels lazily,
inside the callables.
"""

from __future__ import annotations

from flydsl.families import Family

from ._version import __version__

FAMILY = Family(
    name="gemm",
    distribution="fly-gemm",
    module="fly_gemm",
    version=__version__,
    description="dense / scaled GEMM with fused epilogues, MoE",
)
