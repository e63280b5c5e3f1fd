"""The packaging contract every FlyDSL package's tests check (one copy, here).

    from flydsl.testing.package import check_family_package
    check_family_package(fly_norm, distribution="fly-norm", name="norm")

It holds for the installed package, editable from the repository or a wheel in
a fresh environment (``nox -s isolation-<name>``).
"""

from __future__ import annotations

import re
from importlib import metadata
from types import ModuleType

from ..families import GROUP, Family, discover

__all__ = ["check_family_package", "sibling_range"]

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")


def sibling_range(distribution: str, sibling: str) -> list[tuple[str, str]]:
    """The (operator, version) clauses with which ``distribution`` requires ``sibling``."""
    clauses = None
    for raw in metadata.requires(distribution) or []:
        m = _REQ.match(raw)
        if m and re.sub(r"[-_.]+", "-", m.group(1)).lower() == sibling:
            spec = m.group(2).strip().strip("()")
            clauses = [tuple(re.match(r"(~=|==|!=|<=|>=|<|>)\s*(\S+)", c.strip()).groups()) for c in spec.split(",")]
    if clauses is None:
        raise AssertionError(f"{distribution} does not require {sibling}")
    return clauses


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v)[:3])


def check_family_package(
    module: ModuleType,
    *,
    distribution: str,
    name: str,
    siblings: tuple[str, ...] = ("flydsl-runtime", "flydsl-common"),
) -> None:
    """Assert the contract: one version source, ``__all__`` complete, the entry point registered by
    this distribution and resolving to a matching :class:`Family`, and siblings required as ranges."""
    mod = module.__name__
    assert module.__version__ == metadata.version(distribution), "__version__ differs from the installed metadata"
    assert "__version__" in module.__all__
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"__all__ names missing from {mod}: {missing}"

    eps = [ep for ep in metadata.entry_points(group=GROUP) if ep.name == name]
    assert len(eps) == 1, f"expected one {GROUP} entry point named {name!r}, found {eps}"
    assert eps[0].value == f"{mod}._family:FAMILY", eps[0].value
    family = eps[0].load()
    assert isinstance(family, Family)
    assert (family.name, family.module, family.distribution) == (name, mod, distribution)
    assert family.version == module.__version__ and family.description
    own = {ep.name for ep in metadata.distribution(distribution).entry_points if ep.group == GROUP}
    assert own == {name}, f"{distribution} registers {own} in {GROUP}"
    assert discover()[name].distribution == distribution

    for sibling in siblings:
        # Siblings are released on their own: a range keeps fixes flowing, a pin would freeze them.
        clauses = sibling_range(distribution, sibling)
        ops = {op for op, _ in clauses}
        assert ops == {">=", "<"}, f"{sibling} must be required as a >=,< range, got {clauses}"
        installed = _version_tuple(metadata.version(sibling))
        lo = next(_version_tuple(v) for op, v in clauses if op == ">=")
        hi = next(_version_tuple(v) for op, v in clauses if op == "<")
        assert lo <= installed < hi, f"installed {sibling} {installed} is outside {clauses}"
