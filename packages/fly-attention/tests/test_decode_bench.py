"""The serving benches on the CPU: each builds with its providers and tuned set, the bytes models match hand
counts, the quick cases pass their checks through the harness (and a wrong provider fails them), the seeded
sweeps are reproducible and stay in range."""

from __future__ import annotations

import dataclasses
import random

import pytest

from fly_attention import decode_bench as db
from flydsl_common.bench import Case, Provider, run

_NAMES = ["attn_decode_bf16", "attn_decode_fp8", "rope_cache"]


def _spec(name):
    return next(b for b in db.benches(db.CPU_RANGE) if b.name == name)


def test_benches_and_tuned_sets():
    specs = db.benches(db.GPU_RANGE)
    assert [b.name for b in specs] == _NAMES
    cases = specs[0].cases
    assert all(c.params["B"] * c.params["S"] <= 1 << 21 for c in cases)
    assert {c.params["B"] for c in cases} == {1, 4, 16, 64, 256}
    assert {c.params["S"] for c in cases} == {512, 2048, 8192, 32768, 131072}
    assert all((c.params["Hq"], c.params["Hkv"], c.params["D"]) == (32, 8, 128) for c in cases)


def test_bytes_models():
    c = Case("x", {"B": 2, "S": 100, "Hq": 32, "Hkv": 8, "D": 128})
    kv = 2 * 100 * 8 * 128
    assert db.decode_bytes(c) == 2 * kv * 2 + 2 * 2 * 32 * 128 * 2
    assert db.decode_bytes(c, 1) == 2 * kv + 2 * 2 * 32 * 128 * 2
    r = Case("r", {"T": 3, "Hq": 32, "Hkv": 8, "D": 128, "rot": 64})
    # q, k, v read + q, k, v written (2 bytes), cos / sin fp32, positions + slots int64
    assert db.rope_bytes(r) == 3 * ((32 + 8 + 8) * 128 * 2 * 2 + 64 * 4 + 16)


@pytest.mark.parametrize("name", _NAMES)
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_quick_cases_pass_their_checks(name):
    spec = _spec(name)
    res = run(spec, quick=True, ceilings={}, device="cpu", timer_kwargs={"windows": 1, "target_window_ms": 1.0})
    rows = res.rows()
    ours = [r for r in rows if r.provider == "flydsl"]
    assert ours and all(r.status == "ok" for r in ours), [(r.case, r.status, r.error) for r in ours]
    assert all(r.status in ("ok", "skipped") for r in rows), [(r.provider, r.status, r.error) for r in rows]


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_a_wrong_provider_fails_the_check():
    spec = _spec("attn_decode_bf16")
    wrong = Provider("wrong", lambda t: lambda: db.paged_attention_decode(*t[:5]) * 1.1, is_ours=True)
    one = dataclasses.replace(spec, providers=[wrong], quick_cases=spec.quick_cases[:1])
    res = run(one, quick=True, ceilings={}, device="cpu", timer_kwargs={"windows": 1, "target_window_ms": 1.0})
    assert [r.status for r in res.rows()] == ["failed"]


@pytest.mark.parametrize("sweep", [db.decode_sweep, db.rope_sweep])
def test_sweeps_reproducible_and_in_range(sweep):
    a = sweep(random.Random(7), 60)
    b = sweep(random.Random(7), 60)
    assert [c.name for c in a] == [c.name for c in b] and len({c.name for c in a}) == 60
    if sweep is db.decode_sweep:
        assert all(1 <= c.params["B"] <= 256 and c.params["B"] * c.params["S"] <= 1 << 21 for c in a)
        assert any(c.params["S"] % 2 for c in a) and {c.params["page"] for c in a} == {16, 32, 64, 128}
    else:
        assert all(1 <= c.params["T"] <= 16384 for c in a) and any(not c.params["neox"] for c in a)
