"""fly-gemm's benchmarks on the CPU: the benches build, the sweep of unseen shapes is reproducible from a seed and
covers what it promises (M = 1-16, K not a multiple of 16, the GPU's size range), peers refuse the shapes torch
refuses with the rule as the reason, linear's training step fills the gradients, and ``main_for`` runs a quick
case plus a tiny sweep end to end with gpu_us and call_us in its rows."""

from __future__ import annotations

import json
import random

import pytest
import torch

from fly_gemm import bench as gb
from fly_gemm.bench import CPU_SWEEP, GPU_SWEEP, SweepRange, benches, sweep_shapes
from flydsl_common.bench import Case, Skip, sweep_cases, sweep_counts


def _by_name(specs):
    return {b.name: b for b in specs}


def _family_sweep(seed: int, count: int = 60, sweep_range: SweepRange = GPU_SWEEP) -> dict[str, list[Case]]:
    specs = benches(sweep_range)
    counts = sweep_counts(specs, count)
    return {b.name: sweep_cases(b, seed, counts[b.name]) for b in specs if b.name in counts}


def test_benches_build_with_their_timings_and_providers():
    specs = _by_name(benches())
    assert set(specs) == {"gemm_bf16", "gemm_bf16_decode", "gemm_fp8", "gemm_int8", "linear", "moe_bf16",
                          "moe_bf16_decode", "moe_fp8", "moe_mxfp4_decode", "moe_w4a8", "grouped_gemm",
                          "host"}  # fmt: skip
    for name in ("gemm_bf16", "gemm_bf16_decode", "gemm_fp8", "gemm_int8"):
        assert specs[name].timings == ("gpu", "call")
        assert specs[name].sweep is not None
        peers = 2 if name == "gemm_fp8" else 1  # torch._scaled_mm with and without fast accumulation
        assert [p.is_ours for p in specs[name].providers] == [True] + [False] * peers
    linear = specs["linear"]
    assert linear.timings == ("gpu", "call", "step")
    assert {p.name for p in linear.providers} == {"flydsl", "torch", "torch.compile"}
    assert all(p.step is not None for p in linear.providers)
    assert all(c.params["bias"] and c.params["activation"] == "gelu" for c in linear.cases)
    host = specs["host"]
    assert host.timings == ("host",) and host.sweep is None
    assert {(c.params["op"], c.params["mode"]) for c in host.cases} == {
        (op, mode) for op in ("gemm", "linear", "FlyLinear") for mode in ("no_grad", "fwd_grad", "backward")
    }
    # the tuned set stays on the artifact's searched shapes
    from fly_gemm.autotune import TUNE_NK

    for name in ("gemm_bf16", "gemm_bf16_decode", "gemm_fp8", "gemm_int8", "linear"):
        assert {(c.params["N"], c.params["K"]) for c in specs[name].cases} == set(TUNE_NK)


def test_sweep_is_reproducible_from_its_seed():
    first, again, other = _family_sweep(11), _family_sweep(11), _family_sweep(12)
    assert first == again
    assert first != other
    assert sum(len(c) for c in first.values()) >= 60
    for name, cases in first.items():
        assert len({c.name for c in cases}) == len(cases), f"{name}: duplicate sweep shapes"


@pytest.mark.parametrize("seed", [0, 1, 2024])
def test_sweep_covers_the_promised_shapes(seed):
    drawn = _family_sweep(seed)
    shapes = [(c.params["M"], c.params["N"], c.params["K"]) for name, cases in drawn.items() for c in cases
              if not name.startswith("moe")]  # fmt: skip
    assert len(shapes) >= 40
    assert any(m <= 16 for m, _, _ in shapes), "no M in 1..16"
    assert any(m > 16 and m % 2 == 1 for m, _, _ in shapes), "no odd M past 16"
    assert any(k % 16 for _, _, k in shapes), "no K that is not a multiple of 16"
    assert any(k % 2 for _, _, k in shapes), "no odd K"
    assert any(n % 16 for _, n, _ in shapes), "no N that is not a multiple of 16"
    for m, n, k in shapes:
        assert 1 <= m <= GPU_SWEEP.m_max
        assert GPU_SWEEP.nk_min <= n <= GPU_SWEEP.nk_max and GPU_SWEEP.nk_min <= k <= GPU_SWEEP.nk_max
        assert 2 * m * n * k <= GPU_SWEEP.max_flops or m <= 17
    assert all(c.params["M"] <= 16 for c in drawn["gemm_bf16_decode"])
    assert all(c.params["M"] > 16 for c in drawn["gemm_bf16"])
    assert {c.params["activation"] for c in drawn["linear"]} - {None}, "linear's sweep draws no activation"


def test_sweep_shapes_stratify_the_k_classes():
    shapes = sweep_shapes(random.Random(3), 8)
    ks = [k for _, _, k in shapes]
    assert any(k % 128 == 0 for k in ks)
    assert any(k % 16 == 8 for k in ks)
    assert any(k % 2 == 1 for k in ks)
    assert sum(m <= 16 for m, _, _ in shapes) >= 2  # every third shape of a mixed sweep
    with pytest.raises(ValueError, match="m_kind"):
        sweep_shapes(random.Random(0), 1, m_kind="tiny")


def test_peers_skip_the_shapes_torch_refuses_with_the_rule():
    def int8(m, n, k):
        return torch.zeros(m, k, dtype=torch.int8), torch.zeros(n, k, dtype=torch.int8)

    def fp8(m, n, k):
        f8 = torch.float8_e4m3fn
        return torch.zeros(m, k, dtype=f8), torch.zeros(n, k, dtype=f8), torch.ones(m), torch.ones(n)

    with pytest.raises(Skip, match=r"M > 16 \(M = 16\)"):
        gb._int_mm(int8(16, 64, 64))
    with pytest.raises(Skip, match=r"multiples of 8 \(K = 60, N = 64\)"):
        gb._int_mm(int8(32, 64, 60))
    with pytest.raises(Skip, match=r"multiples of 16 \(K = 64, N = 40\)"):
        gb._scaled_mm(fp8(5, 40, 64))
    with pytest.raises(Skip, match="CUDA only"):  # a shape the rules accept, on the CPU
        gb._scaled_mm(fp8(5, 48, 64))


def _reference_grads(x, w, b, g, act):
    leaves = [v.detach().double().requires_grad_(True) for v in (x, w, b)]
    y = torch.nn.functional.linear(*leaves)
    y = torch.nn.functional.gelu(y) if act == "gelu" else y
    y.backward(g.double())
    return [v.grad for v in leaves]


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_linear_steps_fill_every_gradient():
    """Each provider's step: a fresh graph, backward with the case's upstream gradient, and the x, weight and bias
    gradients within bf16 tolerance of the fp64 ones (the leaves share the inputs' storage)."""
    spec = _by_name(benches())["linear"]
    case = spec.quick_cases[0]
    inputs = spec.setup(case, torch.device("cpu"))
    want = _reference_grads(*inputs)
    for p in spec.providers:
        if p.name == "torch.compile":
            with pytest.raises(Skip, match="GPU only"):  # inductor's CPU build is not benchmarked
                p.step(inputs)
            continue
        step = p.step(inputs)
        for leaf in step.leaves:
            leaf.grad = torch.full_like(leaf, float("nan"))  # poison: the step must replace it
        step()
        for got, ref in zip([v.grad for v in step.leaves], want, strict=True):
            err = ((got.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"{p.name}: gradient error {err:.2e}"


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_host_bench_reference_matches_autograd():
    """The host bench checks its backward rows against fp64 gradients in the order the providers return them."""
    spec = _by_name(benches())["host"]
    for case in spec.quick_cases:
        if case.params["mode"] != "backward":
            continue
        inp = spec.setup(case, torch.device("cpu"))
        ref = spec.reference(inp)
        for p in spec.providers:
            out = spec.output(p.make(inp)())
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"{case.name} / {p.name}: {err:.2e}"


def test_quick_run_and_tiny_sweep_through_main_for(tmp_path, capsys):
    argv = "--quick --only gemm_bf16 --no-ceilings --sweep --seed 5 --sweep-count 2 --stem smoke --out".split()
    rc = gb.main_for(benches(CPU_SWEEP), [*argv, str(tmp_path)], tmp_path)
    assert rc == 0
    assert "seed 5" in capsys.readouterr().out
    tuned = json.loads((tmp_path / "smoke.json").read_text())
    swept = json.loads((tmp_path / "smoke-sweep.json").read_text())
    for results, n_cases in ((tuned, 1), (swept, 2)):
        rows = [r for b in results["benches"] for r in b["rows"]]
        assert len({r["case"] for r in rows}) == n_cases
        assert rows and all(r["status"] == "ok" for r in rows)
        for r in rows:
            assert r["gpu_us"] > 0 and r["call_us"] > 0, r
            assert r["step_us"] is None  # gemm has no training step
    assert swept["sweep"]["seed"] == 5
    drawn = sweep_cases(_by_name(benches(CPU_SWEEP))["gemm_bf16"], 5, 2)
    assert {r["case"] for b in swept["benches"] for r in b["rows"]} == {c.name for c in drawn}
