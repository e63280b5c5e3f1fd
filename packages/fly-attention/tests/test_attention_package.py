"""Packaging contract of fly-attention: one version source, the ``flydsl.families`` registration,
sibling dependencies as ranges (checked by flydsl.testing.package)."""

from __future__ import annotations

import fly_attention
from flydsl.testing.package import check_family_package


def test_package_contract():
    check_family_package(fly_attention, distribution="fly-attention", name="attention")


def test_demo_cases_pass_and_the_bench_is_registered():
    """``flydsl demo attention`` runs both cases within tolerance; ``flydsl bench attention`` is wired."""
    from fly_attention._family import FAMILY
    from flydsl.cli import run_demo

    results = run_demo([FAMILY], time_it=False)
    assert [r.name for r in results] == ["flash_attn causal GQA", "flash_attn_varlen causal"]
    for r in results:
        assert r.rel_error <= r.tolerance, r
    assert FAMILY.bench is not None


def test_public_api():
    assert set(fly_attention.__all__) == {
        "__version__", "flash_attn", "flash_attn_varlen", "AttnConfig", "flash_attn_ref", "flash_attn_varlen_ref",
        "scaled_dot_product_attention", "build_flash_attn_func_module", "paged_attention_decode", "fused_rope_cache",
        "DecodeConfig", "paged_attention_decode_ref", "fused_rope_cache_ref", "flash_attn_fp8_ref",
    }  # fmt: skip
    for name in fly_attention.__all__:
        assert getattr(fly_attention, name) is not None
