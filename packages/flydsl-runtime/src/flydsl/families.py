"""Discovery of installed kernel families through the ``flydsl.families`` entry points.

Each package that ships kernels registers one :class:`Family` object::

    [project.entry-points."flydsl.families"]
    norm = "fly_norm._family:FAMILY"

so the ``flydsl`` CLI can list, tune, benchmark and demo what is installed
without any import between packages. The module an entry point names must stay
cheap to import: it describes the family and imports kernels only inside the
callables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

__all__ = ["Family", "DemoCase", "DemoRun", "DemoResult", "discover", "GROUP"]

GROUP = "flydsl.families"
_log = logging.getLogger("flydsl")


@dataclass(frozen=True)
class DemoResult:
    """One demo problem: checked against torch, and timed when a GPU is present."""

    family: str
    name: str
    rel_error: float
    tolerance: float
    ours_us: float | None = None
    torch_us: float | None = None
    torch_name: str = ""

    @property
    def ok(self) -> bool:
        return self.rel_error == self.rel_error and self.rel_error <= self.tolerance  # NaN never passes


@dataclass(frozen=True)
class DemoRun:
    """Ready inputs for one demo problem: our op, its reference and the torch op it replaces."""

    ours: Callable[[], Any]  # runs the FlyDSL kernel, returns the output tensor
    reference: Callable[[], Any]  # fp32/fp64 reference output
    torch_op: Callable[[], Any]  # the torch call a user would make instead (timed on a GPU)
    torch_name: str
    tolerance: float  # on ||ours - ref|| / ||ref||
    compare: Callable[[Any], Any] | None = None  # maps ours' output to what is compared (not timed)


@dataclass(frozen=True)
class DemoCase:
    """A small problem a family shows in ``flydsl demo``; ``prepare(device)`` builds its inputs."""

    name: str
    prepare: Callable[[Any], DemoRun]


@dataclass(frozen=True)
class Family:
    """What a kernel package tells the runtime about itself."""

    name: str  # short name used on the command line: "norm", "gemm", ...
    distribution: str  # the PyPI name: "fly-norm"
    module: str  # the import name: "fly_norm"
    version: str
    description: str = ""
    tunables: Callable[[], Sequence[Any]] = field(default=lambda: ())  # -> [flydsl.autotune.Tunable]
    demo_cases: Callable[[], Sequence[DemoCase]] = field(default=lambda: ())
    bench: Callable[[Sequence[str]], int] | None = None  # argv -> exit status


def discover() -> dict[str, Family]:
    """Every installed family, by short name. A broken registration is logged and skipped."""
    found: dict[str, Family] = {}
    for ep in metadata.entry_points(group=GROUP):
        try:
            fam = ep.load()
        except Exception as exc:  # a broken plugin must not take the CLI down
            _log.warning("flydsl: family entry point %r failed to load: %s", ep.name, exc)
            continue
        if not isinstance(fam, Family):
            _log.warning("flydsl: entry point %r did not name a flydsl.families.Family", ep.name)
            continue
        found[fam.name] = fam
    return dict(sorted(found.items()))
