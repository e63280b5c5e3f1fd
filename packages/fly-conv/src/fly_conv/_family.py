"""Registration of fly-conv with the ``flydsl`` CLI (entry point ``flydsl.families: conv``).

Cheap to import: it describes the family only. When kernels land, their demo
cases, tunables and benchmarks are added here and import kernels lazily,
inside the callables.
"""

from __future__ import annotations

from flydsl.families import Family

from ._version import __version__

FAMILY = Family(
    name="conv",
    distribution="fly-conv",
    module="fly_conv",
    version=__version__,
    description="implicit-GEMM convolution 1D/2D/3D",
)
