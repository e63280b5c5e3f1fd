"""FlyDSL's tuning framework and GPU timer.

- :class:`Tunable`: a family's config space; :meth:`Tunable.select` serves a
  config per launch (searched winner, local cache, shipped artifact, default)
  and searches only when asked (``FLYDSL_AUTOTUNE=1`` or ``autotune=True``).
- :class:`SearchTask`, :class:`SearchResult`, :func:`tune_artifact`: checked,
  timed searches and offline artifact generation (``flydsl tune``).
- :class:`LocalCache`, :class:`ArtifactFile`, :func:`write_artifact`: the JSON
  stores (JSON only, atomic writes, bad files ignored with one warning).
- :func:`bench`, :class:`Timing`, :func:`rotating_copies`: the timer.

Importing this package imports neither triton nor torch.
"""

from ..errors import TuningError
from .store import (
    SCHEMA_VERSION,
    ArtifactFile,
    LocalCache,
    TuningWarning,
    atomic_write_json,
    identity,
    key_string,
    write_artifact,
)
from .timer import Timing, bench, rotating_copies
from .tuner import TIE_TOLERANCE, SearchResult, SearchTask, Tunable, narrowed, precompile, tune_artifact

__all__ = [
    "SCHEMA_VERSION",
    "TIE_TOLERANCE",
    "ArtifactFile",
    "LocalCache",
    "SearchResult",
    "SearchTask",
    "Timing",
    "Tunable",
    "TuningError",
    "TuningWarning",
    "atomic_write_json",
    "bench",
    "identity",
    "key_string",
    "narrowed",
    "rotating_copies",
    "precompile",
    "tune_artifact",
    "write_artifact",
]
