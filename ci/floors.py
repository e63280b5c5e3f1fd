"""The lowest versions each package declares it works with, for ``nox -s test-<name>-min``.

A package's floor set is the lower end of every third-party requirement of the package
and of our packages it installs with (torch>=2.9 -> torch==2.9), plus the lower end of
its ranges on our packages. Every direct requirement must have a lower end: one without
cannot be tested at its floor. Standard library plus ``packaging``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

CI_DIR = Path(__file__).resolve().parent
if str(CI_DIR) not in sys.path:
    sys.path.insert(0, str(CI_DIR))

from monorepo import PACKAGES, Package, install_order  # noqa: E402
from release import lower_end, requirements, sibling_requirements  # noqa: E402

OURS = {canonicalize_name(p.distribution) for p in PACKAGES}


@dataclass(frozen=True)
class Floor:
    name: str  # canonical distribution name
    version: Version
    required_by: tuple[str, ...]  # "fly-gemm: torch>=2.9", ...

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


def third_party(root: Path, pkg: Package) -> list[Requirement]:
    """Direct third-party requirements of ``pkg`` (no extras, no environment markers excluded)."""
    return [r for r in requirements(root, pkg) if canonicalize_name(r.name) not in OURS]


def missing_lower_bounds(root: Path, pkg: Package) -> list[str]:
    return [
        f"{pkg.path}/pyproject.toml: {r} has no lower bound (>=): declare the oldest version the code works with"
        for r in third_party(root, pkg)
        if lower_end(r.specifier) is None
    ]


def third_party_floors(root: Path, pkg: Package) -> list[Floor]:
    """One floor per third-party distribution the package installs with: the highest lower end declared."""
    found: dict[str, tuple[Version, list[str]]] = {}
    for p in install_order(pkg.name):
        for r in third_party(root, p):
            low = lower_end(r.specifier)
            if low is None:
                continue
            name = canonicalize_name(r.name)
            have, why = found.get(name, (low, []))
            found[name] = (max(have, low), [*why, f"{p.distribution}: {r}"])
    return [Floor(n, v, tuple(why)) for n, (v, why) in sorted(found.items())]


def sibling_floors(root: Path, pkg: Package) -> list[tuple[Package, Version, Requirement]]:
    """(sibling, lower end, requirement) for every package of ours ``pkg`` installs with, lowest layer first.

    The lower end a sibling must meet is the highest one any package in the install declares for it.
    """
    lows: dict[str, tuple[Version, Requirement]] = {}
    for p in install_order(pkg.name):
        for sib, req in sibling_requirements(root, p).items():
            low = lower_end(req.specifier)
            if low is not None and (sib not in lows or low > lows[sib][0]):
                lows[sib] = (low, req)
    return [(p, *lows[p.name]) for p in install_order(pkg.name) if p.name in lows]


def merged_constraints(base: str, floors: list[Floor]) -> str:
    """``base`` (a constraints file's text) with the floors replacing any pin of the same distribution."""
    names = {f.name for f in floors}
    kept = []
    for line in base.splitlines():
        spec = line.split("#", 1)[0].strip()
        if spec:
            name = canonicalize_name(re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0])
            if name in names:
                continue
        kept.append(line)
    floor_lines = [f"{f.pin}  # {'; '.join(f.required_by)}" for f in floors]
    return "\n".join([*kept, "", "# floors (ci/floors.py)", *floor_lines]) + "\n"
