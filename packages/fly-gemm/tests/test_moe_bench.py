"""The MoE benches on the CPU: they build with their peers and models, the routing of a case is the
references' (so every provider and the bytes model see one set of ids), the sweep repeats from its seed,
the plain torch peer computes the layer, and a quick run through the harness checks and times the tiny
case (torch._grouped_mm skipped off CUDA with its reason)."""

from __future__ import annotations

import random

import pytest
import torch
from test_moe_quant import E8M0, quantize_mxfp4

from fly_gemm import moe_bench as mb
from fly_gemm.moe_reference import fused_moe_ref
from flydsl.testing import assert_rel_close
from flydsl_common.bench import run


def _by_name():
    return {b.name: b for b in mb.benches()}


def test_benches_build_with_models_and_peers():
    specs = _by_name()
    assert set(specs) == {"moe_bf16", "moe_bf16_decode", "moe_fp8", "moe_mxfp4_decode", "moe_w4a8", "grouped_gemm"}
    for b in (specs["moe_bf16"], specs["moe_bf16_decode"]):
        assert [p.name for p in b.providers] == ["flydsl", "torch", "torch._grouped_mm", "dense"]
        assert [p.is_ours for p in b.providers] == [True, False, False, False]
        assert {c.params["model"] for c in b.cases} == set(mb.MODELS)
    assert max(c.params["tokens"] for c in specs["moe_bf16_decode"].cases) <= 64
    assert min(c.params["tokens"] for c in specs["moe_bf16"].cases) >= 1024
    assert specs["moe_bf16_decode"].bytes is not None and specs["moe_bf16"].bytes is None


def test_routing_and_bytes_of_a_case():
    case = next(c for c in _by_name()["moe_bf16_decode"].cases if c.params["model"] == "deepseek-v3")
    w, ids = mb.routing(case)
    assert ids.shape == (case.params["tokens"], 8) and w.dtype == torch.float32
    assert torch.equal(ids, mb.routing(case)[1])
    touched = torch.unique(ids).numel()
    e, k, h, inter = 256, 8, 7168, 2048
    assert 1 <= touched <= min(e, ids.numel()) and k == ids.shape[1]
    assert _by_name()["moe_bf16_decode"].bytes(case) == 2 * (touched * 3 * h * inter + 2 * ids.shape[0] * h)


def test_sweep_repeats_from_its_seed():
    for b in (b for b in mb.benches() if b.sweep is not None):
        first = b.sweep(random.Random(3), 12)
        assert first == b.sweep(random.Random(3), 12)
        assert first != b.sweep(random.Random(4), 12)
        assert len({c.name for c in first}) == 12
        assert any(c.params["tokens"] % 2 for c in first)


def test_torch_peer_computes_the_layer():
    spec = _by_name()["moe_bf16"]
    case = spec.quick_cases[0]
    t = spec.setup(case, torch.device("cpu"))
    ref = fused_moe_ref(*t)
    assert_rel_close(mb._torch_loop(t)(), ref, tol=1e-2)


def _assert_grouped_mm_peer(row):
    """torch._grouped_mm runs on CUDA only: checked and timed on a GPU, skipped with its reason elsewhere."""
    if torch.cuda.is_available():
        assert row.status == "ok" and row.gpu_us > 0 and row.rel_error < 1e-2, row
    else:
        assert row.status != "ok" and "CUDA" in row.reason, row


def test_quick_run_checks_and_times_the_tiny_case():
    results = run(mb.benches()[:2], quick=True, ceilings={})  # moe_fp8: its own test below
    rows = results.rows()
    by = {(r.case.split("/")[0], r.provider): r for r in rows}
    for name in ("flydsl", "torch", "dense"):
        r = by[(mb.QUICK_MODEL[0], name)]
        assert r.status == "ok", r
        assert r.gpu_us > 0 and r.call_us > 0
    assert by[(mb.QUICK_MODEL[0], "flydsl")].rel_error < 1e-2
    _assert_grouped_mm_peer(by[(mb.QUICK_MODEL[0], "torch._grouped_mm")])


def test_fp8_bench_checks_and_times_the_tiny_case():
    """moe_fp8: block-scaled fp8 against our bf16 layer, both checked against the
    unquantized fp32 layer within the fp8 bound, on the interpreter's tiny case (blocks off the 128 grid)."""
    spec = mb.fp8_bench()
    assert "moe_fp8" in _by_name()
    assert [p.name for p in spec.providers] == ["flydsl", "flydsl.bf16"]
    assert min(c.params["tokens"] for c in spec.cases) >= 1024
    rows = run([spec], quick=True, ceilings={}).rows()
    by = {r.provider: r for r in rows}
    for name in ("flydsl", "flydsl.bf16"):
        assert by[name].status == "ok", by[name]
        assert by[name].gpu_us > 0
    assert by["flydsl"].rel_error < 0.15 and by["flydsl.bf16"].rel_error < 1e-2


@pytest.mark.skipif(E8M0 is None, reason="this torch has no float8_e8m0fnu")
def test_mxfp4_quantizer_matches_the_tests_one():
    """The bench's MXFP4 quantizer (an expert at a time, codes by midpoints) gives the codes and scales of
    test_moe_quant's (codes by the nearest grid value, ties to the lower magnitude)."""
    w = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0)) * 0.1
    w[0, 0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # ties and the top code
    q, s = mb._quantize_mxfp4(w)
    q_ref, s_ref = quantize_mxfp4(w, 32)
    assert torch.equal(q, q_ref) and torch.equal(s.view(torch.uint8), s_ref.view(torch.uint8))


@pytest.mark.skipif(E8M0 is None, reason="this torch has no float8_e8m0fnu")
@pytest.mark.parametrize("name,peers", [("moe_mxfp4_decode", ["flydsl.bf16"]),
                                        ("moe_w4a8", ["flydsl.mxfp4", "flydsl.bf16"])])  # fmt: skip
def test_mxfp4_benches_check_and_time_the_tiny_case(name, peers):
    """moe_mxfp4_decode (weight-only, decode tokens, the MXFP4 bytes) and moe_w4a8 (fp8 activations, prefill
    tokens): our MXFP4 layer and its peers, checked against the unquantized fp32 layer within the MXFP4
    bound, on the interpreter's tiny case."""
    spec = _by_name()[name]
    assert [p.name for p in spec.providers] == ["flydsl", *peers]
    decode = name.endswith("decode")
    assert (max if decode else min)(c.params["tokens"] for c in spec.cases) == (64 if decode else 1024)
    assert (spec.bytes is not None) == decode
    rows = run([spec], quick=True, ceilings={}).rows()
    by = {r.provider: r for r in rows}
    for p in ("flydsl", *peers):
        assert by[p].status == "ok", by[p]
        assert by[p].gpu_us > 0
    assert by["flydsl"].rel_error < 0.45 and by["flydsl.bf16"].rel_error < 1e-2


def test_grouped_gemm_bench_times_forward_and_step():
    """grouped_gemm: the models' routed rows grouped by expert (both projections, training token counts),
    forward and forward + backward against torch._grouped_mm (skipped off CUDA with its reason); the groups
    are the routing's per-expert counts; the quick case checks and times ours, its step included."""
    spec = _by_name()["grouped_gemm"]
    assert [p.name for p in spec.providers] == ["flydsl", "torch._grouped_mm"]
    assert all(p.step is not None for p in spec.providers) and "step" in spec.timings
    assert {(c.params["model"], c.params["proj"]) for c in spec.cases} == {(m, p) for m in mb.MODELS
                                                                          for p in ("w1", "w2")}  # fmt: skip
    case = spec.quick_cases[0]
    a, b, offsets, dy = spec.setup(case, torch.device("cpu"))
    e, k, h, inter = mb.QUICK_MODEL[1][:4]
    assert a.shape == (case.params["tokens"] * k, h) and b.shape == (e, 2 * inter, h) and dy.shape == (a.shape[0],
                                                                                                     2 * inter)
    counts = torch.bincount(mb.routing(case)[1].reshape(-1).long(), minlength=e)
    assert torch.equal(offsets.long(), counts.cumsum(0)) and int(offsets[-1]) == a.shape[0]
    rows = run([spec], quick=True, ceilings={}).rows()
    by = {r.provider: r for r in rows}
    assert by["flydsl"].status == "ok" and by["flydsl"].gpu_us > 0 and by["flydsl"].rel_error < 1e-2
    assert by["flydsl"].step_us is not None and by["flydsl"].step_us > 0
    _assert_grouped_mm_peer(by["torch._grouped_mm"])
