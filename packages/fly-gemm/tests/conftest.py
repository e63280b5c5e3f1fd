"""Load FlyDSL's pytest plugin for this suite: the ``gpu`` marker, the ``device``
fixture, ``--require-gpu``, and ``import flydsl`` before any test module imports
Triton. Installing FlyDSL does not load it into other projects' test runs."""

import pytest

pytest_plugins = ["flydsl.testing.plugin"]


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty local tuning cache and no memoized configs of the family's three adopters (before and after)."""
    from fly_gemm.autotune import clear_memo
    from fly_gemm.grouped_gemm import clear_grouped_memo
    from fly_gemm.moe_config import clear_moe_memo

    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLYDSL_AUTOTUNE", raising=False)
    clears = (clear_memo, clear_moe_memo, clear_grouped_memo)
    for clear in clears:
        clear()
    yield tmp_path
    for clear in clears:
        clear()
