"""Packaging contract of fly-conv: one version source, the ``flydsl.families`` registration,
sibling dependencies as ranges (checked by flydsl.testing.package)."""

from __future__ import annotations

import fly_conv
from flydsl.testing.package import check_family_package


def test_package_contract():
    check_family_package(fly_conv, distribution="fly-conv", name="conv")
