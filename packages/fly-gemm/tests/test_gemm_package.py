"""Packaging contract of fly-gemm: one version source, the ``flydsl.families`` registration,
sibling dependencies as ranges (checked by flydsl.testing.package)."""

from __future__ import annotations

import fly_gemm
from flydsl.testing.package import check_family_package


def test_package_contract():
    check_family_package(fly_gemm, distribution="fly-gemm", name="gemm")
