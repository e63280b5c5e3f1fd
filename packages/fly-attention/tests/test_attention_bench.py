"""fly-attention's benchmarks on the CPU: each bench builds with its providers and tuned set, the flops models
match hand counts, the references (the chunked fp32 backward, varlen, fp8 on dequantized inputs) are right and
the checks built on them fail wrong providers, the seeded sweeps are reproducible and cover what they promise,
SDPA's causal peers skip what they would answer differently, and ``main_for`` runs every bench's quick cases
plus a tiny sweep end to end."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from fly_attention import bench as ab
from fly_attention.bench import (
    CPU_SWEEP,
    GPU_SWEEP,
    SWEEP_HEAD_DIMS,
    attn_grads_ref,
    benches,
    bwd_flops,
    flops,
    mixed_lengths,
    quantize_fp8,
    sweep_shapes,
    varlen_flops,
    varlen_sweep_shapes,
)
from fly_attention.reference import flash_attn_ref
from flydsl.testing import rel_error
from flydsl_common.bench import Case, Provider, Skip, run, sweep_cases, sweep_counts

_NAMES = ["attn_fwd_bf16", "attn_bwd_bf16", "attn_varlen_bf16", "attn_fwd_fp8"]  # the prefill benches, here
_DECODE_NAMES = ["attn_decode_bf16", "attn_decode_fp8", "rope_cache"]  # test_decode_bench.py's
_SEQLENS = (1024, 2048, 4096, 8192, 16384)


def _spec(name, r=GPU_SWEEP):
    return next(b for b in benches(r) if b.name == name)


def _run_quick_case(spec, providers, case_index=0):
    """The harness on one quick case of ``spec`` with ``providers``: its rows by provider name."""
    case = spec.quick_cases[case_index]
    one = dataclasses.replace(spec, providers=providers, quick_cases=[case])
    res = run(one, quick=True, ceilings={}, device="cpu", timer_kwargs={"windows": 1, "target_window_ms": 1.0})
    return {r.provider: r for r in res.rows()}


# ------------------------------------------------------------------ specs


def test_benches_build_with_their_providers_and_tuned_sets():
    specs = benches()
    assert [b.name for b in specs] == _NAMES + _DECODE_NAMES
    specs = specs[: len(_NAMES)]
    fwd, bwd, varlen, fp8 = specs
    assert all(b.sweep is not None and b.x_param == "seqlen" and b.quick_cases for b in specs)
    assert fwd.timings == ("gpu", "call") and bwd.timings == ("gpu", "call", "step")
    assert varlen.timings == ("gpu", "call") and fp8.timings == ("gpu", "call")
    sdpa = ["sdpa.cudnn", "sdpa.flash", "sdpa.efficient"]
    assert [p.name for p in fwd.providers] == ["flydsl", *sdpa]
    assert [p.name for p in bwd.providers] == ["flydsl", *sdpa] and all(p.step is not None for p in bwd.providers)
    assert [p.name for p in varlen.providers] == ["flydsl", "flydsl.dense"]
    assert [p.name for p in fp8.providers] == ["flydsl", "flydsl.bf16", "sdpa.cudnn"]
    for b in specs:
        assert [p.is_ours for p in b.providers] == [True] + [False] * (len(b.providers) - 1)

    got = {(c.params["D"], c.params["causal"], c.params["Sq"]) for c in fwd.cases}
    assert got == {(d, c, s) for d in (64, 128, 256) for c in (False, True) for s in _SEQLENS}
    got = {(c.params["D"], c.params["causal"], c.params["Sq"]) for c in bwd.cases}
    assert got == {(128, c, s) for c in (False, True) for s in _SEQLENS} | {
        (d, c, 4096) for d in (64, 256) for c in (False, True)
    }
    got = {(c.params["D"], c.params["causal"], c.params["Sq"]) for c in fp8.cases}
    assert got == {(128, c, s) for c in (False, True) for s in _SEQLENS}
    for c in fwd.cases + bwd.cases + fp8.cases:  # the fixed token budget and hidden width
        p = c.params
        assert p["B"] * p["Sq"] == 1 << 14 and p["Hq"] * p["D"] == 2048 and p["Sq"] == p["Sk"]

    equal = [c.params for c in varlen.cases if c.params["lengths"] == "equal"]
    mixed = [c.params for c in varlen.cases if c.params["lengths"] == "mixed"]
    assert {(p["causal"], p["seqlen"]) for p in equal} == {(c, s) for c in (False, True) for s in _SEQLENS}
    assert sorted((p["causal"], p["seqlen"]) for p in mixed) == sorted(
        (c, m) for c in (False, True) for m in (1024, 4096)
    )
    for p in equal + mixed:
        assert sum(p["lens"]) == p["tokens"] == 1 << 14 and p["D"] == 128 and p["Hq"] == p["Hkv"] == 16
    for p in equal:
        assert len(set(p["lens"])) == 1
    for p in mixed:  # the fixed seed's packs: an empty and a length-1 sequence among them, the same with causal
        assert 0 in p["lens"] and 1 in p["lens"] and len(set(p["lens"])) > 3
        twin = next(q for q in mixed if q["seqlen"] == p["seqlen"] and q["causal"] != p["causal"])
        assert twin["lens"] == p["lens"]


# ------------------------------------------------------------------ flops models


def test_flops_models_match_hand_counts():
    c = Case("x", {"B": 2, "Sq": 10, "Sk": 30, "Hq": 4, "Hkv": 1, "D": 64, "causal": False})
    assert flops(c) == 4 * 2 * 4 * 10 * 30 * 64 == 614400
    causal = Case("y", {**c.params, "causal": True})
    assert flops(causal) == 307200
    # the backward: five matmuls of 2 B H Sq Sk D flops each (the forward has two)
    assert bwd_flops(c) == 5 * 2 * 2 * 4 * 10 * 30 * 64 == 1536000
    assert bwd_flops(causal) == 768000


def test_varlen_flops_sum_over_the_sequences():
    lens = (3, 0, 1, 5)  # 4 H s^2 D a sequence: 9 + 0 + 1 + 25 = 35 squares
    c = ab._varlen_case(lens, 2, 1, 16, False, 2)
    assert varlen_flops(c) == 4 * 2 * 16 * 35 == 4480
    assert varlen_flops(ab._varlen_case(lens, 2, 1, 16, True, 2)) == 2240
    equal = ab._varlen_case((8, 8), 4, 4, 32, False)  # the dense bench's model on the same tokens
    dense = Case("d", {"B": 2, "Sq": 8, "Sk": 8, "Hq": 4, "Hkv": 4, "D": 32, "causal": False})
    assert varlen_flops(equal) == flops(dense) == 65536


# ------------------------------------------------------------------ sweeps


def _drawn(seed, names=None, count=60, r=GPU_SWEEP):
    specs = [b for b in benches(r) if b.name in _NAMES]
    counts = sweep_counts(specs, count)
    return [c for b in specs if names is None or b.name in names for c in sweep_cases(b, seed, counts[b.name])]


def test_sweep_is_reproducible_from_its_seed():
    first, again, other = _drawn(11), _drawn(11), _drawn(12)
    assert first == again and first != other
    assert len(first) >= 60
    for name in _NAMES:  # each bench draws its own shapes, distinct within the bench
        mine = _drawn(11, {name})
        assert len({c.name for c in mine}) == len(mine) >= 15
    # the backward draws from the forward's generator, seeded by its own name: other shapes
    assert _drawn(11, {"attn_fwd_bf16"}) != _drawn(11, {"attn_bwd_bf16"})


@pytest.mark.parametrize("seed", [0, 1, 2024])
def test_sweep_covers_the_promised_shapes(seed):
    cases = _drawn(seed, {"attn_fwd_bf16", "attn_bwd_bf16", "attn_fwd_fp8"}, count=240)
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


# (an id "gpu" would mark the test gpu-only)
@pytest.mark.parametrize("r", [GPU_SWEEP, CPU_SWEEP], ids=["full_range", "interpreter_range"])
def test_varlen_sweep_covers_equal_and_mixed_packs(r):
    cases = varlen_sweep_shapes(random.Random(7), 80, r)
    assert cases == varlen_sweep_shapes(random.Random(7), 80, r)
    ps = [c.params for c in cases]
    equal = [p for p in ps if p["lengths"] == "equal"]
    mixed = [p for p in ps if p["lengths"] == "mixed"]
    assert len(equal) >= 20 and len(mixed) >= 20
    assert any(0 in p["lens"] and 1 in p["lens"] for p in mixed), "no pack with an empty and a length-1 sequence"
    assert any(0 not in p["lens"] for p in mixed)
    assert any(p["lens"][0] % 2 for p in equal), "no odd length"
    assert {p["D"] for p in ps} <= set(SWEEP_HEAD_DIMS) and len({p["D"] for p in ps}) >= 4
    assert any(p["Hkv"] == 1 and p["Hq"] > 1 for p in ps) and any(p["causal"] for p in ps)
    for p in ps:
        assert p["Hq"] % p["Hkv"] == 0 and sum(p["lens"]) == p["tokens"]
        assert max(p["lens"]) <= max(r.seq_max, r.tokens) and min(p["lens"]) >= 0
    for p in equal:
        assert len(set(p["lens"])) == 1 and p["tokens"] <= max(r.tokens, p["lens"][0])
    for p in mixed:
        assert p["tokens"] == max(3, r.tokens)


def test_mixed_lengths():
    lens = mixed_lengths(random.Random(3), 4096, 256)
    assert lens == mixed_lengths(random.Random(3), 4096, 256) != mixed_lengths(random.Random(4), 4096, 256)
    assert sum(lens) == 4096 and lens.count(0) == 1 and 1 in lens and len(lens) == 16 + 2
    assert all(s >= 1 for s in lens if s != 0) and len(set(lens)) > 8
    plain = mixed_lengths(random.Random(3), 100, 10, extremes=False)
    assert sum(plain) == 100 and 0 not in plain and len(plain) == 10
    assert sum(mixed_lengths(random.Random(0), 3, 100)) == 3
    with pytest.raises(ValueError, match="total"):
        mixed_lengths(random.Random(0), 2, 1)


# ------------------------------------------------------------------ backward


@pytest.mark.parametrize(
    "b, sq, sk, hq, hkv, causal",
    [(2, 17, 17, 4, 4, False), (2, 9, 23, 6, 2, True), (1, 23, 9, 4, 1, True), (1, 33, 33, 2, 2, True)],
)
@pytest.mark.parametrize("max_scores", [None, 7, 100])
def test_chunked_backward_reference_matches_autograd(b, sq, sk, hq, hkv, causal, max_scores):
    """fp32, in blocks of heads and query rows of at most ``max_scores`` scores, against fp64 autograd through
    the plain reference (GQA summed over the group, bottom-right causal, rows that see no key)."""
    g = torch.Generator().manual_seed(sq * 100 + sk)
    q, do = (torch.randn(b, sq, hq, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, sk, hkv, 8, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(flash_attn_ref(*leaves, causal=causal, dtype=torch.float64), leaves, do)
    got = attn_grads_ref(q, k, v, do, causal, max_scores=max_scores)
    for name, x, ref in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert x.dtype == torch.float32 and x.shape == ref.shape
        assert rel_error(x, ref) < 1e-5, name


def test_backward_check_fails_a_wrong_gradient():
    """The harness's check of attn_bwd_bf16 fails a provider whose dq is zero (or whose dv is scaled), while the
    reference's own gradients in bf16 pass: each gradient weighs the same."""
    spec = _spec("attn_bwd_bf16")
    truth: dict = {}

    def exact(t):
        q, k, v, dout, causal = t
        grads = tuple(g.to(torch.bfloat16) for g in attn_grads_ref(q, k, v, dout, causal))
        truth["grads"] = grads
        return lambda: grads

    def wrong(which, f):
        def make(t):
            exact(t)
            grads = list(truth["grads"])
            grads[which] = f(grads[which])
            return lambda: tuple(grads)

        return make

    providers = [
        Provider("exact", exact, is_ours=True),
        Provider("zero_dq", wrong(0, torch.zeros_like)),
        Provider("zero_dk", wrong(1, torch.zeros_like)),
        Provider("dv_x1.1", wrong(2, lambda g: g * 1.1)),
    ]
    rows = _run_quick_case(spec, providers, case_index=1)  # GQA, causal
    assert rows["exact"].status == "ok" and rows["exact"].rel_error < 1e-2
    for name in ("zero_dq", "zero_dk", "dv_x1.1"):
        assert rows[name].status == "failed", (name, rows[name].rel_error)
    assert rows["zero_dq"].rel_error > 0.5  # one gradient all wrong: 1 / sqrt(3)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_backward_providers_give_the_gradients_and_a_fresh_step():
    spec = _spec("attn_bwd_bf16")
    t = spec.setup(spec.quick_cases[1], "cpu")
    ref = attn_grads_ref(*t)
    grads = ab._ours_bwd(t)()
    again = ab._ours_bwd(t)()  # the graph kept: the backward repeats
    for g, r, a in zip(grads, ref, again, strict=True):
        assert g.dtype == torch.bfloat16 and rel_error(g, r) < 1e-2 and torch.equal(g, a)
    ab._ours_step(t)()  # new leaves each step: the inputs never collect a gradient
    assert all(x.grad is None and not x.requires_grad for x in t[:4])


def test_sdpa_causal_peers_skip_off_square_cases():
    q = torch.zeros(1, 5, 2, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 9, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(Skip, match="top-left"):
        ab._sdpa("FLASH_ATTENTION")((q, k, k, True))
    with pytest.raises(Skip, match="top-left"):
        ab._sdpa_bwd("FLASH_ATTENTION")((q, k, k, q, True))
    with pytest.raises(Skip, match="top-left"):
        ab._sdpa_step("FLASH_ATTENTION")((q, k, k, q, True))


# ------------------------------------------------------------------ varlen


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_varlen_check_fails_zeros_and_the_dense_peer_reads_the_same_tokens():
    spec = _spec("attn_varlen_bf16")
    case = spec.quick_cases[0]
    t = spec.setup(case, "cpu")
    ours, dense = ab._ours_varlen(t)(), ab._dense_of_varlen(t)()
    ref = spec.reference(t)
    assert dense.shape == (2, 32, 2, 64) and rel_error(dense.flatten(0, 1), ref) < 1e-2
    assert rel_error(ours, ref) < 1e-2
    with pytest.raises(Skip, match="mixed"):
        ab._dense_of_varlen(spec.setup(spec.quick_cases[1], "cpu"))
    zeros = Provider("zeros", lambda t: lambda: torch.zeros_like(t[0]), is_ours=True)
    rows = _run_quick_case(spec, [zeros], case_index=1)
    assert rows["zeros"].status == "failed"


# ------------------------------------------------------------------ fp8


def test_quantize_fp8():
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(0)) * 3
    x8, descale = quantize_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn and descale.dtype == torch.float32 and descale.shape == (1,)
    assert x8.float().abs().max() == 448  # the largest element lands on e4m3's largest value
    assert rel_error(x8.float() * descale, x) < 2.0**-4


def test_fp8_inputs_have_distinct_descales_and_bf16_twins():
    spec = _spec("attn_fwd_fp8")
    q8, k8, v8, qs, ks, vs, qb, kb, vb, causal = spec.setup(spec.quick_cases[1], "cpu")
    assert causal and {x.dtype for x in (q8, k8, v8)} == {torch.float8_e4m3fn}
    assert len({float(s) for s in (qs, ks, vs)}) == 3
    for x8, s, xb in ((q8, qs, qb), (k8, ks, kb), (v8, vs, vb)):
        assert xb.dtype == torch.bfloat16 and rel_error(xb, x8.float() * s) < 4e-3


def _fake_fp8_flash_attn(lose_v_descale=False):
    """flash_attn with the fp8 API's keywords, answering from the fp32 reference on the dequantized inputs."""

    def flash_attn(q, k, v, *, causal=False, q_descale=None, k_descale=None, v_descale=None):
        vd = v.float() * (1.0 if lose_v_descale else v_descale)
        return flash_attn_ref(q.float() * q_descale, k.float() * k_descale, vd, causal=causal).to(torch.bfloat16)

    return flash_attn


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_fp8_provider_runs_the_real_api():
    """The fp8 provider calls flash_attn with the descales and matches the dequantized reference."""
    spec = _spec("attn_fwd_fp8")
    t = spec.setup(spec.quick_cases[0], "cpu")
    out = ab._ours_fp8(t)()
    assert out.dtype == torch.bfloat16
    assert rel_error(out, spec.reference(t)) <= spec.tolerance  # 2^-4: P rounded to e4m3 (bench.py)


@pytest.mark.parametrize("lose_v_descale", [False, True])
def test_fp8_check_takes_the_dequantized_reference(monkeypatch, lose_v_descale):
    spec = _spec("attn_fwd_fp8")
    monkeypatch.setattr(ab, "flash_attn", _fake_fp8_flash_attn(lose_v_descale))
    rows = _run_quick_case(spec, [spec.providers[0]], case_index=1)
    assert rows["flydsl"].status == ("failed" if lose_v_descale else "ok"), rows["flydsl"].reason


# ------------------------------------------------------------------ end to end


# Providers that run on the CPU (SDPA's cuDNN and efficient backends refuse it; its flash one runs there).
_CPU_PROVIDERS = "flydsl,flydsl.dense,flydsl.bf16,sdpa.flash"


def _rows_ok(bench_result):
    """Every row ran and passed its check, except what cannot run: the fp8 provider before the fp8 API, the
    dense peer on mixed lengths."""
    name = bench_result["name"]
    for r in bench_result["rows"]:
        if r["provider"] == "flydsl.dense" and r["params"]["lengths"] == "mixed":
            assert r["status"] == "skipped" and "mixed" in r["reason"]
            continue
        assert r["status"] == "ok", (name, r)
        assert r["rel_error"] <= r["tolerance"] and r["gpu_us"] > 0 and r["call_us"] > 0
        assert (r["step_us"] or 0) > 0 if name == "attn_bwd_bf16" else r["step_us"] is None


@pytest.mark.parametrize("name", _NAMES)
def test_quick_run_through_main_for(name, tmp_path):
    argv = f"--quick --no-ceilings --only {name} --providers {_CPU_PROVIDERS} --stem smoke --out {tmp_path}"
    assert ab.main_for(benches(CPU_SWEEP), argv.split(), tmp_path) == 0
    (result,) = json.loads((tmp_path / "smoke.json").read_text())["benches"]
    assert result["name"] == name and len({r["case"] for r in result["rows"]}) == 2
    _rows_ok(result)


def test_tiny_sweep_through_main_for(tmp_path, capsys):
    argv = f"--quick --no-ceilings --only attn_fwd_bf16 --providers {_CPU_PROVIDERS} --sweep-only --seed 5"
    argv += f" --sweep-count 1 --stem smoke --out {tmp_path}"
    assert ab.main_for(benches(CPU_SWEEP), argv.split(), tmp_path) == 0
    assert "seed 5" in capsys.readouterr().out
    swept = json.loads((tmp_path / "smoke-sweep.json").read_text())
    assert swept["sweep"]["seed"] == 5 and len({r["case"] for r in swept["benches"][0]["rows"]}) == 1
    _rows_ok(swept["benches"][0])


@pytest.mark.parametrize("name", _NAMES[1:])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_sweep_cases_pass_their_checks_on_the_cpu(name):
    """One CPU_SWEEP shape of each bench (the forward's sweep runs through main_for above): every provider that
    serves it matches the reference (checked as the harness checks, without timing it)."""
    spec = _spec(name, CPU_SWEEP)
    (case,) = sweep_cases(spec, 5, 1)
    t = spec.setup(case, "cpu")
    ref = spec.reference(t)
    served = 0
    for p in spec.providers:
        try:
            fn = p.make(t)
        except Skip:
            continue
        extract = p.output or spec.output or (lambda x: x)
        assert rel_error(extract(fn()), ref) <= spec.tolerance, (case.name, p.name)
        served += 1
    assert served >= 1 + (name == "attn_fwd_fp8")  # ours, and the fp8 bench's bf16 peer
