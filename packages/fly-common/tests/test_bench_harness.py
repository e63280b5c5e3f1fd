"""CPU tests of the benchmark harness (flydsl_common.bench).

The timer is replaced by a fake that returns fixed times per timing mode, so
the three timings, rates, fractions and ratios are checked exactly; one
end-to-end run of the common benches goes through the interpreter with the
real timer.
"""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import replace

import pytest
import torch

from flydsl.autotune.timer import Timing, rotating_copies
from flydsl.errors import ArgumentError
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
    ratio_stats,
    run,
    run_sweep,
    summarize,
    sweep_cases,
    sweep_counts,
)
from flydsl_common.bench.prewarm import parse_shard, prewarm, warm_cases
from flydsl_common.bench.results import SCHEMA_VERSION

N = 1000
CEILINGS = {"copy_gbps": 2.4, "matmul_bf16_tflops": 0.004}
# The fake timer's time for each timing mode, as a multiple of the callable's fake_us: a call that waits
# for its device work costs more than a queued one, and the host's own cost lies in between.
MODE_FACTOR = {"gpu": 1.0, "call": 3.0, "host": 2.0}


def _mode(kwargs) -> str:
    if kwargs.get("sync_each"):
        assert kwargs.get("backlog") is False
        return "call"
    return "gpu" if kwargs.get("backlog", True) else "host"


class FakeTimer:
    """Stands in for flydsl.autotune.timer.bench: calls the callable once, returns its ``fake_us`` times its
    mode's factor, and records (fake_us, mode, kwargs, arg_sets) of what was timed."""

    def __init__(self):
        self.calls = []

    @property
    def timed(self):
        return [fake for fake, *_ in self.calls]

    def __call__(self, fn, *, arg_sets=None, device=None, **kwargs):
        fake = getattr(fn, "fake_us", None)
        if arg_sets is not None:  # rotated: the callables are the first argument of each set
            fake = getattr(arg_sets[0][0], "fake_us", None)
        self.calls.append((fake, _mode(kwargs), kwargs, arg_sets))
        fn(*(arg_sets[0] if arg_sets else ()))  # the real timer's warmup calls it too: errors surface here
        us = (fake or 5.0) * MODE_FACTOR[_mode(kwargs)]
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


def _step_of(us):
    """A training step of out = a + b: fresh leaves, forward, backward with a given gradient."""

    def step(t):
        def call():
            a, b = t[0].detach().requires_grad_(), t[1].detach().requires_grad_()
            (a + b).backward(torch.ones_like(t[0]))
            return a.grad

        return _timed(call, us)

    return step


PROVIDERS = [
    Provider("ours", lambda t: _timed(lambda: _fill_out(t), 10.0), is_ours=True, step=_step_of(30.0)),
    Provider("peer", lambda t: _timed(lambda: t[0] + t[1], 20.0), step=_step_of(45.0)),
    Provider("slow_peer", lambda t: _timed(lambda: t[0] + t[1], 40.0), step=_step_of(15.0)),
    Provider("wrong", lambda t: _timed(lambda: t[0] - t[1], 1.0), step=_step_of(1.0)),
    Provider("unchecked", lambda t: _timed(lambda: t[0] - t[1], 80.0), check=False),
]


def _row(results: Results, case: str, provider: str):
    (row,) = [r for r in results.rows() if r.case == case and r.provider == provider]
    return row


# ------------------------------------------------------------------ timings


def test_wrong_provider_fails_and_is_never_timed(fake_timer):
    res = run(_add_bench(PROVIDERS), device="cpu", ceilings=CEILINGS, cases=["n=1000"])
    wrong = _row(res, "n=1000", "wrong")
    assert wrong.status == "failed" and "relative error" in wrong.reason
    assert (wrong.gpu_us, wrong.call_us, wrong.step_us, wrong.gbps) == (None, None, None, None)
    assert 1.0 not in fake_timer.timed  # neither the wrong call nor its step reached the timer
    assert _row(res, "n=1000", "unchecked").status == "ok"  # check=False: timed as is
    assert _row(res, "n=1000", "unchecked").rel_error is None
    assert [r.provider for r in res.failures()] == ["wrong"]


def test_three_timings_with_their_modes_and_ratios(fake_timer):
    res = run(_add_bench(PROVIDERS), device="cpu", ceilings=CEILINGS, cases=["n=1000"])
    ours = _row(res, "n=1000", "ours")
    assert ours.status == "ok" and ours.rel_error == pytest.approx(0.0, abs=1e-7)
    assert (ours.gpu_us, ours.call_us, ours.step_us, ours.host_us) == (10.0, 30.0, 90.0, None)
    assert ours.calls_per_window == {"gpu": 7, "call": 7, "step": 7}
    assert ours.spread["gpu"] == pytest.approx(0.03) and set(ours.windows_us) == {"gpu", "call", "step"}
    # rates come from gpu_us only
    assert ours.gbps == pytest.approx(12 * N / 10.0 / 1e3)  # 12 kB in 10 us = 1.2 GB/s
    assert ours.bw_fraction == pytest.approx(1.2 / 2.4)
    assert ours.tflops == pytest.approx(N / 10.0 / 1e6)
    assert ours.flops_fraction == pytest.approx(1e-4 / 0.004)
    # per timing: the best peer may differ (slow_peer has the fastest step)
    assert ours.speedups == pytest.approx({"gpu": 2.0, "call": 60.0 / 30.0, "step": 45.0 / 90.0})
    assert ours.best_peers == {"gpu": "peer", "call": "peer", "step": "slow_peer"}
    peer = _row(res, "n=1000", "peer")
    assert peer.speedups == {} and peer.best_peers == {} and peer.bw_fraction == pytest.approx(0.6 / 2.4)
    unchecked = _row(res, "n=1000", "unchecked")  # no step: its step_us stays None
    assert unchecked.step_us is None and unchecked.call_us == 240.0
    modes = [(fake, mode) for fake, mode, *_ in fake_timer.calls]
    assert modes[:3] == [(10.0, "gpu"), (10.0, "call"), (30.0, "call")]  # ours: gpu, call, then its step
    assert (80.0, "call") in modes and all(mode != "host" for _, mode in modes)


def test_timings_selects_what_is_measured(fake_timer):
    res = run(_add_bench(PROVIDERS[:2], timings=("gpu",)), device="cpu", ceilings={}, cases=["n=1000"])
    ours = _row(res, "n=1000", "ours")
    assert (ours.gpu_us, ours.call_us, ours.step_us) == (10.0, None, None) and ours.speedups == {"gpu": 2.0}
    assert res.bench("toy").timings == ["gpu"] and len(fake_timer.calls) == 2


def test_host_cost_bench(fake_timer):
    res = run(_add_bench(PROVIDERS[:2], timings=("host",)), device="cpu", ceilings=CEILINGS, cases=["n=1000"])
    ours = _row(res, "n=1000", "ours")
    assert (ours.host_us, ours.gpu_us, ours.call_us, ours.step_us) == (20.0, None, None, None)
    assert ours.gbps is None and ours.bw_fraction is None  # rates need gpu_us
    assert ours.speedups == {"host": 2.0} and ours.best_peers == {"host": "peer"}
    assert {mode for _, mode, *_ in fake_timer.calls} == {"host"}
    for _, _, kwargs, _ in fake_timer.calls:
        assert kwargs["backlog"] is False and kwargs["sync_each"] is False
    assert "host (us)" in res.to_markdown() and "gpu (us)" not in res.to_markdown()


def test_timer_settings_per_profile_and_overrides(fake_timer):
    spec = _add_bench(PROVIDERS[:1], timer_kwargs={"windows": 9, "backlog": False, "sync_each": False})
    run(spec, device="cpu", ceilings={}, cases=["n=1000"])
    (gpu, call, step) = [kw for _, _, kw, _ in fake_timer.calls]
    assert gpu["windows"] == call["windows"] == step["windows"] == 9  # window settings: every timing
    assert gpu["backlog"] is False  # the bench may still set the gpu timing's mode
    assert call["sync_each"] is True and step["sync_each"] is True  # but never the call's or step's
    fake_timer.calls.clear()
    run(_add_bench(PROVIDERS[:1]), device="cpu", ceilings={}, cases=["n=1000"], profile="sweep")
    assert [kw["target_window_ms"] for _, _, kw, _ in fake_timer.calls] == [5.0] * 3
    fake_timer.calls.clear()
    run(_add_bench(PROVIDERS[:1]), device="cpu", ceilings={}, cases=["n=1000"])
    gpu, call, _ = [kw for _, _, kw, _ in fake_timer.calls]
    assert (gpu["windows"], gpu["target_window_ms"], call["windows"], call["target_window_ms"]) == (5, 20.0, 5, 10.0)
    with pytest.raises(ArgumentError, match="profile"):
        run(_add_bench(PROVIDERS[:1]), device="cpu", ceilings={}, profile="fast")


def test_bench_rejects_unknown_timings():
    with pytest.raises(ArgumentError, match="timings must be"):
        _add_bench(PROVIDERS, timings=("gpu", "wall"))
    with pytest.raises(ArgumentError, match="timings must be"):
        _add_bench(PROVIDERS, timings=())
    with pytest.raises(ArgumentError, match="sweep must be a callable"):
        _add_bench(PROVIDERS, sweep=[Case("a", {"n": 1})])


def test_step_skip_none_and_error(fake_timer):
    def skip(t):
        raise Skip("no autograd here")

    def late_error(t):
        def call():
            raise RuntimeError("backward exploded")

        return call

    providers = [
        Provider("ours", lambda t: _timed(lambda: _fill_out(t), 10.0), is_ours=True, step=late_error),
        Provider("peer", lambda t: _timed(lambda: t[0] + t[1], 20.0), step=skip),
        Provider("peer2", lambda t: _timed(lambda: t[0] + t[1], 25.0), step=lambda t: None),
    ]
    res = run(_add_bench(providers), device="cpu", ceilings={}, cases=["n=1000"])
    ours, peer, peer2 = (_row(res, "n=1000", p) for p in ("ours", "peer", "peer2"))
    assert ours.status == "error" and "step: RuntimeError: backward exploded" in ours.reason
    assert ours.gpu_us == 10.0 and ours.call_us == 30.0 and ours.step_us is None  # its other timings stay
    assert ours.speedups == pytest.approx({"gpu": 2.0, "call": 2.0})
    assert peer.status == "ok" and peer.step_us is None and "step skipped: no autograd here" in peer.reason
    assert peer2.status == "ok" and peer2.step_us is None and peer2.reason == ""
    assert res.failures() == [ours]


def test_every_timing_rotates_over_the_input_copies(fake_timer, monkeypatch):
    """Where inputs are rotated (on a GPU, when one set fits in L2), make and step are called once per copy
    and call and step are timed over the same copies as gpu, so no call finds its data in L2."""
    made, stepped = [], []
    monkeypatch.setattr(harness, "_input_sets", lambda bench, inputs, dev, l2: rotating_copies(inputs, 4 * 12 * N))

    def make(t):
        made.append(t)
        return _timed(lambda: _fill_out(t), 10.0)

    def step(t):
        stepped.append(t)
        return _timed(lambda: t[0].sum(), 30.0)

    run(_add_bench([Provider("ours", make, is_ours=True, step=step)]), device="cpu", ceilings={}, cases=["n=1000"])
    copies = len(rotating_copies(tuple(torch.empty(N) for _ in range(3)), 4 * 12 * N))
    assert copies > 2
    assert len(made) == copies  # the checked call, then one callable per extra copy (shared by gpu and call)
    assert len(stepped) == copies
    for *_, arg_sets in fake_timer.calls:
        assert arg_sets is not None and len(arg_sets) == copies
        assert len({id(s[0]) for s in arg_sets}) == copies
    assert [f for f, *_ in fake_timer.calls] == [10.0, 10.0, 30.0]


def test_interleaved_rounds_cover_every_timing(fake_timer, monkeypatch):
    """interleave=2: every (provider, timing) timed in two one-window rounds, provider after provider (each of
    its timings in turn) within a round; each time is the median of its rounds; a job that raises in the
    second round makes its row an error and keeps the first round out of it."""
    drift = iter(range(1, 100))

    class Drifting(FakeTimer):
        def __call__(self, fn, *, arg_sets=None, device=None, **kwargs):
            assert kwargs["windows"] == 1
            self.calls.append((fn.fake_us, _mode(kwargs), kwargs, arg_sets))
            if fn.fake_us == 45.0 and len(self.calls) > 6:
                raise RuntimeError("flaky")
            us = float(next(drift))
            return Timing(us, (us,), 7)

    timer = Drifting()
    monkeypatch.setattr(harness, "timer_bench", timer)
    res = run(_add_bench(PROVIDERS[:2], interleave=2), device="cpu", ceilings={}, cases=["n=1000"])
    assert timer.timed == [10.0, 10.0, 30.0, 20.0, 20.0, 45.0] * 2
    ours, peer = _row(res, "n=1000", "ours"), _row(res, "n=1000", "peer")
    assert ours.windows_us == {"gpu": [1.0, 7.0], "call": [2.0, 8.0], "step": [3.0, 9.0]}
    assert (ours.gpu_us, ours.call_us, ours.step_us) == (4.0, 5.0, 6.0)
    assert peer.status == "error" and "step: RuntimeError: flaky" in peer.reason and peer.step_us is None
    assert peer.gpu_us == 7.0 and ours.speedups == pytest.approx({"gpu": 7.0 / 4.0, "call": 8.0 / 5.0})


def test_no_ceilings_means_no_fractions(fake_timer):
    res = run(_add_bench(PROVIDERS[:2]), device="cpu", ceilings={}, cases=["n=1000"])
    ours = _row(res, "n=1000", "ours")
    assert ours.gbps is not None and ours.bw_fraction is None and ours.flops_fraction is None
    assert ours.speedups["gpu"] == pytest.approx(2.0)


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
    providers.append(Provider("late_skip_unchecked", skip_on_first_call, check=False))
    res = run(_add_bench(providers), device="cpu", ceilings={}, cases=["n=1000"])
    unchecked = _row(res, "n=1000", "late_skip_unchecked")  # its Skip comes from the timer's first call
    assert (unchecked.status, unchecked.reason, unchecked.gpu_us) == ("skipped", "compiler missing", None)
    assert _row(res, "n=1000", "none").status == "skipped"
    assert _row(res, "n=1000", "none").reason == "cannot serve this case"
    assert (_row(res, "n=1000", "skip").status, _row(res, "n=1000", "skip").reason) == ("skipped", "needs a GPU")
    assert _row(res, "n=1000", "late_skip").reason == "compiler missing"
    crash = _row(res, "n=1000", "crash")
    assert crash.status == "error" and "RuntimeError: boom" in crash.reason
    assert _row(res, "n=1000", "ours").speedups == {}  # no peer was timed
    assert fake_timer.timed == [10.0, 10.0, None]  # ours: gpu and call (no step); the unchecked skip: gpu only


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

    sets = [(torch.zeros(1) + i,) for i in range(3)]
    first = make(sets[0])
    call, arg_sets = harness._rotated_calls(make, first, sets)
    assert len(arg_sets) == 3 and len(made) == 3
    assert [call(*arg_sets[i % 3]).item() for i in range(4)] == [0.0, 1.0, 2.0, 0.0]
    assert harness._rotated_calls(make, first, None) == (first, None)


def test_progress_line_per_case_as_it_finishes(fake_timer):
    lines = []
    run(_add_bench(PROVIDERS), device="cpu", ceilings={}, progress=lines.append)
    assert len(lines) == 2 and lines[0].startswith("toy: n=1000: ours ")
    assert "call 30.0 us 2x vs peer" in lines[0] and "step 90.0 us 0.5x vs slow_peer" in lines[0]
    assert "gpu 10.0 us 2x vs peer" in lines[0]
    assert lines[0].index("call") < lines[0].index("gpu")  # call and step first
    assert "wrong FAILED" in lines[0]
    lines.clear()
    run(_add_bench(PROVIDERS[:2], timings=("gpu", "call")), device="cpu", ceilings={}, progress=lines.append)
    assert lines[0] == "toy: n=1000: ours call 30.0 us 2x, gpu 10.0 us 2x (vs peer)"
    lines.clear()
    run(_add_bench(PROVIDERS[1:3]), device="cpu", ceilings={}, progress=lines.append, cases=["n=10"])
    assert lines == ["toy: n=10: peer gpu 20.0 us, slow_peer gpu 40.0 us"]  # no ours: each provider's first timing


# ------------------------------------------------------------------ summary


def test_ratio_stats_on_known_numbers():
    s = ratio_stats([2.0, 0.5, 1.0, 4.0])
    assert s["n"] == 4 and s["min"] == 0.5
    assert s["p10"] == pytest.approx(0.5 + 0.3 * 0.5)  # rank 0.3 between 0.5 and 1.0
    assert s["geomean"] == pytest.approx(math.prod([2.0, 0.5, 1.0, 4.0]) ** 0.25)
    eleven = ratio_stats([float(v) for v in range(11, 0, -1)])
    assert eleven["p10"] == pytest.approx(2.0) and eleven["min"] == 1.0  # rank 1.0: the second smallest
    assert ratio_stats([3.0]) == {"n": 1, "min": 3.0, "p10": 3.0, "geomean": pytest.approx(3.0)}
    assert ratio_stats([]) is None
    assert ratio_stats([float("nan"), 0.0, None]) is None  # no usable ratio


def test_summary_per_bench_and_family(fake_timer):
    a = run(_add_bench(PROVIDERS[:3]), device="cpu", ceilings={})
    b = run(_add_bench(PROVIDERS[:2], name="toy2", timings=("gpu", "call")), device="cpu", ceilings={})
    s = summarize(a.benches + b.benches)
    assert s["timings"] == ["call", "step", "gpu", "host"]
    (e1, e2) = s["benches"]
    assert (e1["bench"], e1["provider"], e2["bench"]) == ("toy", "ours", "toy2")
    assert e1["call"]["n"] == 2 and e1["call"]["geomean"] == pytest.approx(2.0)
    assert e1["step"]["min"] == pytest.approx(0.5) and e2["step"] is None and e1["host"] is None
    assert s["family"]["gpu"]["n"] == 4 and s["family"]["step"]["n"] == 2


# -------------------------------------------------------------------- sweep


def _sweep(rng, count):
    return [Case(f"n={n}", {"n": n}) for n in (rng.randrange(3, 200) for _ in range(count))]


def test_sweep_counts_split_the_family_count():
    with_sweep = [_add_bench(PROVIDERS, name=f"b{i}", sweep=_sweep) for i in range(3)]
    plain = _add_bench(PROVIDERS, name="plain")
    assert sweep_counts([*with_sweep, plain], 60) == {"b0": 20, "b1": 20, "b2": 20}
    assert sweep_counts(with_sweep, 61) == {"b0": 21, "b1": 21, "b2": 21}  # each its share, total >= count
    assert sweep_counts([plain], 60) == {}
    with pytest.raises(ArgumentError, match="count must be >= 1"):
        sweep_counts(with_sweep, 0)


def test_sweep_cases_reproducible_from_the_seed():
    spec = _add_bench(PROVIDERS, sweep=_sweep)
    first = sweep_cases(spec, 1234, 30)
    assert first == sweep_cases(spec, 1234, 30)
    assert first != sweep_cases(spec, 1235, 30)
    other = replace(spec, name="other")  # each bench its own stream: same seed, other shapes
    assert sweep_cases(other, 1234, 30) != first
    with pytest.raises(ArgumentError, match="has no sweep"):
        sweep_cases(_add_bench(PROVIDERS), 1, 3)
    with pytest.raises(ArgumentError, match="returned 2"):
        sweep_cases(replace(spec, sweep=lambda rng, n: _sweep(rng, 2)), 1, 3)
    with pytest.raises(ArgumentError, match="list of Case"):
        sweep_cases(replace(spec, sweep=lambda rng, n: [(1, 2)] * n), 1, 3)


def test_run_sweep_keeps_seed_and_writes_beside_the_tuned_set(fake_timer, tmp_path):
    spec = _add_bench(PROVIDERS[:3], sweep=_sweep)
    plain = _add_bench(PROVIDERS[:2], name="plain")
    res = run_sweep([spec, plain], seed=7, count=5, device="cpu", ceilings={}, out_dir=tmp_path, stem="toy")
    assert [b.name for b in res.benches] == ["toy"]  # a bench without a sweep is left out
    assert [r.case for r in res.rows() if r.provider == "ours"] == [c.name for c in sweep_cases(spec, 7, 5)]
    assert res.sweep == {"seed": 7, "count": 5, "cases_per_bench": {"toy": 5}}
    assert {kw["target_window_ms"] for _, _, kw, _ in fake_timer.calls} == {5.0}  # the sweep profile
    data = json.loads((tmp_path / "toy-sweep.json").read_text())
    assert data["sweep"]["seed"] == 7 and data["summary"]["benches"][0]["call"]["n"] == 5
    md = (tmp_path / "toy-sweep.md").read_text()
    assert md.startswith("# Benchmark results (sweep") and "seed 7" in md
    assert (tmp_path / "toy-sweep.png").stat().st_size > 0
    assert not (tmp_path / "toy.json").exists()


# ------------------------------------------------------------------ reports


def test_reports_written_and_json_reloads(fake_timer, tmp_path):
    res = run(_add_bench(PROVIDERS), device="cpu", ceilings=CEILINGS, out_dir=tmp_path, stem="toy")
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"toy.{ext}").stat().st_size > 0
    data = json.loads((tmp_path / "toy.json").read_text())
    assert {"schema", "env", "ceilings", "benches", "summary", "sweep"} <= set(data)
    assert data["schema"] == SCHEMA_VERSION == 2 and data["sweep"] is None
    assert {"device_name", "arch", "versions", "date"} <= set(data["env"])
    assert {"torch", "triton", "flydsl"} <= set(data["env"]["versions"])
    assert data["ceilings"] == CEILINGS
    (bench,) = data["benches"]
    assert bench["name"] == "toy" and bench["metric"] == "GB/s" and bench["x_param"] == "n"
    assert bench["timings"] == ["gpu", "call", "step"]
    row = next(r for r in bench["rows"] if r["provider"] == "ours" and r["case"] == "n=1000")
    for key in ("gpu_us", "call_us", "step_us", "host_us", "speedups", "best_peers", "gbps", "bw_fraction"):
        assert key in row
    assert "time_us" not in row and "speedup" not in row and "best_peer" not in row
    assert (row["gpu_us"], row["call_us"], row["step_us"], row["host_us"]) == (10.0, 30.0, 90.0, None)
    assert row["speedups"] == {"gpu": 2.0, "call": 2.0, "step": 0.5}
    assert data["summary"]["family"]["step"]["n"] == 2
    again = Results.load(tmp_path / "toy.json")
    assert again.to_dict() == res.to_dict()
    md = (tmp_path / "toy.md").read_text()
    lines = md.splitlines()
    assert lines[0] == "# Benchmark results (tuned shape set)"
    summary_head = next(i for i, line in enumerate(lines) if line.startswith("| bench | ours |"))
    assert summary_head < 6  # the summary opens the file
    assert "call: min / p10 / geomean" in lines[summary_head]
    assert lines[summary_head].index("call:") < lines[summary_head].index("step:") < lines[summary_head].index("gpu:")
    head = "| case | provider | call (us) | vs best | step (us) | vs best | gpu (us) | vs best | GB/s | TFLOP/s |"
    assert head in md
    assert "| n=1000 | **ours** | 30.0 | 2.00x | 90.0 | 0.50x | 10.0 | 2.00x | 1.2 |" in md
    assert "FAILED" in md and "50% bw" in md
    assert any("device: cpu" in line for line in lines)


def test_old_schema_is_refused(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": 1, "env": {}, "ceilings": {}, "benches": []}))
    with pytest.raises(ArgumentError, match="schema 2, got schema 1"):
        Results.load(path)


def test_plot_draws_every_timing(fake_timer, tmp_path, monkeypatch):
    import matplotlib.figure

    drawn = []
    saved = matplotlib.figure.Figure.savefig

    def spy(fig, path, **kwargs):
        drawn.extend(ax.get_title() for ax in fig.axes if ax.get_visible())
        return saved(fig, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    host = _add_bench(PROVIDERS[:2], name="host", timings=("host",))
    res = run([_add_bench(PROVIDERS), host], device="cpu", ceilings=CEILINGS)
    res.plot(tmp_path / "tuned.png")
    assert sorted(drawn) == ["host: host", "toy: call", "toy: gpu", "toy: step"]
    drawn.clear()
    swept = run_sweep(_add_bench(PROVIDERS[:3], sweep=_sweep), seed=3, count=4, device="cpu", ceilings={})
    swept.plot(tmp_path / "sweep.png")
    assert sorted(drawn) == ["toy: call", "toy: gpu", "toy: step"]
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_print_table(fake_timer, capsys):
    run(_add_bench(PROVIDERS), device="cpu", ceilings=CEILINGS, cases=["n=1000"]).print_table()
    out = capsys.readouterr().out
    assert "[toy]" in out and "FAILED" in out and "2.00x" in out and "call us" in out and "step us" in out
    assert "toy ours: call 2.00x / 2.00x / 2.00x (n=1)" in out


# ---------------------------------------------------------------------- CLI


def test_main_for_exit_codes(fake_timer, tmp_path, capsys):
    spec = _add_bench(PROVIDERS)
    assert main_for([spec], ["--no-ceilings", "--out", str(tmp_path)]) == 1  # the wrong provider fails the run
    good = ["--no-ceilings", "--out", str(tmp_path), "--providers", "ours,peer", "--stem", "good"]
    assert main_for([spec], good) == 0
    assert (tmp_path / "good.json").exists() and not (tmp_path / "good-sweep.json").exists()
    assert main_for([spec], ["--only", "nope", "--no-ceilings"]) == 2
    assert main_for([spec], ["--list"]) == 0
    assert "n=10" in capsys.readouterr().out
    assert main_for([spec], ["--sweep", "--no-ceilings", "--out", str(tmp_path)]) == 2  # no bench has a sweep
    assert "none of toy defines one" in capsys.readouterr().err
    assert main_for([replace(spec, sweep=_sweep)], ["--sweep", "--sweep-count", "0"]) == 2


def test_main_for_sweep_end_to_end(tmp_path, capsys):
    """Real timer, CPU: the tuned set and the sweep, the seed printed and stored, a line per case."""
    spec = _add_bench(PROVIDERS[:2], sweep=_sweep)
    plain = _add_bench(PROVIDERS[:2], name="plain")
    args = ["--no-ceilings", "--out", str(tmp_path), "--stem", "t", "--seed", "99", "--sweep-count", "3"]
    assert main_for([spec, plain], [*args, "--sweep"]) == 0
    out = capsys.readouterr().out
    assert "sweep seed 99 (repeat: --seed 99); 3 shapes: toy 3" in out
    assert out.index("toy: n=10: ours call") < out.index("sweep (seed 99):")  # the tuned set first, line by line
    drawn = [c.name for c in sweep_cases(spec, 99, 3)]
    for name in drawn:
        assert f"toy: {name}: ours call" in out
    tuned, swept = Results.load(tmp_path / "t.json"), Results.load(tmp_path / "t-sweep.json")
    assert [b.name for b in tuned.benches] == ["toy", "plain"] and tuned.sweep is None
    assert [r.case for r in swept.rows() if r.provider == "ours"] == drawn and swept.sweep["seed"] == 99
    ours = [r for r in tuned.rows() + swept.rows() if r.provider == "ours"]
    assert all(r.gpu_us > 0 and r.call_us > 0 and r.step_us > 0 for r in ours)  # its step: a real autograd step
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"t-sweep.{ext}").stat().st_size > 0

    # --sweep-only with the same seed repeats the shapes and writes nothing for the tuned set
    only = tmp_path / "only"
    assert main_for([spec, plain], ["--no-ceilings", "--out", str(only), "--stem", "t", "--seed", "99",
                                    "--sweep-count", "3", "--sweep-only"]) == 0  # fmt: skip
    assert not (only / "t.json").exists()
    again = Results.load(only / "t-sweep.json")
    assert [r.case for r in again.rows() if r.provider == "ours"] == drawn
    out = capsys.readouterr().out
    assert "tuned set:" not in out

    # no --seed: a fresh one, printed, and stored in the JSON
    fresh = tmp_path / "fresh"
    assert main_for([spec], ["--no-ceilings", "--out", str(fresh), "--stem", "t", "--sweep-only"]) == 0
    out = capsys.readouterr().out
    fresh_sweep = Results.load(fresh / "t-sweep.json")
    seed, count = fresh_sweep.sweep["seed"], len([r for r in fresh_sweep.rows() if r.provider == "ours"])
    # the count is the default's: one a bench under the interpreter (--quick), more on a GPU
    assert count >= 1 and f"sweep seed {seed} (repeat: --seed {seed}); {count} shapes: toy {count}" in out


def test_main_for_list_shows_the_sweep(capsys):
    spec = _add_bench(PROVIDERS[:2], sweep=_sweep)
    assert main_for([spec], ["--list", "--sweep", "--seed", "5", "--sweep-count", "2"]) == 0
    out = capsys.readouterr().out
    for c in sweep_cases(spec, 5, 2):
        assert f"  sweep: {c.name}" in out


# --------------------------------------------------------------- ceilings


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


# ----------------------------------------------------------- common bench


def test_common_bench_quick_end_to_end(tmp_path):
    # The real timer and the interpreter: tiny quick shapes keep this to seconds.
    assert common_bench.main(["--quick", "--no-ceilings", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("*.json")
    res = Results.load(json_path)
    assert [b.name for b in res.benches] == ["quant", "vec_add"]
    quant = res.bench("quant").rows
    assert {r.params["mode"] for r in quant} == {"per_token", "per_tensor_dynamic", "per_tensor_static"}
    ours = [r for r in res.rows() if r.provider == "flydsl"]
    assert ours and all(r.status == "ok" and r.gpu_us > 0 and r.call_us > 0 and r.gbps > 0 for r in ours)
    assert all(r.step_us is None for r in res.rows())  # quantization has no backward
    compiled = [r for r in quant if r.provider == "torch.compile"]
    if not gpu_available():  # torch.compile is skipped on the CPU (inductor's C++ build is too slow)
        assert compiled and all(r.status == "skipped" and r.reason for r in compiled)
    assert all(set(r.speedups) == {"gpu", "call"} for r in ours)
    assert json_path.with_suffix(".png").exists() and json_path.with_suffix(".md").exists()


def test_common_bench_sweep_shapes():
    q = common_bench.quant_bench()
    assert q.sweep is common_bench.quant_sweep and q.timings == ("gpu", "call")
    assert common_bench.vec_add_bench().sweep is None  # the family's whole sweep goes to quant
    assert sweep_counts(common_bench.benches(), 60) == {"quant": 60}
    for seed in range(5):
        cases = sweep_cases(q, seed, 60)
        ms = [c.params["M"] for c in cases]
        ns = [c.params["N"] for c in cases]
        assert sum(1 <= m <= 16 for m in ms) == 20  # a third of the shapes are decode-sized
        assert max(ms) > 512 and all(m >= 1 for m in ms)
        assert all(200 <= n <= 16384 and n & (n - 1) != 0 for n in ns)  # never a power of two
        assert sum(n % 2 for n in ns) >= 20  # odd widths: masked row tails
        assert all(m * n <= 1 << 27 for m, n in zip(ms, ns, strict=True))
        modes = {(c.params["mode"], c.params["dtype"]) for c in cases}
        assert len(modes) == 4
        assert len({c.name for c in cases}) >= 55  # distinct shapes, not one repeated
    assert sweep_cases(q, 11, 60) == sweep_cases(q, 11, 60)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_common_bench_runs_sweep_like_shapes_on_the_interpreter():
    """Odd, small shapes like the sweep's, through the harness against the references (not timed for speed)."""
    shapes = [("per_token", "fp8", 3, 201), ("per_token", "int8", 1, 333), ("per_tensor_dynamic", "int8", 5, 1001),
              ("per_tensor_static", "int8", 2, 259)]  # fmt: skip
    cases = [Case(f"{m} {d} {a}x{b}", {"mode": m, "dtype": d, "M": a, "N": b}) for m, d, a, b in shapes]
    spec = replace(common_bench.quant_bench(), cases=cases, quick_cases=cases, timings=("gpu",))
    res = run(spec, device="cpu", ceilings={}, providers=["flydsl", "torch"], timer_kwargs={"windows": 1})
    assert len(res.rows()) == 8
    assert all(r.status == "ok" and r.rel_error <= r.tolerance and r.gpu_us > 0 for r in res.rows())


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


def test_sweep_generator_gets_a_seeded_random():
    seen = []

    def gen(rng, count):
        seen.append(type(rng))
        return [Case(str(i), {"n": 1}) for i in range(count)]

    sweep_cases(_add_bench(PROVIDERS, sweep=gen), 0, 2)
    assert seen == [random.Random]


def test_nothing_timed_still_writes_the_tables(fake_timer, tmp_path, capsys):
    providers = [Provider("ours", lambda t: None, is_ours=True), Provider("peer", lambda t: None)]
    res = run(_add_bench(providers), device="cpu", ceilings={}, out_dir=tmp_path, stem="none")
    assert all(r.status == "skipped" for r in res.rows())
    assert (tmp_path / "none.json").exists() and (tmp_path / "none.md").exists()
    assert not (tmp_path / "none.png").exists() and "plot skipped" in capsys.readouterr().err


# ------------------------------------------------------ runs in parts, prewarm


def test_each_finished_bench_is_handed_over(fake_timer):
    """on_bench sees the results after every bench, so a run cut short can write what it finished."""
    seen = []
    specs = [_add_bench(PROVIDERS[:2]), _add_bench(PROVIDERS[:2], name="second")]
    run(specs, ceilings={}, on_bench=lambda r: seen.append([b.name for b in r.benches]))
    assert seen == [["toy"], ["toy", "second"]]
    seen.clear()
    swept = run_sweep([replace(specs[0], sweep=_sweep)], seed=3, count=2, ceilings={}, on_bench=seen.append)
    assert len(seen) == 1 and seen[0].sweep == swept.sweep == {"seed": 3, "count": 2, "cases_per_bench": {"toy": 2}}


def test_merge_keeps_the_benches_not_run_again(fake_timer, tmp_path, capsys):
    first, second = _add_bench(PROVIDERS[:2]), _add_bench(PROVIDERS[:2], name="second")
    args = ["--no-ceilings", "--out", str(tmp_path), "--stem", "m"]
    assert main_for([first, second], [*args, "--only", "toy"]) == 0
    assert main_for([first, second], [*args, "--only", "second", "--merge"]) == 0
    merged = Results.load(tmp_path / "m.json")
    assert [b.name for b in merged.benches] == ["toy", "second"]  # the family's order, not the runs'
    assert all(b.date for b in merged.benches)
    assert "kept from the earlier run: toy" in capsys.readouterr().out
    assert "Run finished" in (tmp_path / "m.md").read_text()
    # without --merge the file is the run's alone
    assert main_for([first, second], [*args, "--only", "second"]) == 0
    assert [b.name for b in Results.load(tmp_path / "m.json").benches] == ["second"]


def test_merge_refuses_other_devices_and_shape_sets(fake_timer):
    a = run(_add_bench(PROVIDERS[:2]), ceilings={})
    b = run(_add_bench(PROVIDERS[:2], name="second"), ceilings={})
    merged, note = b.merged_with(a, ["toy", "second"])
    assert [x.name for x in merged.benches] == ["toy", "second"] and "toy" in note
    other = Results(env={**a.env, "device_name": "another"}, ceilings={}, benches=a.benches)
    assert b.merged_with(other, ["toy", "second"])[0] is b
    sweep = Results(env=a.env, ceilings={}, benches=a.benches, sweep={"seed": 1, "cases_per_bench": {"toy": 1}})
    assert b.merged_with(sweep, ["toy", "second"])[0] is b  # a sweep never mixes into a tuned set
    later = Results(env=a.env, ceilings={}, benches=b.benches, sweep={"seed": 2, "cases_per_bench": {"second": 1}})
    assert later.merged_with(sweep, ["toy", "second"])[0] is later  # nor two sweeps of different seeds


def test_parse_shard():
    assert parse_shard("0/1") == (0, 1) and parse_shard("3/8") == (3, 8)
    for bad in ("1/1", "8/8", "-1/2", "a/2", "2", "1/0"):
        with pytest.raises(ValueError):
            parse_shard(bad)


def test_warm_cases_runs_its_share_once_and_survives_failures():
    calls = []

    def maker(name):
        def make(t):
            if name == "broken":
                raise RuntimeError("a peer that cannot serve this case")
            return lambda: calls.append((name, t[0].numel()))

        return make

    def step(t):
        return lambda: calls.append(("step", t[0].numel()))

    spec = _add_bench([Provider("ours", maker("ours"), is_ours=True, step=step), Provider("broken", maker("broken"))])
    pairs = [(spec, Case(f"n={n}", {"n": n})) for n in (1, 2, 3, 4, 5)]
    assert warm_cases(pairs, torch.device("cpu"), (1, 2)) == 2  # pairs 1 and 3: n = 2 and 4
    assert calls == [("ours", 2), ("step", 2), ("ours", 4), ("step", 4)]


_WARM_SCRIPT = '''
import sys
from pathlib import Path

import torch

from flydsl_common.bench import Bench, Case, Provider, main_for

marks = Path(sys.argv[1])
def make(t):
    def call():
        (marks / f"n{t[0].numel()}").write_text("compiled")
    return call
cases = [Case(f"n={n}", {"n": n}) for n in (1, 2, 3)]
bench = Bench(name="toy", cases=cases, quick_cases=cases, setup=lambda case, dev: (torch.zeros(case.params["n"]),),
              providers=[Provider("ours", make, is_ours=True)])
sys.exit(main_for([bench], sys.argv[2:]))
'''


def test_prewarm_workers_cover_every_case(tmp_path, monkeypatch):
    """prewarm starts N copies of the command line with --warm-shard i/N; together they run every case."""
    script = tmp_path / "bench.py"
    script.write_text(_WARM_SCRIPT)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, str(script), str(marks), "--quick"], raising=False)
    took = prewarm([], 2)
    assert took > 0
    assert sorted(p.name for p in marks.iterdir()) == ["n1", "n2", "n3"]


def test_profile_writes_where_the_time_went(fake_timer, tmp_path):
    specs = [_add_bench(PROVIDERS[:2]), _add_bench(PROVIDERS[:2], name="second")]
    prof = tmp_path / "prof.txt"
    assert main_for(specs, ["--no-ceilings", "--out", str(tmp_path), "--quick", "--profile", str(prof)]) == 0
    text = prof.read_text()
    case_line = next(line for line in text.splitlines() if "(_run_case)" in line)
    assert case_line.split()[0] == "2"  # one quick case a bench, both benches profiled (not just the first)
    assert text.count("function calls") == 2  # the two sortings of one profile


def test_profiled_benches_are_marked_in_the_results(fake_timer, tmp_path):
    """A run under --profile says so in its JSON and markdown (its host-side timings carry cProfile's
    overhead); a plain run does not, and merging keeps each bench's mark."""
    specs = [_add_bench(PROVIDERS[:2]), _add_bench(PROVIDERS[:2], name="second")]
    out = ["--no-ceilings", "--out", str(tmp_path)]
    assert main_for(specs, [*out, "--only", "toy", "--profile", str(tmp_path / "prof.txt")]) == 0
    (path,) = tmp_path.glob("*.json")
    assert [b.profiled for b in Results.load(path).benches] == [True]
    assert "Timed under cProfile" in path.with_suffix(".md").read_text()
    assert main_for(specs, [*out, "--only", "second", "--merge"]) == 0
    merged = Results.load(path)
    assert {b.name: b.profiled for b in merged.benches} == {"toy": True, "second": False}
    assert path.with_suffix(".md").read_text().count("Timed under cProfile") == 1


def test_log_uniform_stays_in_bounds_and_spreads_over_octaves():
    from flydsl_common.bench import log_uniform

    rng = random.Random(3)
    draws = [log_uniform(rng, 16, 65536) for _ in range(4000)]
    assert min(draws) >= 16 and max(draws) <= 65536
    below_1k = sum(d < 1024 for d in draws) / len(draws)  # 6 of the 12 octaves
    assert 0.4 < below_1k < 0.6


def test_distinct_cases_keeps_draw_order_and_names_a_dry_generator():
    from flydsl_common.bench import distinct_cases

    rng = random.Random(5)
    cases = distinct_cases(6, lambda: Case(f"c{rng.randrange(8)}", {}), "toy")
    names = [c.name for c in cases]
    assert len(set(names)) == 6
    with pytest.raises(ValueError, match="toy: cannot draw 3 distinct"):
        distinct_cases(3, lambda: Case("same", {}), "toy")
