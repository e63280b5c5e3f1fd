"""fly-attention's benchmark on the CPU: the bench builds with its providers and tuned set, the flops model,
the seeded sweep is reproducible and covers what it promises, SDPA's causal peer skips what it would answer
differently, and ``main_for`` runs the quick cases plus a tiny sweep end to end."""

from __future__ import annotations

import json
import random

import pytest
import torch

from fly_attention import bench as ab
from fly_attention.bench import CPU_SWEEP, GPU_SWEEP, SWEEP_HEAD_DIMS, benches, flops, sweep_shapes
from flydsl_common.bench import Case, Skip, sweep_cases, sweep_counts


def test_bench_builds_with_its_providers_and_tuned_set():
    (spec,) = benches()
    assert spec.name == "attn_fwd_bf16" and spec.timings == ("gpu", "call") and spec.sweep is not None
    assert [p.name for p in spec.providers] == ["flydsl", "sdpa.cudnn", "sdpa.flash", "sdpa.efficient"]
    assert [p.is_ours for p in spec.providers] == [True, False, False, False]
    got = {(c.params["D"], c.params["causal"], c.params["Sq"]) for c in spec.cases}
    assert got == {(d, c, s) for d in (64, 128, 256) for c in (False, True) for s in (1024, 2048, 4096, 8192, 16384)}
    for c in spec.cases:  # the fixed token budget and hidden width
        p = c.params
        assert p["B"] * p["Sq"] == 1 << 14 and p["Hq"] * p["D"] == 2048 and p["Sq"] == p["Sk"]


def test_flops_model():
    c = Case("x", {"B": 2, "Sq": 10, "Sk": 30, "Hq": 4, "Hkv": 1, "D": 64, "causal": False})
    assert flops(c) == 4 * 2 * 4 * 10 * 30 * 64
    assert flops(Case("y", {**c.params, "causal": True})) == flops(c) // 2


def _drawn(seed, count=60, r=GPU_SWEEP):
    specs = benches(r)
    counts = sweep_counts(specs, count)
    return [c for b in specs for c in sweep_cases(b, seed, counts[b.name])]


def test_sweep_is_reproducible_from_its_seed():
    first, again, other = _drawn(11), _drawn(11), _drawn(12)
    assert first == again and first != other
    assert len(first) >= 60 and len({c.name for c in first}) == len(first)


@pytest.mark.parametrize("seed", [0, 1, 2024])
def test_sweep_covers_the_promised_shapes(seed):
    cases = _drawn(seed)
    ps = [c.params for c in cases]
    assert {p["D"] for p in ps} <= set(SWEEP_HEAD_DIMS) and len({p["D"] for p in ps}) >= 4
    assert any(p["Sq"] % 2 for p in ps), "no odd seqlen"
    assert any(p["Hkv"] == 1 and p["Hq"] > 1 for p in ps), "no MQA"
    assert any(1 < p["Hq"] // p["Hkv"] < p["Hq"] for p in ps), "no GQA"
    assert any(p["causal"] for p in ps) and not all(p["causal"] for p in ps)
    assert any(p["Sq"] != p["Sk"] for p in ps), "no seqlen_q != seqlen_k"
    for p in ps:
        assert GPU_SWEEP.seq_min <= min(p["Sq"], p["Sk"]) and max(p["Sq"], p["Sk"]) <= GPU_SWEEP.seq_max
        assert p["Hq"] % p["Hkv"] == 0
        assert not p["causal"] or p["Sq"] == p["Sk"]  # SDPA's top-left causal agrees with ours only square
        assert p["B"] == max(1, GPU_SWEEP.tokens // max(p["Sq"], p["Sk"]))
    with pytest.raises(ValueError, match="cannot draw"):
        sweep_shapes(random.Random(0), 1000, ab.SweepRange(seq_min=1, seq_max=2, tokens=2, heads=(2,)))


def test_sdpa_causal_peer_skips_off_square_cases():
    q = torch.zeros(1, 5, 2, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 9, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(Skip, match="top-left"):
        ab._sdpa("FLASH_ATTENTION")((q, k, k, True))


def test_quick_run_and_tiny_sweep_through_main_for(tmp_path, capsys):
    argv = "--quick --no-ceilings --providers flydsl --sweep --seed 5 --sweep-count 2 --stem smoke --out".split()
    rc = ab.main_for(benches(CPU_SWEEP), [*argv, str(tmp_path)], tmp_path)
    assert rc == 0
    assert "seed 5" in capsys.readouterr().out
    tuned = json.loads((tmp_path / "smoke.json").read_text())
    swept = json.loads((tmp_path / "smoke-sweep.json").read_text())
    for results, n_cases in ((tuned, 2), (swept, 2)):
        rows = [r for b in results["benches"] for r in b["rows"]]
        assert len({r["case"] for r in rows}) == n_cases
        assert rows and all(r["status"] == "ok" for r in rows), rows
        assert all(r["gpu_us"] > 0 and r["call_us"] > 0 for r in rows)
    assert swept["sweep"]["seed"] == 5
