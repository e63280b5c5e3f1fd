"""Packaging contract of fly-attention: one version source, the ``flydsl.families`` registration,
sibling dependencies as ranges (checked by flydsl.testing.package)."""

from __future__ import annotations

import fly_attention
from flydsl.testing.package import check_family_package


def test_package_contract():
    check_family_package(fly_attention, distribution="fly-attention", name="attention")
