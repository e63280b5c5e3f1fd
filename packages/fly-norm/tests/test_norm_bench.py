"""The fly-norm benchmark's specs on the CPU: the benches build, the sweep is seeded and in its range, the
training step fills fresh gradients, and a quick run plus a tiny sweep write all three timings."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from fly_norm import bench as norm_bench
from fly_norm import reference as ref
from flydsl_common.bench import Results, main_for, run
from flydsl_common.bench.harness import DEFAULT_SWEEP_COUNT, sweep_cases, sweep_counts

FWD = {"rmsnorm_fwd", "layernorm_fwd", "softmax_fwd"}
BWD = {"rmsnorm_bwd", "layernorm_bwd", "softmax_bwd"}
PROVIDERS = ["flydsl", "torch", "torch.compile"]


def _by_name():
    return {b.name: b for b in norm_bench.benches()}


def _family_sweep(seed: int, count: int = DEFAULT_SWEEP_COUNT) -> dict:
    benches = norm_bench.benches()
    counts = sweep_counts(benches, count)
    return {b.name: sweep_cases(b, seed, counts[b.name]) for b in benches if b.name in counts}


def test_benches_build_with_their_timings_and_steps():
    benches = _by_name()
    assert set(benches) == FWD | BWD | {"rmsnorm_quant", "rmsnorm_quant_fp8", "host"}  # latency, call_rate gone
    for name in FWD | BWD:
        b = benches[name]
        assert b.timings == ("gpu", "call", "step"), name
        assert [p.name for p in b.providers] == PROVIDERS, name
        assert all(p.step is not None for p in b.providers), name
        assert b.sweep is not None, name
        assert len({c.name for c in b.cases}) == len(b.cases) >= 10, name
        for c in b.cases:  # the tuned set: bf16 at 2^27 elements
            assert c.params["dtype"] == "bf16" and c.params["M"] * c.params["N"] == 1 << 27, (name, c)
    for name in BWD:  # the backward bench times the step at every width (one compile serves both)
        assert all(c.params["step"] for c in benches[name].cases), name
    for name in FWD:  # the forward benches at a few widths only: the _bwd bench has the same steps
        stepped = [c.params["N"] for c in benches[name].cases if c.params["step"]]
        assert stepped == sorted(norm_bench._FWD_STEP_WIDTHS), name
    for name in ("rmsnorm_quant", "rmsnorm_quant_fp8"):
        assert benches[name].timings == ("gpu", "call") and benches[name].sweep is None
        assert all(p.step is None for p in benches[name].providers)
    host = benches["host"]
    assert host.timings == ("host",) and [p.name for p in host.providers] == ["flydsl", "torch"]
    ops = {c.params["op"] for c in host.cases}
    assert ops == {"rms_norm", "rms_norm+residual", "layer_norm", "softmax"}
    for op in ops:
        modes = {c.params["mode"] for c in host.cases if c.params["op"] == op}
        assert modes == {"no_grad", "fwd_grad", "backward"}, op
    assert all(c.params["M"] * c.params["N"] <= 4 * 4096 for c in host.cases)


def test_sweep_repeats_from_its_seed_and_draws_from_the_rng_only():
    state = random.getstate()
    first = _family_sweep(7)
    assert random.getstate() == state  # the module's global generator is not drawn from
    assert _family_sweep(7) == first
    assert _family_sweep(8) != first
    assert set(first) == FWD | BWD
    rng_a, rng_b = random.Random(3), random.Random(3)
    assert norm_bench.sweep_shapes(rng_a, 25) == norm_bench.sweep_shapes(rng_b, 25)


@pytest.mark.parametrize("seed", [0, 1, 7, 12345, 2**31 - 1])
def test_sweep_has_60_shapes_in_the_realistic_range(seed):
    sweep = _family_sweep(seed)
    cases = [c for cs in sweep.values() for c in cs]
    assert len(cases) >= 60
    lo, hi = norm_bench.SWEEP_WIDTHS
    for c in cases:
        m, n = c.params["M"], c.params["N"]
        assert m >= 1 and lo <= n <= hi and m * n <= norm_bench.SWEEP_MAX_ELEMENTS, c
        assert c.params["dtype"] in ("bf16", "fp16", "fp32"), c
    for name, cs in sweep.items():  # the forward sweep times gpu and call; the backward's the step too
        assert all(c.params["step"] == (name in BWD) for c in cs), name
    ns = [c.params["N"] for c in cases]
    ms = [c.params["M"] for c in cases]
    assert sum(n & (n - 1) != 0 for n in ns) >= 0.7 * len(ns)  # mostly not powers of two
    assert any(n % 2 for n in ns)  # odd widths
    assert any(m <= 16 for m in ms) and any(m * n >= 1 << 24 for m, n in zip(ms, ns, strict=True))  # small and large
    assert sum(c.params["dtype"] == "bf16" for c in cases) >= 0.6 * len(cases)
    assert len({c.name for c in cases}) >= 0.9 * len(cases)


def test_sweep_shapes_rejects_a_bad_range():
    with pytest.raises(ValueError, match="widths"):
        norm_bench.sweep_shapes(random.Random(0), 3, widths=(512, 256))


def _inputs(bench_name: str, m: int, n: int):
    b = _by_name()[bench_name]
    case = norm_bench._case(m, n)
    return b, b.setup(case, "cpu")


@pytest.mark.parametrize("provider", ["flydsl", "torch"])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_step_fills_fresh_weight_and_bias_gradients(provider):
    b, inputs = _inputs("layernorm_bwd", 3, 200)
    _, x, dy, w, bias = inputs
    step = next(p for p in b.providers if p.name == provider).step(inputs)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, bias))
    ref.layer_norm_ref(x64, w64, b64, 1e-5).backward(dy.double())
    for _ in range(2):  # twice: each step writes its gradients afresh (no accumulation over steps)
        step()
        got = [leaf.grad for leaf in step.leaves]
        assert all(g is not None for g in got)
        for g, want in zip(got, (x64.grad, w64.grad, b64.grad), strict=True):
            err = (g.double() - want).norm() / want.norm()
            assert err < 2e-2, (provider, err)


def test_step_is_none_where_the_case_does_not_time_it():
    b = _by_name()["rmsnorm_fwd"]
    inputs = b.setup(norm_bench._case(2, 300, step=False), "cpu")
    assert all(p.step(inputs) is None for p in b.providers)


def test_shapes_too_large_for_the_interpreter_are_skipped_not_failed():
    b = _by_name()["softmax_bwd"]
    case = norm_bench._case(64, 4096)
    results = run(dataclasses.replace(b, cases=[case], quick_cases=[case]), device="cpu", ceilings={}, quick=True)
    rows = results.rows()
    assert [r.status for r in rows] == ["skipped"] * 3
    assert "CPU interpreter" in rows[0].reason


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_host_bench_checks_every_op_and_mode_on_the_cpu(monkeypatch):
    monkeypatch.setattr(norm_bench, "_HOST_SHAPE", (2, 300))  # the interpreter's pace: a smaller, odd row
    host = _by_name()["host"]
    assert all((c.params["M"], c.params["N"]) == (2, 300) for c in host.cases)
    fast = dataclasses.replace(host, quick_cases=list(host.cases), interleave=1)
    results = run(fast, device="cpu", ceilings={}, quick=True, timer_kwargs={"windows": 1, "warmup_ms": 0.0})
    rows = results.rows()
    assert len(rows) == 2 * 12
    assert all(r.status == "ok" and r.host_us and r.host_us > 0 for r in rows), [
        (r.case, r.provider, r.status, r.reason) for r in rows if r.status != "ok"
    ]
    assert all(r.gpu_us is None and r.call_us is None and r.step_us is None for r in rows)
    assert all("host" in r.speedups for r in rows if r.is_ours)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_quick_run_and_tiny_sweep_write_all_three_timings(tmp_path):
    def tiny(rng, count):  # the sweep's generator over a range the interpreter runs in seconds
        shapes = norm_bench.sweep_shapes(rng, count, widths=(256, 700), max_elements=1400)
        return [norm_bench._case(m, n, dtype) for m, n, dtype in shapes]

    spec = _by_name()["layernorm_bwd"]
    spec = dataclasses.replace(spec, quick_cases=spec.quick_cases[1:], sweep=tiny)  # 2 x 1000, and one drawn
    argv = ["--quick", "--no-ceilings", "--device", "cpu", "--sweep", "--seed", "11", "--sweep-count", "1"]
    assert main_for([spec], [*argv, "--out", str(tmp_path)], tmp_path) == 0
    (tuned,) = [p for p in tmp_path.glob("*.json") if not p.stem.endswith("-sweep")]
    (swept,) = tmp_path.glob("*-sweep.json")
    for path in (tuned, swept):
        rows = Results.load(path).rows()
        assert len(rows) == 3
        for r in rows:
            if r.provider == "torch.compile":
                assert r.status == "skipped"  # compiled on the GPU only
                continue
            assert r.status == "ok", (r.case, r.provider, r.reason)
            assert all(v is not None and v > 0 for v in (r.gpu_us, r.call_us, r.step_us)), r
            if r.is_ours:
                assert set(r.speedups) >= {"gpu", "call", "step"}
    data = json.loads(swept.read_text())
    assert data["sweep"]["seed"] == 11
    assert data["summary"]["family"]["step"]["n"] == 1
