"""A GPU timer that hides host launch overhead.

A kernel of a few microseconds launched from Python is often faster than the
host can enqueue it, so timing ``N`` back-to-back launches measures the host,
not the GPU. :func:`bench` therefore queues a ``torch.cuda._sleep`` ahead of
each timed window, long enough for the host to enqueue every launch of the
window while the GPU is still busy sleeping; the launches then run back to
back between two CUDA events. The driver queues only about a thousand
launches ahead, so for kernels faster than their launch a window is kept
small enough to fit the queue (measured, see :func:`_fit_window`). Several
windows are timed and the median is reported, which shrugs off a clock
change or a stray interrupt in one window. Windows run back to back, so the
result is sustained throughput: an 8192^3 bf16 GEMM on an H200 measured 1-13%
slower here than with ``triton.testing.do_bench``, which times single calls
with idle gaps between them (likely the clock the GPU holds under continuous
load; not verified).

:func:`rotating_copies` builds enough copies of the inputs that successive
calls do not find their data in L2 (rotate through them with ``arg_sets``).

Without CUDA (or with ``device="cpu"``) the same windowing runs on the host
clock, which serves the CPU interpreter and tests.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Timing", "bench", "rotating_copies"]

# H100/H200 boost clock; only used when the driver does not report one. A
# sleep sized with too high a clock lasts longer, which is the safe side.
_FALLBACK_SM_CLOCK_HZ = 1.98e9
# Margin on the measured host enqueue time, so the GPU is still sleeping when
# the last launch of the window is queued.
_BACKLOG_MARGIN = 1.2
# Upper bound on one sleep; a window that would need more host time than this
# is shrunk by _fit_window instead.
_MAX_SLEEP_S = 0.2


@dataclass(frozen=True)
class Timing:
    """Result of :func:`bench`.

    ``median_us`` is the median over windows of (window time / calls in the
    window); ``windows_us`` holds each window's per-call time.
    """

    median_us: float
    windows_us: tuple[float, ...]
    calls_per_window: int

    def __str__(self) -> str:
        return f"{self.median_us:.2f} us ({len(self.windows_us)} windows x {self.calls_per_window} calls)"


def _caller(fn: Callable[..., Any], arg_sets: Sequence[tuple] | None) -> Callable[[], Any]:
    """A zero-argument callable that rotates through ``arg_sets`` call by call."""
    if arg_sets is None:
        return fn
    sets = [tuple(s) for s in arg_sets]
    if not sets:
        raise ValueError("bench: arg_sets is empty")
    if len(sets) == 1:
        only = sets[0]
        return lambda: fn(*only)
    count = len(sets)
    state = [0]

    def call() -> Any:
        i = state[0]
        state[0] = i + 1
        return fn(*sets[i % count])

    return call


def _use_cuda(device: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def _calls_for(target_s: float, per_call_s: float, max_calls: int) -> int:
    return max(1, min(max_calls, round(target_s / max(per_call_s, 1e-9))))


def _warmup(call: Callable[[], Any], warmup_s: float, sync: Callable[[], None]) -> tuple[float, float, int]:
    """Run ``call`` for about ``warmup_s``; returns (host s per enqueue, synced s per call, last batch size).

    The first call is run on its own and not counted: it may compile. Then
    batches double in size, each followed by ``sync``, so a slow kernel is
    never queued a thousand times ahead of the clock.
    """
    call()
    sync()
    host_per_call = math.inf
    spent = 0.0
    batch = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(batch):
            call()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        # The smallest batches enqueue into an empty launch queue, so the min
        # is the host's own enqueue cost, not time spent blocked on the GPU.
        host_per_call = min(host_per_call, (t1 - t0) / batch)
        spent += t2 - t0
        if spent >= warmup_s:
            return host_per_call, (t2 - t0) / batch, batch
        batch *= 2


def _bench_host(call: Callable[[], Any], windows: int, target_s: float, warmup_s: float, max_calls: int) -> Timing:
    _, per_call, _ = _warmup(call, warmup_s, lambda: None)
    calls = _calls_for(target_s, per_call, max_calls)
    times = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return Timing(statistics.median(times), tuple(times), calls)


def _sm_clock_hz(torch: Any, device: Any) -> float:
    try:
        khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 0
    except Exception:  # noqa: BLE001 - an unknown clock only means the fallback estimate
        khz = 0
    return khz * 1e3 if khz > 0 else _FALLBACK_SM_CLOCK_HZ


def _fit_window(
    probe: Callable[[int, float], tuple[float, float, float]],
    first_calls: int,
    target_s: float,
    max_calls: int,
    host_per_call: float,
    backlog: bool,
    max_probes: int = 16,
) -> tuple[int, float]:
    """Calls per window: about ``target_s`` of GPU time, but no more than the host can queue ahead.

    ``probe(n, host_per_call)`` runs one backlogged window of ``n`` calls and
    returns (GPU seconds, host seconds spent enqueuing, seconds of GPU sleep
    queued ahead). Returns (calls, refined host seconds per call).

    A kernel slower than its launch keeps the GPU busy by itself (the GPU
    took longer than the host's enqueuing), so any size up to the target is
    fine. A kernel faster than its launch needs every launch of the window
    queued before the sleep ends. That fails when the host's estimate was
    low, or when the window has more launches than the driver's launch queue
    holds (about a thousand on current CUDA): the host then blocks until the
    GPU drains the queue, and the rest of the window runs at the host's pace.
    Either way the host outlasts the sleep, so the window is halved (and the
    host estimate raised) until it fits.
    """
    cap = max_calls
    calls = max(1, min(first_calls, cap))
    for _ in range(max_probes):
        gpu_s, host_s, sleep_s = probe(calls, host_per_call)
        if backlog and calls > 1 and host_s > sleep_s and host_s >= gpu_s:
            host_per_call = max(host_per_call, host_s / calls)
            cap = calls // 2
            calls = cap
            continue
        want = _calls_for(target_s, gpu_s / calls, cap)
        if want <= calls:
            return want, host_per_call
        calls = want  # grow toward the target, then check that size too
    return calls, host_per_call


def _bench_cuda(
    call: Callable[[], Any], windows: int, target_s: float, warmup_s: float, max_calls: int, backlog: bool,
    device: Any, sync_each: bool = False,
) -> Timing:  # fmt: skip
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    with torch.cuda.device(dev):
        sync = torch.cuda.synchronize
        if sync_each:  # each call's latency: it and its device work done before the next call starts
            backlog, unsynced = False, call

            def call() -> None:
                unsynced()
                sync()

        host_per_call, wall_per_call, _ = _warmup(call, warmup_s, sync)
        sleep = getattr(torch.cuda, "_sleep", None) if backlog else None
        clock_hz = _sm_clock_hz(torch, dev)

        def new_events() -> tuple[Any, Any]:
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def window(calls: int, host_per: float, start: Any, end: Any) -> tuple[float, float]:
            """Queue one window; returns (host seconds enqueuing, seconds of sleep ahead of it)."""
            sleep_s = 0.0
            if sleep is not None:
                # Keep the GPU busy while the host enqueues the window's launches.
                sleep_s = min(host_per * calls * _BACKLOG_MARGIN, _MAX_SLEEP_S)
                sleep(max(1, int(sleep_s * clock_hz)))
            start.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            host_s = time.perf_counter() - t0
            end.record()
            return host_s, sleep_s

        def probe(calls: int, host_per: float) -> tuple[float, float, float]:
            start, end = new_events()
            host_s, sleep_s = window(calls, host_per, start, end)
            sync()
            return start.elapsed_time(end) * 1e-3, host_s, sleep_s

        # The warmup's synced wall time is an upper bound on the GPU time per
        # call (it includes launch gaps), so the first probe is never too long.
        first = _calls_for(target_s, wall_per_call, max_calls)
        calls, host_per_call = _fit_window(probe, first, target_s, max_calls, host_per_call, sleep is not None)

        events = [new_events() for _ in range(windows)]
        for start, end in events:
            window(calls, host_per_call, start, end)
        sync()
    times = [s.elapsed_time(e) * 1e3 / calls for s, e in events]
    return Timing(statistics.median(times), tuple(times), calls)


def bench(
    fn: Callable[..., Any],
    *,
    arg_sets: Sequence[tuple] | None = None,
    windows: int = 5,
    target_window_ms: float = 20.0,
    warmup_ms: float = 25.0,
    max_calls_per_window: int = 10000,
    backlog: bool = True,
    device: Any = None,
    sync_each: bool = False,
) -> Timing:
    """Time ``fn`` and return the median per-call time over ``windows`` windows.

    ``fn()`` is called when ``arg_sets`` is None, else ``fn(*arg_sets[i % len(arg_sets)])``
    with ``i`` the running call count (warmup included), so consecutive calls
    rotate through the sets in order. Each window lasts about
    ``target_window_ms`` (between 1 and ``max_calls_per_window`` calls), less
    for kernels faster than their launch, whose windows must fit the launch
    queue (a few hundred to a thousand launches).

    On CUDA (``device`` None with a GPU visible, or a CUDA device) launches are
    timed between CUDA events; with ``backlog`` a ``torch.cuda._sleep`` queued
    ahead of each window hides the host's launch overhead. ``sync_each``
    synchronizes the device after every call (no backlog): the time is then
    each call's latency, host and device in series plus the synchronization's
    return, rather than the rate of back-to-back calls. Otherwise the host
    clock is used. Example::

        t = bench(lambda: torch.mm(a, b))
        print(t)  # "41.20 us (5 windows x 485 calls)"
    """
    if windows < 1:
        raise ValueError(f"bench: windows must be >= 1, got {windows}")
    if max_calls_per_window < 1:
        raise ValueError(f"bench: max_calls_per_window must be >= 1, got {max_calls_per_window}")
    call = _caller(fn, arg_sets)
    target_s, warmup_s = target_window_ms * 1e-3, warmup_ms * 1e-3
    if _use_cuda(device):
        return _bench_cuda(call, windows, target_s, warmup_s, max_calls_per_window, backlog, device, sync_each)
    return _bench_host(call, windows, target_s, warmup_s, max_calls_per_window)


def _tensor_bytes(args: tuple, tensor_type: type) -> int:
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, tensor_type))


def rotating_copies(args: tuple, l2_bytes: int, min_multiple: float = 3.0, max_sets: int = 64) -> list[tuple]:
    """``[args]`` plus clones, so rotating through them streams from memory, not L2.

    Tensor arguments are cloned (strides preserved), other arguments shared.
    Enough sets are made that their tensors total at least ``min_multiple *
    l2_bytes``, but never more than ``max_sets`` sets. Returns ``[args]`` when
    the tensors alone already exceed that, or when there are no tensors.

    Example::

        sets = rotating_copies((x, w, 1e-6), l2_bytes=50 * 2**20)
        bench(rms_norm, arg_sets=sets)
    """
    import torch

    if max_sets < 1:
        raise ValueError(f"rotating_copies: max_sets must be >= 1, got {max_sets}")
    args = tuple(args)
    per_set = _tensor_bytes(args, torch.Tensor)
    target = min_multiple * l2_bytes
    if per_set == 0 or per_set >= target:
        return [args]
    count = min(max_sets, math.ceil(target / per_set))
    copies = [args]
    for _ in range(count - 1):
        copies.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
    return copies
