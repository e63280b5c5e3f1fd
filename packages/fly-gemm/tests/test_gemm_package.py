"""Packaging contract of fly-gemm: one version source, the ``flydsl.families`` registration,
sibling dependencies as ranges (checked by flydsl.testing.package)."""

from __future__ import annotations

import fly_gemm
from flydsl.testing.package import check_family_package


def test_package_contract():
    check_family_package(fly_gemm, distribution="fly-gemm", name="gemm")


def test_benchmarks_run_their_quick_cases(tmp_path):
    """The benchmark plumbing end to end on the interpreter's smoke case: every bench checks its providers
    against the reference and writes its results."""
    from fly_gemm.bench import benches, main

    assert {b.name for b in benches()} == {"gemm_bf16", "gemm_bf16_decode", "gemm_fp8", "gemm_int8", "linear",
                                           "moe_bf16", "moe_bf16_decode", "moe_fp8", "moe_mxfp4_decode", "moe_w4a8",
                                           "grouped_gemm", "host"}  # fmt: skip
    assert main(["--quick", "--no-ceilings", "--out", str(tmp_path), "--stem", "smoke"]) == 0
    assert (tmp_path / "smoke.json").is_file() and (tmp_path / "smoke.md").is_file()
