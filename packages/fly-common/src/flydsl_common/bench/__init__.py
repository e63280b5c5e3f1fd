"""The FlyDSL benchmark harness (DESIGN.md section 8): specs, checked timing, ceilings, reports.

A family describes each op as a :class:`Bench` (cases, ``setup``, providers,
a bytes/flops model and a reference) and calls :func:`main_for` from its
``benchmarks/run.py``; see :mod:`flydsl_common.bench.harness` for the details.
The public names are the harness's own ``__all__`` (one list, kept there).
"""

from . import harness
from .harness import *  # noqa: F403 - re-export exactly harness.__all__

__all__ = list(harness.__all__)
