"""CPU tests of the benchmark harness (flydsl_common.bench).

The timer is replaced by a fake that returns fixed times, so rates,
fractions and speedups are checked exactly; one end-to-end run of the
common benches goes through the interpreter with the real timer.
"""

from __future__ import annotations

import json

import pytest
import torch

from flydsl.autotune.timer import Timing
from flydsl.testing import gpu_available
from flydsl_common.bench import (
    Bench,
    Case,
    Provider,
    Results,
    Skip,
    common_bench,
    copy_gbps,
    gpu_slug,
    harness,
    main_for,
    measure_ceilings,
    run,
)

N = 1000
CEILINGS = {"copy_gbps": 2.4, "matmul_bf16_tflops": 0.004}


class FakeTimer:
    """Stands in for flydsl.autotune.timer.bench: returns each callable's ``fake_us`` and records what was timed."""

    def __init__(self):
        self.timed = []

    def __call__(self, fn, *, arg_sets=None, device=None, **kwargs):
        self.timed.append(getattr(fn, "fake_us", None))
        us = getattr(fn, "fake_us", 5.0)
        return Timing(us, (us * 0.99, us, us * 1.02), 7)


@pytest.fixture
def fake_timer(monkeypatch):
    timer = FakeTimer()
    monkeypatch.setattr(harness, "timer_bench", timer)
    return timer


def _timed(fn, us):
    fn.fake_us = us
    return fn


def _add_bench(providers, **overrides) -> Bench:
    def setup(case, device):
        n = case.params["n"]
        return (torch.randn(n, device=device), torch.randn(n, device=device), torch.empty(n, device=device))

    spec = dict(
        name="toy",
        cases=[Case("n=1000", {"n": N}), Case("n=10", {"n": 10, "quick": True})],
        setup=setup,
        providers=providers,
        bytes=lambda c: 12 * c.params["n"],
        flops=lambda c: c.params["n"],
        reference=lambda t: t[0].double() + t[1].double(),
        tolerance=1e-6,
        x_param="n",
    )
    spec.update(overrides)
    return Bench(**spec)


def _fill_out(t):
    return torch.add(t[0], t[1], out=t[2])


PROVIDERS = [
    Provider("ours", lambda t: _timed(lambda: _fill_out(t), 10.0), is_ours=True),
    Provider("peer", lambda t: _timed(lambda: t[0] + t[1], 20.0)),
    Provider("slow_peer", lambda t: _timed(lambda: t[0] + t[1], 40.0)),
    Provider("wrong", lambda t: _timed(lambda: t[0] - t[1], 1.0)),
    Provider("unchecked", lambda t: _timed(lambda: t[0] - t[1], 80.0), check=False),
]


def _row(results: Results, case: str, provider: str):
    (row,) = [r for r in results.rows() if r.case == case and r.provider == provider]
    return row


def test_wrong_provider_fails_and_is_not_timed(fake_timer):
    res = run(_add_bench(PROVIDERS), device="cpu", ceilings=CEILINGS, cases=["n=1000"])
    wrong = _row(res, "n=1000", "wrong")
    assert wrong.status == "failed" and "relative error" in wrong.reason
    assert wrong.time_us is None and wrong.gbps is None
    assert 1.0 not in fake_timer.timed  # the wrong provider never reached the timer
    assert sorted(fake_timer.timed) == [10.0, 20.0, 40.0, 80.0]
    assert _row(res, "n=1000", "unchecked").status == "ok"  # check=False: timed as is
    assert _row(res, "n=1000", "unchecked").rel_error is None
    assert [r.provider for r in res.failures()] == ["wrong"]


def test_rates_fractions_and_speedup_from_fake_timer(fake_timer):
    res = run(_add_bench(PROVIDERS), device="cpu", ceilings=CEILINGS, cases=["n=1000"])
    ours = _row(res, "n=1000", "ours")
    assert ours.status == "ok" and ours.rel_error == pytest.approx(0.0, abs=1e-7)
    assert ours.time_us == 10.0 and ours.calls_per_window == 7
    assert ours.gbps == pytest.approx(12 * N / 10.0 / 1e3)  # 12 kB in 10 us = 1.2 GB/s
    assert ours.bw_fraction == pytest.approx(1.2 / 2.4)
    assert ours.tflops == pytest.approx(N / 10.0 / 1e6)  # both models given: both fractions reported
    assert ours.flops_fraction == pytest.approx(1e-4 / 0.004)
    assert ours.speedup == pytest.approx(20.0 / 10.0) and ours.best_peer == "peer"
    assert ours.spread == pytest.approx(0.03)
    peer = _row(res, "n=1000", "peer")
    assert peer.speedup is None and peer.bw_fraction == pytest.approx(0.6 / 2.4)


def test_interleaved_rounds_alternate_the_providers(fake_timer, monkeypatch):
    """interleave=3: each provider timed in three one-window rounds, provider after provider within a round
    (the timer sees ours, peer, ours, peer, ...), its time the median of its rounds' windows; a provider that
    raises in the second round ends as an error row, the others keep their rounds."""
    drift = iter([10.0, 20.0, 30.0, 14.0, 24.0, 12.0, 22.0])  # the host slowing and speeding up

    class Drifting(FakeTimer):
        def __call__(self, fn, *, arg_sets=None, device=None, **kwargs):
            assert kwargs["windows"] == 1
            self.timed.append(getattr(fn, "fake_us", None))
            if fn.fake_us == 40.0 and len(self.timed) > 3:
                raise RuntimeError("flaky")
            us = next(drift)
            return Timing(us, (us,), 7)

    timer = Drifting()
    monkeypatch.setattr(harness, "timer_bench", timer)
    res = run(_add_bench(PROVIDERS[:3], interleave=3), device="cpu", ceilings=CEILINGS, cases=["n=1000"])
    assert timer.timed == [10.0, 20.0, 40.0, 10.0, 20.0, 40.0, 10.0, 20.0]
    ours, peer, slow = (_row(res, "n=1000", p) for p in ("ours", "peer", "slow_peer"))
    assert ours.windows_us == [10.0, 14.0, 12.0] and ours.time_us == 12.0
    assert peer.windows_us == [20.0, 24.0, 22.0] and peer.time_us == 22.0
    assert slow.status == "error" and "flaky" in slow.reason
    assert ours.speedup == pytest.approx(22.0 / 12.0)


def test_no_ceilings_means_no_fractions(fake_timer):
    res = run(_add_bench(PROVIDERS[:2]), device="cpu", ceilings={}, cases=["n=1000"])
    ours = _row(res, "n=1000", "ours")
    assert ours.gbps is not None and ours.bw_fraction is None and ours.flops_fraction is None
    assert ours.speedup == pytest.approx(2.0)


def test_skips_and_errors_carry_reasons(fake_timer):
    def raises(t):
        raise RuntimeError("boom")

    def skip(t):
        raise Skip("needs a GPU")

    def skip_on_first_call(t):
        def fn():
            raise Skip("compiler missing")

        return fn

    providers = [
        Provider("ours", lambda t: _timed(lambda: _fill_out(t), 10.0), is_ours=True),
        Provider("none", lambda t: None),
        Provider("skip", skip),
        Provider("late_skip", skip_on_first_call),
        Provider("crash", raises),
    ]
    res = run(_add_bench(providers), device="cpu", ceilings={}, cases=["n=1000"])
    assert _row(res, "n=1000", "none").status == "skipped"
    assert _row(res, "n=1000", "none").reason == "cannot serve this case"
    assert (_row(res, "n=1000", "skip").status, _row(res, "n=1000", "skip").reason) == ("skipped", "needs a GPU")
    assert _row(res, "n=1000", "late_skip").reason == "compiler missing"
    crash = _row(res, "n=1000", "crash")
    assert crash.status == "error" and "RuntimeError: boom" in crash.reason
    assert _row(res, "n=1000", "ours").speedup is None  # no peer was timed
    assert fake_timer.timed == [10.0]


def test_setup_error_is_recorded_per_provider(fake_timer):
    def setup(case, device):
        raise MemoryError("too big")

    res = run(_add_bench(PROVIDERS[:2], setup=setup), device="cpu", ceilings={}, cases=["n=1000"])
    assert [(r.status, r.reason) for r in res.rows()] == [("error", "setup: MemoryError: too big")] * 2
    assert fake_timer.timed == []


def test_poison_runs_before_each_check(fake_timer):
    # A provider that writes nothing leaves the poisoned output: it must fail.
    providers = [
        Provider("writes", lambda t: _timed(lambda: _fill_out(t), 10.0), is_ours=True),
        Provider("lazy", lambda t: _timed(lambda: t[2], 5.0), is_ours=True),
    ]
    spec = _add_bench(providers, poison=lambda t: t[2].fill_(float("nan")))
    res = run(spec, device="cpu", ceilings={}, cases=["n=1000"])
    assert _row(res, "n=1000", "writes").status == "ok"
    lazy = _row(res, "n=1000", "lazy")
    assert lazy.status == "failed" and "nan" in lazy.reason


def test_filters_and_quick_cases(fake_timer):
    spec = _add_bench(PROVIDERS)
    res = run(spec, device="cpu", ceilings={}, quick=True, providers=["OURS", "peer"])
    assert {(r.case, r.provider) for r in res.rows()} == {("n=10", "ours"), ("n=10", "peer")}
    assert spec.select_cases(quick=False) == spec.cases
    no_flags = _add_bench(PROVIDERS, cases=[Case("a", {"n": 4}), Case("b", {"n": 8})])
    assert [c.name for c in no_flags.select_cases(quick=True)] == ["a"]  # fallback: the first case
    explicit = _add_bench(PROVIDERS, quick_cases=[Case("q", {"n": 2})])
    assert [c.name for c in explicit.select_cases(quick=True)] == ["q"]


def test_rotation_makes_one_callable_per_copy():
    made = []

    def make(t):
        made.append(t)
        return lambda: t[0]

    provider = Provider("p", make)
    sets = [(torch.zeros(1) + i,) for i in range(3)]
    first = make(sets[0])
    call, arg_sets = harness._rotated_calls(provider, first, sets)
    assert len(arg_sets) == 3 and len(made) == 3
    assert [call(*arg_sets[i % 3]).item() for i in range(4)] == [0.0, 1.0, 2.0, 0.0]
    assert harness._rotated_calls(provider, first, None) == (first, None)


def test_reports_written_and_json_reloads(fake_timer, tmp_path):
    res = run(_add_bench(PROVIDERS), device="cpu", ceilings=CEILINGS, out_dir=tmp_path, stem="toy")
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"toy.{ext}").stat().st_size > 0
    data = json.loads((tmp_path / "toy.json").read_text())
    assert {"schema", "env", "ceilings", "benches"} <= set(data)
    assert {"device_name", "arch", "versions", "date"} <= set(data["env"])
    assert {"torch", "triton", "flydsl"} <= set(data["env"]["versions"])
    assert data["ceilings"] == CEILINGS
    (bench,) = data["benches"]
    assert bench["name"] == "toy" and bench["metric"] == "GB/s" and bench["x_param"] == "n"
    row = bench["rows"][0]
    for key in ("case", "params", "provider", "status", "time_us", "gbps", "bw_fraction", "speedup", "rel_error"):
        assert key in row
    again = Results.load(tmp_path / "toy.json")
    assert again.to_dict() == res.to_dict()
    md = (tmp_path / "toy.md").read_text()
    assert "| case | provider | time (us) | GB/s | TFLOP/s | % of ceiling | vs best peer | check |" in md
    assert "FAILED" in md and "2.00x" in md and "50% bw" in md
    assert "cpu" in md.splitlines()[2]  # the header names the device


def test_print_table(fake_timer, capsys):
    run(_add_bench(PROVIDERS), device="cpu", ceilings=CEILINGS, cases=["n=1000"]).print_table()
    out = capsys.readouterr().out
    assert "[toy]" in out and "FAILED" in out and "2.00x" in out


def test_main_for_exit_codes(fake_timer, tmp_path, capsys):
    spec = _add_bench(PROVIDERS)
    assert main_for([spec], ["--no-ceilings", "--out", str(tmp_path)]) == 1  # the wrong provider fails the run
    good = ["--no-ceilings", "--out", str(tmp_path), "--providers", "ours,peer", "--stem", "good"]
    assert main_for([spec], good) == 0
    assert (tmp_path / "good.json").exists()
    assert main_for([spec], ["--only", "nope", "--no-ceilings"]) == 2
    assert main_for([spec], ["--list"]) == 0
    assert "n=10" in capsys.readouterr().out


def test_measure_ceilings_on_cpu(fake_timer):
    c = measure_ceilings("cpu")
    assert c["copy_gbps"] == pytest.approx(c["copy_bytes"] / 5.0 / 1e3)  # fake timer: 5 us per call
    assert c["matmul_bf16_tflops"] == pytest.approx(2 * 512**3 / 5.0 / 1e6)
    assert c["meaningful"] is False and "CPU" in c["note"]
    only_copy = measure_ceilings("cpu", matmul=False)
    assert only_copy["matmul_bf16_tflops"] is None and only_copy["copy_gbps"] > 0


def test_copy_gbps_counts_the_bytes_moved(fake_timer):
    # reads plus writes over the timed call: 8 MiB moved in 5 us (the fake timer's time a call)
    assert copy_gbps(8 << 20, "cpu") == pytest.approx((8 << 20) / 5.0 / 1e3)
    assert copy_gbps(1, "cpu") == pytest.approx(8 / 5.0 / 1e3)  # never less than one int32 each way


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_slug("cpu (Triton interpreter)") == "cpu-triton-interpreter"
    assert gpu_slug("???") == "device"


def test_common_bench_quick_end_to_end(tmp_path):
    # The real timer and the interpreter: tiny quick shapes keep this to seconds.
    assert common_bench.main(["--quick", "--no-ceilings", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("*.json")
    res = Results.load(json_path)
    assert [b.name for b in res.benches] == ["quant", "vec_add"]
    quant = res.bench("quant").rows
    assert {r.params["mode"] for r in quant} == {"per_token", "per_tensor_dynamic", "per_tensor_static"}
    ours = [r for r in res.rows() if r.provider == "flydsl"]
    assert ours and all(r.status == "ok" and r.time_us > 0 and r.gbps > 0 for r in ours)
    compiled = [r for r in quant if r.provider == "torch.compile"]
    if not gpu_available():  # torch.compile is skipped on the CPU (inductor's C++ build is too slow)
        assert compiled and all(r.status == "skipped" and r.reason for r in compiled)
    assert all(r.speedup is not None for r in ours)
    assert json_path.with_suffix(".png").exists() and json_path.with_suffix(".md").exists()


def test_common_bench_models():
    q = common_bench.quant_bench()
    full = q.select_cases(quick=False)
    assert {c.params["N"] for c in full} == {1024, 4096, 8192, 16384}
    assert all(c.params["M"] * c.params["N"] == 1 << 27 for c in full)
    assert any(c.params["M"] == 16384 and c.params["N"] == 8192 for c in full)
    tok = Case("t", {"mode": "per_token", "dtype": "int8", "M": 4, "N": 8})
    ten = Case("t", {"mode": "per_tensor_dynamic", "dtype": "int8", "M": 4, "N": 8})
    assert q.bytes(tok) == 2 * 32 + 32 + 4 * 4
    assert q.bytes(ten) == 2 * 32 + 32 + 4  # one read of x: the two-read kernel shows below 100%
    v = common_bench.vec_add_bench()
    assert [c.params["n"] for c in v.select_cases(quick=False)] == [1 << 20, 1 << 24, 1 << 28]
    assert v.bytes(Case("x", {"n": 10})) == 120


def test_results_dir_finds_the_package_folder_of_the_source_tree(tmp_path, monkeypatch):
    from pathlib import Path

    from flydsl_common.bench import results_dir

    here = Path(__file__).resolve()
    assert results_dir("fly-common", here) == here.parents[1] / "benchmarks" / "results"
    monkeypatch.chdir(tmp_path)
    assert results_dir("no-such-package", here) == tmp_path / "bench-results"  # an installed copy
