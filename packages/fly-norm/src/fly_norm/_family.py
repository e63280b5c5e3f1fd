"""Registration of fly-norm with the ``flydsl`` CLI (entry point ``flydsl.families: norm``).

Cheap to import: it describes the family only. When kernels land, their demo
cases, tunables and benchmarks are added here and import kernels lazily,
inside the callables.
"""

from __future__ import annotations

from flydsl.families import Family

from ._version import __version__

FAMILY = Family(
    name="norm",
    distribution="fly-norm",
    module="fly_norm",
    version=__version__,
    description="LayerNorm, RMSNorm, softmax (fwd + bwd, fused residual, quantized)",
)
