"""The benchmarks' specs without timing: flops and bytes models against hand counts, every bench's quick case
set up and checked against the reference on the CPU, the sweep's determinism and coverage, the family's
registration of its bench and demo."""

from __future__ import annotations

import random

import pytest
import torch

from fly_conv import bench
from fly_conv._family import FAMILY
from flydsl.testing import rel_error

BENCHES = bench.benches(bench.CPU_SWEEP)


def test_flops_and_bytes_models():
    c = bench._case(32, 64, 128, (56, 56), 3, stride=2)  # out 28 x 28, K_gemm = 9 * 64
    assert bench.flops(c) == 2 * 32 * 28 * 28 * 128 * 9 * 64
    g = bench._case(8, 64, 64, (10, 10), 3, groups=32)  # K_gemm = 9 * 2
    assert bench.flops(g) == 2 * 8 * 100 * 64 * 18
    d = bench._case(2, 8, 8, (9, 9), 7, groups=8)
    assert bench.nbytes(d) == 2 * (2 * 8 * 81 + 8 * 49 + 8 + 2 * 8 * 81)
    v = bench._case(2, 4, 6, (3, 5, 5), 3)
    assert bench.flops(v) == 2 * 2 * 75 * 6 * 27 * 4


def test_bench_names_and_peers():
    names = [b.name for b in BENCHES]
    assert names == ["conv_bf16", "conv_nchw", "conv_1x1", "conv_depthwise", "conv_grouped", "conv_train", "conv_fp8"]
    for b in BENCHES:
        providers = {p.name for p in b.providers}
        assert "flydsl" in providers and "cudnn" in providers, b.name
    assert "cublas_gemm" in {p.name for p in BENCHES[2].providers}
    assert all(c.params["layout"] == "nc" for c in BENCHES[1].cases)
    assert "flydsl.bf16" in {p.name for p in BENCHES[6].providers}  # the fp8 bar: against our own bf16


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_fp8_bench_peers_convolve_the_same_values():
    """conv_fp8's bf16 peers read the dequantized fp8 values exactly (power-of-two scales), and each provider
    (ours in fp8, ours in bf16) matches the fp8 reference."""
    b = BENCHES[6]
    t = bench._setup_fp8(b.select_cases(quick=True)[0], torch.device("cpu"))
    x8, w8, _, xs, ws, xb, wb, _ = t
    assert x8.dtype == torch.float8_e4m3fn and ws.shape == (w8.shape[0],)
    assert torch.equal(xb.double(), x8.double() * xs.double())
    assert torch.equal(wb.double(), w8.double() * ws.double().view(-1, 1, 1, 1))
    for p in b.providers[:2]:
        assert rel_error(p.make(t)(), b.reference(t)) <= b.tolerance, p.name


@pytest.mark.parametrize("b", BENCHES, ids=lambda b: b.name)
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_quick_case_checks(b):
    case = b.select_cases(quick=True)[0]
    t = b.setup(case, torch.device("cpu"))
    ours = next(p for p in b.providers if p.is_ours)
    ref = b.reference(t)  # first: the gradient check's output divides by its norms
    out = ours.make(t)()
    out = (ours.output or b.output or (lambda v: v))(out)
    assert rel_error(out, ref) <= b.tolerance
    if ours.step is not None:
        ours.step(t)()  # one training step runs (gradients filled)


def test_sweeps_are_seeded_and_cover_the_range():
    for b in BENCHES:
        first = b.sweep(random.Random(7), 10)
        assert [c.name for c in first] == [c.name for c in b.sweep(random.Random(7), 10)]
        assert len({c.name for c in first}) == 10
    dense = BENCHES[0].sweep(random.Random(1), 40)
    assert {len(c.params["spatial"]) for c in dense} == {1, 2, 3}
    assert all(c.params["groups"] == c.params["C"] for c in BENCHES[3].sweep(random.Random(2), 10))
    assert all(c.params["ks"] == 1 for c in BENCHES[2].sweep(random.Random(3), 10))


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_family_registers_bench_and_demo():
    assert FAMILY.bench is not None
    (demo,) = FAMILY.demo_cases()
    run = demo.prepare(torch.device("cpu"))
    assert rel_error(run.ours(), run.reference()) <= run.tolerance
