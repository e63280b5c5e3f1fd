"""Packaging contract of fly-norm: one version source and the ``flydsl.families`` registration.

These hold for the installed package, whether editable from the repo or a
wheel in a fresh environment (``nox -s isolation-norm``).
"""

from __future__ import annotations

from importlib import metadata

import pytest
from packaging.requirements import Requirement

import fly_norm
from flydsl.families import GROUP, Family, discover

DIST = "fly-norm"
NAME = "norm"
MODULE = "fly_norm"


def _entry_point() -> metadata.EntryPoint:
    eps = [ep for ep in metadata.entry_points(group=GROUP) if ep.name == NAME]
    assert len(eps) == 1, f"expected one {GROUP} entry point named {NAME!r}, found {eps}"
    return eps[0]


def test_version_is_the_distribution_version():
    assert fly_norm.__version__ == metadata.version(DIST)


def test_public_names_exist():
    assert "__version__" in fly_norm.__all__
    missing = [name for name in fly_norm.__all__ if not hasattr(fly_norm, name)]
    assert not missing, f"__all__ names missing from {MODULE}: {missing}"


def test_entry_point_resolves_to_this_family():
    ep = _entry_point()
    assert ep.value == f"{MODULE}._family:FAMILY"
    family = ep.load()
    assert isinstance(family, Family)
    assert (family.name, family.module, family.distribution) == (NAME, MODULE, DIST)
    assert family.version == fly_norm.__version__
    assert family.description


def test_entry_point_belongs_to_this_distribution():
    dist = metadata.distribution(DIST)
    names = {ep.name for ep in dist.entry_points if ep.group == GROUP}
    assert names == {NAME}


def test_cli_discovers_the_family():
    family = discover()[NAME]
    assert family.distribution == DIST


@pytest.mark.parametrize("sibling", ["flydsl-runtime", "flydsl-common"])
def test_sibling_dependencies_are_ranges(sibling):
    # Siblings are released on their own: a range keeps fixes flowing, a pin would freeze them.
    reqs = [Requirement(r) for r in metadata.requires(DIST) or []]
    (req,) = [r for r in reqs if r.name == sibling]
    ops = {spec.operator for spec in req.specifier}
    assert ops == {">=", "<"}, f"{sibling} must be a >=,< range, got {req}"
    assert metadata.version(sibling) in req.specifier
