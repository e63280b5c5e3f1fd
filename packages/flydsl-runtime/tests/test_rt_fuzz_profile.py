"""flydsl.testing.fuzz: a file's own CPU case count for slow interpreted tests, overridden as the shared one."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")

from flydsl.testing import fuzz as F  # noqa: E402


def test_cpu_examples_apply_only_to_the_cpu_profile_without_an_override(monkeypatch):
    monkeypatch.delenv("FLYDSL_FUZZ_EXAMPLES", raising=False)
    monkeypatch.setattr(F, "PROFILE", "cpu")
    assert F.examples() == F.MAX_EXAMPLES
    assert F.examples(3) == min(3, F.MAX_EXAMPLES)
    assert F.examples(10**6) == F.MAX_EXAMPLES  # never more than the shared count
    assert f"{min(3, F.MAX_EXAMPLES)} examples a test" in F.banner("x", 3)
    monkeypatch.setenv("FLYDSL_FUZZ_EXAMPLES", "7")
    assert F.examples(3) == F.MAX_EXAMPLES  # the override sets every count (MAX_EXAMPLES read it at import)
    monkeypatch.delenv("FLYDSL_FUZZ_EXAMPLES")
    monkeypatch.setattr(F, "PROFILE", "gpu")
    assert F.examples(3) == F.MAX_EXAMPLES


def test_the_decorator_takes_the_count_and_marks_the_gpu_profile(monkeypatch):
    from hypothesis import given
    from hypothesis import strategies as st

    monkeypatch.delenv("FLYDSL_FUZZ_EXAMPLES", raising=False)
    seen: list[int] = []
    for profile in ("cpu", "gpu"):
        monkeypatch.setattr(F, "PROFILE", profile)
        seen.clear()

        @F.fuzz(cpu_examples=2)
        @given(st.integers())
        def probe(i):
            seen.append(i)

        probe()
        assert len(seen) == (min(2, F.MAX_EXAMPLES) if profile == "cpu" else F.MAX_EXAMPLES)
        assert any(m.name == "gpu" for m in getattr(probe, "pytestmark", [])) == (profile == "gpu")
