"""Packaging contract of flydsl-common (checked by flydsl.testing.package)."""

from __future__ import annotations

import flydsl_common
from flydsl.testing.package import check_family_package


def test_package_contract():
    check_family_package(flydsl_common, distribution="flydsl-common", name="common", siblings=("flydsl-runtime",))
