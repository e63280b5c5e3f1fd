"""Packaging contract of fly-norm: one version source, the ``flydsl.families`` registration,
sibling dependencies as ranges (checked by flydsl.testing.package)."""

from __future__ import annotations

import fly_norm
from flydsl.testing.package import check_family_package


def test_package_contract():
    check_family_package(fly_norm, distribution="fly-norm", name="norm")
