"""Registration of fly-attention with the ``flydsl`` CLI (entry point ``flydsl.families: attention``).

Cheap to import: it describes the family only. When kernels land, their demo
cases, tunables and benchmarks are added here and import kernels lazily,
inside the callables.
"""

from __future__ import annotations

from flydsl.families import Family

from ._version import __version__

FAMILY = Family(
    name="attention",
    distribution="fly-attention",
    module="fly_attention",
    version=__version__,
    description="flash attention, decode, paged KV, RoPE + cache",
)
