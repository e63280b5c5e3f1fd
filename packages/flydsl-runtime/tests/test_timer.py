"""CPU tests of the timer's pure logic: windowing, argument rotation, L2 copies."""

from __future__ import annotations

import statistics

import pytest
import torch

from flydsl.autotune import Timing, bench, rotating_copies
from flydsl.autotune.timer import _calls_for, _fit_window

FAST = {"warmup_ms": 1.0, "target_window_ms": 1.0}


def test_timing_str():
    t = Timing(12.3449, (12.0, 12.3449, 13.0), 100)
    assert str(t) == "12.34 us (3 windows x 100 calls)"


def test_calls_per_window_bounds():
    assert _calls_for(0.02, 1e-3, 10000) == 20
    assert _calls_for(0.02, 1.0, 10000) == 1  # a slow call still gets one
    assert _calls_for(0.02, 1e-9, 500) == 500  # a trivial call is capped
    assert _calls_for(0.02, 0.0, 7) == 7  # a call too fast for the clock


class FakeGpu:
    """A GPU behind a launch queue of ``depth`` launches, for _fit_window.

    The host needs ``host_us`` per launch, the kernel takes ``gpu_us``. While
    the queue is not full the host never waits; past ``depth`` queued launches
    it waits for the sleep to end and then for the GPU to drain, so the GPU
    starves once the host is slower than the kernel.
    """

    def __init__(self, host_us, gpu_us, depth=1000):
        self.host, self.gpu, self.depth = host_us * 1e-6, gpu_us * 1e-6, depth
        self.probes = []

    def probe(self, calls, host_per_call):
        sleep_s = min(host_per_call * calls * 1.2, 0.2)
        self.probes.append(calls)
        if calls <= self.depth and calls * self.host <= sleep_s:
            return calls * self.gpu, calls * self.host, sleep_s
        # Blocked (or the sleep was too short): host-bound from then on.
        extra = calls - min(calls, self.depth)
        host_s = max(sleep_s, min(calls, self.depth) * self.host) + extra * max(self.host, self.gpu)
        gpu_s = calls * max(self.host, self.gpu) if self.host > self.gpu else calls * self.gpu
        return gpu_s, host_s, sleep_s


def test_fit_window_stays_inside_the_launch_queue():
    gpu = FakeGpu(host_us=9.0, gpu_us=2.0, depth=1000)
    calls, host_per_call = _fit_window(gpu.probe, 2222, 0.02, 10000, 9e-6, backlog=True)
    assert 250 <= calls <= 1000
    # The final size was probed unblocked, with a sleep that covered it.
    assert gpu.probe(calls, host_per_call)[1] <= gpu.probe(calls, host_per_call)[2]


def test_fit_window_raises_a_low_host_estimate():
    gpu = FakeGpu(host_us=9.0, gpu_us=2.0, depth=100000)
    calls, host_per_call = _fit_window(gpu.probe, 500, 0.02, 10000, 3e-6, backlog=True)
    assert host_per_call >= 9e-6
    assert calls >= 250


def test_fit_window_long_kernels_hit_the_target():
    gpu = FakeGpu(host_us=10.0, gpu_us=1500.0)
    calls, _ = _fit_window(gpu.probe, 5, 0.02, 10000, 10e-6, backlog=True)
    assert calls == 13  # 20 ms / 1.5 ms
    assert len(gpu.probes) <= 3


def test_fit_window_ignores_host_noise_under_long_kernels():
    # The host outlasts its (tiny) sleep, but 13 matmuls keep the GPU busy far longer.
    def probe(calls, host_per_call):
        return calls * 1.5e-3, calls * 30e-6, calls * host_per_call * 1.2

    calls, host_per_call = _fit_window(probe, 13, 0.02, 10000, 5e-6, backlog=True)
    assert (calls, host_per_call) == (13, 5e-6)


def test_fit_window_without_backlog_only_targets_time():
    gpu = FakeGpu(host_us=9.0, gpu_us=2.0, depth=10)
    calls, _ = _fit_window(gpu.probe, 100, 0.02, 50000, 9e-6, backlog=False)
    assert calls > 1000  # nothing limits it but the time target (host-bound GPU time)


def test_bench_cpu_windows_and_rotation():
    calls = []
    sets = [("a", 0), ("b", 1), ("c", 2)]
    t = bench(lambda name, i: calls.append((name, i)), arg_sets=sets, windows=4, device="cpu", **FAST)
    assert isinstance(t, Timing)
    assert len(t.windows_us) == 4
    assert 1 <= t.calls_per_window <= 10000
    assert t.median_us == statistics.median(t.windows_us)
    assert all(w > 0 for w in t.windows_us)
    # Call i used set i % 3, warmup included, in order.
    assert calls == [sets[i % 3] for i in range(len(calls))]
    assert len(calls) >= 1 + 4 * t.calls_per_window


def test_bench_cpu_respects_max_calls():
    count = [0]

    def fn():
        count[0] += 1

    t = bench(fn, windows=3, max_calls_per_window=5, device="cpu", **FAST)
    assert t.calls_per_window == 5
    assert count[0] >= 3 * 5 + 1


def test_bench_cpu_measures_time():
    import time

    def slow():
        time.sleep(0.002)

    t = bench(slow, windows=3, warmup_ms=0.0, target_window_ms=4.0, device="cpu")
    assert 1500.0 < t.median_us < 50000.0
    assert t.calls_per_window in (1, 2, 3)


def test_bench_single_arg_set():
    seen = []
    bench(seen.append, arg_sets=[(7,)], windows=2, device="cpu", **FAST)
    assert set(seen) == {7}


def test_bench_rejects_bad_arguments():
    with pytest.raises(ValueError):
        bench(lambda: None, windows=0, device="cpu")
    with pytest.raises(ValueError):
        bench(lambda: None, arg_sets=[], device="cpu")
    with pytest.raises(ValueError):
        bench(lambda: None, max_calls_per_window=0, device="cpu")


def test_rotating_copies_fills_multiple_of_l2():
    a = torch.zeros(64, dtype=torch.float32)  # 256 bytes
    b = torch.ones(8, 16, dtype=torch.float16).t()  # 256 bytes, transposed
    scale = object()
    args = (a, 3, b, scale)
    sets = rotating_copies(args, l2_bytes=1000, min_multiple=3.0)
    # 3000 bytes at 512 per set: 6 sets.
    assert len(sets) == 6
    assert sets[0] is args or sets[0] == args
    assert sets[0][0] is a
    for s in sets[1:]:
        assert s[0] is not a and torch.equal(s[0], a)
        assert s[2] is not b and torch.equal(s[2], b) and s[2].stride() == b.stride()
        assert s[1] == 3 and s[3] is scale  # non-tensors are shared
    storages = {s[0].data_ptr() for s in sets} | {s[2].data_ptr() for s in sets}
    assert len(storages) == 12
    total = sum(t.numel() * t.element_size() for s in sets for t in s if isinstance(t, torch.Tensor))
    assert total >= 3 * 1000


def test_rotating_copies_bounds():
    a = torch.zeros(64, dtype=torch.float32)
    assert len(rotating_copies((a,), l2_bytes=10**9, max_sets=5)) == 5
    assert len(rotating_copies((a,), l2_bytes=10)) == 1  # already exceeds 3 x L2
    assert len(rotating_copies((a,), l2_bytes=256, min_multiple=1.0)) == 1  # exactly 1 x L2
    assert len(rotating_copies((1, "x"), l2_bytes=10**6)) == 1  # no tensors to rotate


@pytest.mark.gpu
@pytest.mark.overlap  # the back-to-back rate needs each launch queued, not run at once (as the sanitizers do)
def test_bench_sync_each_times_host_and_device_in_series():
    """With ``sync_each`` a call's time holds its host work and then its device work in series: a call that
    spends ~30 us on the host and then queues ~20 us of device work (as an op checks, then launches) takes
    >= 50 us a call, where back to back (no sync, no backlog) the device work hides under the next call's
    host time (~30 us). (The first form of this test queued the device work first, which then ran during
    the same call's host work: it passed on overheads alone.)"""
    import time

    from flydsl.autotune.timer import _sm_clock_hz

    cycles = int(_sm_clock_hz(torch, torch.device("cuda")) * 20e-6)  # ~20 us of GPU sleep

    def call():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 30e-6:
            pass
        torch.cuda._sleep(cycles)

    synced = bench(call, backlog=False, sync_each=True, **FAST).median_us
    rate = bench(call, backlog=False, **FAST).median_us
    assert synced > 48.0, synced
    assert rate < synced - 12.0, (rate, synced)
