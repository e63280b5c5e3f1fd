"""The benchmark harness every FlyDSL family uses (DESIGN.md sections 8, 9 and 11.11).

A benchmark is data: a :class:`Bench` names its cases, a ``setup`` that
builds one case's inputs, the providers to compare (ours and the peers a user
would pick instead), a bytes/flops model and, optionally, a generator of
unseen random shapes (``sweep``). :func:`run` then, per case,

1. builds the inputs and asks every provider for the zero-argument callable
   to time (a provider that cannot serve the case is *skipped*, with a reason);
2. runs every checked provider once and compares its output with the
   reference (``||out - ref|| / ||ref||``); a wrong provider is *failed* and
   never timed, so a fast wrong kernel cannot win a table;
3. takes each timing the bench names (``Bench.timings``) of each remaining
   provider with the runtime's timer (:func:`flydsl.autotune.timer.bench`,
   median over windows), the calls rotating over input copies when one set
   fits in L2 (so no call finds its data in L2):

   - ``gpu_us``: the GPU time: launches queued behind a GPU sleep (``backlog``),
     so the host's cost is hidden and back-to-back kernels are timed;
   - ``call_us``: one public call at a time, host included: the device drained
     before each call (``sync_each``), so a call's host work and its device
     work run in series, as ``triton.testing.do_bench`` sees a host-bound call;
   - ``step_us``: ``Provider.step``'s training step (forward + backward on a
     fresh graph), timed like ``call_us``; only for providers with a step;
   - ``host_us``: the per-call host cost: calls back to back with no backlog
     and no synchronization (one at the end of the window), for host-cost
     benches whose shapes are so small that the host dominates;
4. derives GB/s and TFLOP/s from ``gpu_us`` and the model, the fraction of the
   ceilings measured in the same run (:func:`measure_ceilings`) and, for each
   of our providers and each timing, the ratio best peer / ours.

Timer settings (windows x target window length, warmup; each timing reports the
median window):

========  ==============================  ==============================
profile   gpu                             call, step, host
========  ==============================  ==============================
full      5 x 20 ms, 25 ms warmup         5 x 10 ms, 10 ms warmup
sweep     3 x 5 ms, 5 ms warmup           3 x 5 ms, 5 ms warmup
quick     3 x 5 ms, 5 ms warmup           3 x 5 ms, 5 ms warmup
========  ==============================  ==============================

The tuned set runs ``full`` (``quick`` under ``--quick``); a sweep runs
``sweep``: its many shapes trade a little noise a shape for a bounded run, and
its verdict is a distribution, not one shape's number. A synchronized call
costs tens of microseconds at least, so 10 ms windows still hold hundreds of
calls on small shapes; on large ones a window is a few calls and the median
over five windows absorbs a stray one. By the settings' arithmetic (warmup,
one or two probe windows, the timed windows) a (case, provider) costs about
0.2 s for gpu and 0.1 s for each other timing under ``full``, and about
0.03 s a timing under ``sweep``; setup, checks and compilation come on top
(a ``torch.compile`` peer compiles once a shape). ``Bench.timer_kwargs`` and
``run(timer_kwargs=...)`` override the window settings of every timing; the
mode keys (``backlog``, ``sync_each``) are each timing's own, except that
``Bench.timer_kwargs`` may still set them for the gpu timing.

:class:`Results` prints a table and writes JSON, markdown and a PNG plot;
:func:`main_for` is the command line every family's ``benchmarks/run.py``
calls (``--sweep``: the unseen-shape sweep too).

Where things live: the spec types (:class:`Bench`, :class:`Case`,
:class:`Provider`, :class:`Skip`, :class:`CompiledPeer`) in
:mod:`flydsl_common.bench.spec`, the command line (:func:`main_for`,
:func:`results_dir`) in :mod:`flydsl_common.bench.cli`, the result types and
their tables, JSON and plots in :mod:`flydsl_common.bench.results`; this
module checks and times (ceilings, :func:`run`, the sweep, :func:`write_all`)
and re-exports the others' public names, so every name in ``__all__`` imports
from here as from :mod:`flydsl_common.bench`. Example::

    spec = Bench(
        name="vec_add",
        cases=[Case(f"n={n}", {"n": n}) for n in (1 << 20, 1 << 24)],
        setup=lambda case, dev: tuple(torch.randn(case.params["n"], device=dev) for _ in range(3)),
        providers=[
            Provider("flydsl", lambda t: lambda: vec_add(t[0], t[1], out=t[2]), is_ours=True),
            Provider("torch.add", lambda t: lambda: torch.add(t[0], t[1], out=t[2])),
        ],
        bytes=lambda case: 12 * case.params["n"],
        reference=lambda t: vec_add_ref(t[0], t[1]),
        tolerance=1e-6,
        x_param="n",
        sweep=lambda rng, count: [Case(f"n={n}", {"n": n}) for n in (rng.randrange(1, 1 << 24) for _ in range(count))],
        timings=("gpu", "call"),
    )
    results = run(spec, out_dir="benchmarks/results")
"""

from __future__ import annotations

import datetime
import gc
import math
import platform
import random
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

import flydsl.arch  # flydsl picks compiled vs interpreted Triton before anything imports triton
from flydsl.autotune.timer import Timing, rotating_copies
from flydsl.autotune.timer import bench as timer_bench
from flydsl.errors import ArgumentError
from flydsl.testing import default_device, rel_error

from .results import (
    COPY_GBPS,
    ERROR,
    FAILED,
    MATMUL_BF16_TFLOPS,
    OK,
    SKIPPED,
    TIMINGS,
    BenchResult,
    Results,
    Row,
    ratio_stats,
    summarize,
)
from .spec import Bench, Case, CompiledPeer, GradCheck, Provider, Skip

__all__ = [
    "COPY_GBPS",
    "MATMUL_BF16_TFLOPS",
    "TIMINGS",
    "Bench",
    "BenchResult",
    "Case",
    "CompiledPeer",
    "GradCheck",
    "Provider",
    "Results",
    "Row",
    "Skip",
    "copy_gbps",
    "distinct_cases",
    "log_uniform",
    "environment",
    "gpu_slug",
    "main_for",
    "measure_ceilings",
    "ratio_stats",
    "results_dir",
    "run",
    "results_path",
    "run_sweep",
    "summarize",
    "sweep_cases",
    "sweep_counts",
    "timer_bench",
    "write_all",
]

# Timer settings per profile and timing (the table in the module docstring says why).
_TIMER_FULL = {"windows": 5, "target_window_ms": 20.0, "warmup_ms": 25.0}
_TIMER_QUICK = {"windows": 3, "target_window_ms": 5.0, "warmup_ms": 5.0}
_TIMER_CALL = {"windows": 5, "target_window_ms": 10.0, "warmup_ms": 10.0}
PROFILES = {
    "full": {"gpu": _TIMER_FULL, "call": _TIMER_CALL, "step": _TIMER_CALL, "host": _TIMER_CALL},
    "sweep": {t: _TIMER_QUICK for t in TIMINGS},
    "quick": {t: _TIMER_QUICK for t in TIMINGS},
}
# Each timing's mode of the timer: gpu behind a backlog; call and step one synchronized call at a time;
# host back to back with neither (one synchronization a window).
_MODES = {
    "gpu": {"backlog": True, "sync_each": False},
    "call": {"backlog": False, "sync_each": True},
    "step": {"backlog": False, "sync_each": True},
    "host": {"backlog": False, "sync_each": False},
}
_MODE_KEYS = ("backlog", "sync_each")
DEFAULT_SWEEP_COUNT = 60  # per family, split over the benches that have a sweep (sweep_counts)


# ----------------------------------------------------------------- ceilings


def _resolve_device(device: Any) -> torch.device:
    return default_device() if device is None else torch.device(device)


def copy_gbps(moved_bytes: int, device: Any = None, **timing) -> float:
    """GB/s (1e9 bytes/s of reads plus writes) of a device copy moving ``moved_bytes`` in all
    (``dst.copy_(src)``, each half the bytes). On a GPU the calls rotate over copies when one pair fits
    in L2, so the copy streams from memory at any size; ``timing``: the timer's settings."""
    dev = _resolve_device(device)
    src = torch.randint(-(2**31), 2**31 - 1, (max(1, moved_bytes // 8),), dtype=torch.int32, device=dev)
    l2 = flydsl.arch.current(dev).l2_bytes if dev.type == "cuda" else 0
    sets = rotating_copies((src, torch.empty_like(src)), l2)
    t = timer_bench(lambda s, d: d.copy_(s), arg_sets=sets, device=dev, **timing)
    return 8 * src.numel() / t.median_us / 1e3


def measure_ceilings(device: Any = None, *, copy: bool = True, matmul: bool = True, quick: bool = False) -> dict:
    """Measure the two ceilings results are reported against, on ``device`` in this run.

    - ``copy_gbps``: a device-to-device copy of 1 GiB (2 GiB moved: bytes read
      plus bytes written) in GB/s (1e9 bytes/s);
    - ``matmul_bf16_tflops``: ``torch.matmul`` (cuBLAS) of 8192x8192x8192 bf16
      on random data (zeros run faster than real data) in TFLOP/s.

    On the CPU the same keys are computed at small sizes (64 MiB moved,
    512^3 matmul) so the plumbing runs; they are *not* ceilings of anything a
    GPU kernel does (``meaningful`` is False). ``copy=False`` / ``matmul=False``
    skip one (its key is None). ``quick`` shortens the timing, not the sizes.
    """
    dev = _resolve_device(device)
    on_gpu = dev.type == "cuda"
    timing = _TIMER_QUICK if quick else _TIMER_FULL
    out: dict[str, Any] = {COPY_GBPS: None, MATMUL_BF16_TFLOPS: None, "meaningful": on_gpu}
    if copy:
        moved = (2 << 30) if on_gpu else (64 << 20)  # on a GPU far past L2
        out[COPY_GBPS] = copy_gbps(moved, dev, **timing)
        out["copy_bytes"] = moved
    if matmul:
        n = 8192 if on_gpu else 512
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
        t = timer_bench(lambda: torch.matmul(a, b, out=c), device=dev, **timing)
        out[MATMUL_BF16_TFLOPS] = 2 * n**3 / t.median_us / 1e6
        out["matmul_shape"] = [n, n, n]
        del a, b, c
    if not on_gpu:
        out["note"] = "measured on the CPU at small sizes: not ceilings of any GPU kernel"
    _release(dev)
    return out


# ---------------------------------------------------------------------- run


def _versions() -> dict:
    found = {}
    for dist, module in (
        ("torch", "torch"),
        ("triton", "triton"),
        ("flydsl-runtime", "flydsl"),
        ("flydsl-common", "flydsl_common"),
    ):
        try:
            found[module] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            mod = sys.modules.get(module)
            found[module] = getattr(mod, "__version__", "unknown")
    return found


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def environment(device: Any = None) -> dict:
    """Identity of the machine and software the numbers belong to."""
    dev = _resolve_device(device)
    arch = flydsl.arch.current(dev)
    return {
        "device_name": arch.device_name,
        "arch": arch.name,
        "backend": arch.backend,
        "sm_count": arch.sm_count,
        "l2_bytes": arch.l2_bytes,
        "memory_bytes": arch.memory_bytes,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "python": platform.python_version(),
        "versions": _versions(),
        "date": _now(),
    }


def _release(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def _matches(name: str, wanted: Iterable[str] | Callable[[str], bool] | None) -> bool:
    if wanted is None:
        return True
    if callable(wanted):
        return bool(wanted(name))
    return name.lower() in {w.lower() for w in wanted}


def _short(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _make(provider: Provider, inputs: Any) -> tuple[Callable[[], Any] | None, str, str]:
    """(callable, status, reason): a provider that cannot serve the case is skipped, one that crashes errors."""
    try:
        fn = provider.make(inputs)
    except Skip as e:
        return None, SKIPPED, str(e) or "cannot serve this case"
    except Exception as e:  # noqa: BLE001 - a crash of ours or a peer must show in the table, not end the run
        return None, ERROR, f"make: {_short(e)}"
    if fn is None:
        return None, SKIPPED, "cannot serve this case"
    return fn, OK, ""


def _rotated_calls(
    factory: Callable[[Any], Callable[[], Any] | None], fn: Callable[[], Any], sets: list | None
) -> tuple[Callable[..., Any], list[tuple] | None]:
    """What to hand the timer: ``fn`` alone, or one callable per input copy (``factory(copy)``) rotated through
    ``arg_sets``."""
    if not sets or len(sets) < 2:
        return fn, None
    fns = [fn] + [factory(s) for s in sets[1:]]
    if any(f is None for f in fns):  # a provider that serves one copy serves all; be safe anyway
        return fn, None
    return (lambda f: f()), [(f,) for f in fns]


def _input_sets(bench: Bench, inputs: Any, dev: torch.device, l2_bytes: int) -> list | None:
    # On the CPU the times are host times of the interpreter: rotating there
    # only costs memory. Non-tuple inputs are the spec's to size past L2.
    if not bench.rotate or dev.type != "cuda" or l2_bytes <= 0 or not isinstance(inputs, tuple):
        return None
    if not any(isinstance(a, torch.Tensor) for a in inputs):
        return None
    return rotating_copies(inputs, l2_bytes)


def _tolerance(bench: Bench, case: Case) -> float:
    return float(bench.tolerance(case)) if callable(bench.tolerance) else float(bench.tolerance)


def _settings(profile: dict, timing: str, run_kwargs: dict, bench: Bench) -> dict:
    """The timer's keyword arguments for one timing: the profile's windows, the run's and the bench's
    overrides, then the timing's own mode (the bench may still set the gpu timing's mode)."""
    settings = {**profile[timing], **run_kwargs, **bench.timer_kwargs}
    mode = dict(_MODES[timing])
    if timing == "gpu":
        mode.update({k: v for k, v in bench.timer_kwargs.items() if k in _MODE_KEYS})
    return {**settings, **mode}


@dataclass
class _Job:
    """One timing of one provider: what the timer gets."""

    row: Row
    timing: str
    call: Callable[..., Any]
    arg_sets: list[tuple] | None
    settings: dict
    windows: list[float] = field(default_factory=list)
    calls: int = 0


def _record(job: _Job, t: Timing) -> None:
    """A timing into its row (rates come later, from gpu_us)."""
    row, key = job.row, job.timing
    setattr(row, f"{key}_us", float(t.median_us))
    row.windows_us[key] = [float(w) for w in t.windows_us]
    row.calls_per_window[key] = int(t.calls_per_window)
    if t.median_us > 0:
        row.spread[key] = (max(t.windows_us) - min(t.windows_us)) / t.median_us


def _note(row: Row, text: str) -> None:
    row.reason = f"{row.reason}; {text}" if row.reason else text


def _time_job(job: _Job, dev: torch.device, settings: dict) -> Timing | None:
    """Run the timer; a Skip drops this timing with a note (the whole row is skipped when nothing was timed
    yet and the callable is ``make``'s), any other exception makes the row an error. The values already
    recorded stay: a provider whose step raises keeps its gpu and call times."""
    try:
        return timer_bench(job.call, arg_sets=job.arg_sets, device=dev, **settings)
    except Skip as e:
        row = job.row
        if job.timing != "step" and all(row.us(t) is None for t in TIMINGS):  # an unchecked provider's first call
            row.status, row.reason = SKIPPED, str(e) or "cannot serve this case"
        else:
            _note(row, f"{job.timing} skipped: {e}" if str(e) else f"{job.timing} skipped")
    except Exception as e:  # noqa: BLE001 - recorded as an error row, the other providers and timings go on
        job.row.status = ERROR
        _note(job.row, f"{job.timing}: {_short(e)}")
    return None


def _jobs(
    bench: Bench, p: Provider, row: Row, fn: Callable[[], Any], inputs: Any, sets: list, profile: dict, kw: dict
) -> list[_Job]:
    """The timings of one checked provider, in the bench's order ("step" only when the provider has one).
    The timings of ``make``'s callable share one set of rotated callables."""
    jobs = []
    rotated = None
    for key in bench.timings:
        if key == "step":
            if p.step is None:
                continue
            try:
                step = p.step(inputs)
            except Skip as e:
                _note(row, f"step skipped: {e}" if str(e) else "step skipped")
                continue
            except Exception as e:  # noqa: BLE001 - a step that cannot be built is an error of this provider
                row.status = ERROR
                _note(row, f"step: {_short(e)}")
                continue
            if step is None:
                continue
            call, arg_sets = _rotated_calls(p.step, step, sets)
        else:
            rotated = rotated or _rotated_calls(p.make, fn, sets)
            call, arg_sets = rotated
        jobs.append(_Job(row, key, call, arg_sets, _settings(profile, key, kw, bench)))
    return jobs


def _check(bench: Bench, case: Case, p: Provider, row: Row, fn: Callable[[], Any], inputs: Any, ref_box: list) -> bool:
    """Run ``fn`` once against the reference; False (the row failed) when its error passes the tolerance."""
    if ref_box[0] is None:
        ref_box[0] = bench.reference(inputs)
    if bench.poison is not None:
        bench.poison(inputs)
    ret = fn()
    extract = p.output or bench.output
    out = extract(ret) if extract is not None else ret
    row.tolerance = _tolerance(bench, case)
    row.rel_error = rel_error(out, ref_box[0])
    del ret, out
    if not (row.rel_error <= row.tolerance):  # written so NaN fails
        row.status = FAILED
        row.reason = f"relative error {row.rel_error:.3e} > tolerance {row.tolerance:.1e}"
        return False
    return True


def _run_case(
    bench: Bench, case: Case, providers: list[Provider], dev: torch.device, profile: dict, kw: dict,
    ceilings: dict, l2: int,
) -> list[Row]:  # fmt: skip
    try:
        inputs = bench.setup(case, dev)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory at one size: the other cases still run
        reason = f"setup: {_short(e)}"
        _release(dev)
        return [Row(case.name, dict(case.params), p.name, p.is_ours, False, ERROR, reason) for p in providers]
    model_bytes = int(bench.bytes(case)) if bench.bytes is not None else None
    model_flops = int(bench.flops(case)) if bench.flops is not None else None
    rows: list[Row] = []
    pending: list[_Job] = []  # with bench.interleave: every job, timed round by round below
    ref_box: list = [None]
    sets = None
    for p in providers:
        checked = p.check and bench.reference is not None
        row = Row(case.name, dict(case.params), p.name, p.is_ours, checked, OK, bytes=model_bytes, flops=model_flops)
        rows.append(row)
        fn, row.status, row.reason = _make(p, inputs)
        if fn is None:
            continue
        try:
            if checked and not _check(bench, case, p, row, fn, inputs, ref_box):
                continue  # a wrong provider is never timed
            if sets is None:
                sets = _input_sets(bench, inputs, dev, l2) or []
            jobs = _jobs(bench, p, row, fn, inputs, sets, profile, kw)
        except Skip as e:  # e.g. a compiled peer that only fails when first called
            row.status, row.reason = SKIPPED, str(e) or "cannot serve this case"
            continue
        except Exception as e:  # noqa: BLE001 - same: recorded as an error row, the other providers still run
            row.status, row.reason = ERROR, _short(e)
            continue
        if bench.interleave > 0:
            pending += jobs
            continue
        for job in jobs:
            if row.status != OK:  # a timing raised or skipped the provider: its other timings would too
                break
            t = _time_job(job, dev, job.settings)
            if t is not None:
                _record(job, t)
    _interleaved(pending, bench.interleave, dev)
    for row in rows:
        _rates(row, bench, ceilings)
    _speedups(rows)
    del inputs, sets, ref_box
    _release(dev)
    return rows


def _interleaved(jobs: list[_Job], rounds: int, dev: torch.device) -> None:
    """Time ``jobs`` in ``rounds`` rounds of one window each, job after job within a round; each time is
    the median over its rounds (its windows: one a round). A job that raises leaves the rounds (its row's
    other timings stay in them)."""
    if not jobs:
        return
    live = list(jobs)
    for _ in range(rounds):
        for job in list(live):
            t = _time_job(job, dev, {**job.settings, "windows": 1})
            if t is None:
                live.remove(job)
                continue
            job.windows.extend(t.windows_us)
            job.calls = t.calls_per_window
    for job in live:
        if job.windows:
            _record(job, Timing(statistics.median(job.windows), tuple(job.windows), job.calls))


def _rates(row: Row, bench: Bench, ceilings: dict) -> None:
    if not row.gpu_us or row.gpu_us <= 0:
        return
    if row.bytes is not None:
        row.gbps = row.bytes / row.gpu_us / 1e3  # bytes/us -> GB/s (1e9)
        if ceilings.get(COPY_GBPS):
            row.bw_fraction = row.gbps / ceilings[COPY_GBPS]
    if row.flops is not None:
        row.tflops = row.flops / row.gpu_us / 1e6  # flop/us -> TFLOP/s (1e12)
        if ceilings.get(bench.flops_ceiling):
            row.flops_fraction = row.tflops / ceilings[bench.flops_ceiling]


def _speedups(rows: list[Row]) -> None:
    """Per timing: each of our rows gets the fastest peer's time over its own, and that peer's name.
    Only measured times count (a failed check is never timed)."""
    for key in TIMINGS:
        peers = [r for r in rows if not r.is_ours and r.us(key)]
        if not peers:
            continue
        best = min(peers, key=lambda r: r.us(key))
        for r in rows:
            if r.is_ours and r.us(key):
                r.speedups[key] = best.us(key) / r.us(key)
                r.best_peers[key] = best.provider


def _progress_line(bench: Bench, case: Case, rows: list[Row]) -> str:
    """One line a finished case: each of our providers' times and ratios (call and step first), and
    what failed."""
    parts = []
    for r in rows:
        if r.is_ours and r.status in (OK, ERROR):
            one_peer = len(set(r.best_peers.values())) == 1
            times = []
            for t in TIMINGS:
                if r.us(t) is None:
                    continue
                ratio = f" {r.speedups[t]:.3g}x" if t in r.speedups else ""
                peer = f" vs {r.best_peers[t]}" if t in r.best_peers and not one_peer else ""
                times.append(f"{t} {r.us(t):.1f} us{ratio}{peer}")
            vs = f" (vs {next(iter(r.best_peers.values()))})" if one_peer else ""
            parts.append(f"{r.provider} " + (", ".join(times) or "not timed") + vs)
    bad = [f"{r.provider} {r.status.upper()}" for r in rows if r.status in (FAILED, ERROR)]
    if not parts:
        first = bench.timings[0]
        times = [f"{r.provider} {first} {r.us(first):.1f} us" for r in rows if r.us(first) is not None]
        parts.append(", ".join(times) or "nothing timed")
    return f"{bench.name}: {case.name}: " + "; ".join(parts) + (f" [{', '.join(bad)}]" if bad else "")


def run(
    bench: Bench | Sequence[Bench],
    *,
    device: Any = None,
    out_dir: str | Path | None = None,
    ceilings: dict | None = None,
    quick: bool = False,
    providers: Iterable[str] | Callable[[str], bool] | None = None,
    cases: Iterable[str] | Callable[[str], bool] | None = None,
    stem: str | None = None,
    timer_kwargs: dict | None = None,
    progress: Callable[[str], None] | None = None,
    profile: str | None = None,
    on_bench: Callable[[Results], None] | None = None,
) -> Results:
    """Check, time and rate every (case, provider) of ``bench`` (one spec or several).

    Args:
        device: where to run (default: the GPU when kernels compile, else the CPU).
        out_dir: when given, :func:`write_all` writes ``<stem>.json|md|png`` there.
        ceilings: ``None`` measures them now (:func:`measure_ceilings`); pass
            a dict to reuse measured ones, ``{}`` to skip them (no fractions).
        quick: the spec's quick cases and the quick timer profile (a smoke run).
        providers / cases: keep only these names (case-insensitive), or a predicate on the name.
        timer_kwargs: overrides of every timing's window settings (windows, target_window_ms, warmup_ms, ...).
        progress: called with one line per case as it finishes, with its times and ratios (e.g. ``print``).
        profile: the timer profile ("full", "sweep", "quick"; default "quick" when ``quick``, else "full").
        on_bench: called with the results so far after each bench (e.g. to write them, so that a run cut
            short keeps the benches it finished).

    Returns:
        :class:`Results`; a failed check shows as status ``failed`` (not timed),
        a provider that cannot serve a case as ``skipped`` with the reason.
    """
    specs = [bench] if isinstance(bench, Bench) else list(bench)
    dev = _resolve_device(device)
    profile = profile or ("quick" if quick else "full")
    if profile not in PROFILES:
        raise ArgumentError(f"run: profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    if ceilings is None:
        ceilings = measure_ceilings(dev, quick=quick)
    env = environment(dev)
    l2 = int(env.get("l2_bytes") or 0)
    results = Results(env=env, ceilings=dict(ceilings), benches=[])
    for spec in specs:
        chosen = [p for p in spec.providers if _matches(p.name, providers)]
        rows: list[Row] = []
        for case in spec.select_cases(quick):
            if not _matches(case.name, cases):
                continue
            done = _run_case(spec, case, chosen, dev, PROFILES[profile], dict(timer_kwargs or {}), results.ceilings, l2)
            rows += done
            if progress is not None:
                progress(_progress_line(spec, case, done))
        results.benches.append(
            BenchResult(
                spec.name, spec.x_param, spec.metric, list(spec.group_by), spec.description, rows, list(spec.timings),
                date=_now(),
            )
        )
        if on_bench is not None:
            on_bench(results)
    if out_dir is not None:
        write_all(results, out_dir, stem)
    return results


# -------------------------------------------------------------------- sweep


def sweep_counts(benches: Sequence[Bench], count: int) -> dict[str, int]:
    """How a family's sweep ``count`` is split: each bench with a ``sweep`` gets ``ceil(count / k)`` shapes
    (k: the number of such benches), so every bench gets the same share and the total is >= ``count``."""
    if count < 1:
        raise ArgumentError(f"sweep_counts: count must be >= 1, got {count}")
    with_sweep = [b for b in benches if b.sweep is not None]
    if not with_sweep:
        return {}
    share = math.ceil(count / len(with_sweep))
    return {b.name: share for b in with_sweep}


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An int drawn log-uniformly from [lo, hi] (lo >= 1): sizes spread evenly over the octaves, the sweeps'
    draw."""
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def distinct_cases(count: int, draw: Callable[[], Case], what: str) -> list[Case]:
    """``count`` cases of distinct names from repeated ``draw()`` calls (a sweep's generator, drawing from its
    rng), in the order drawn; a ValueError naming ``what`` when 100 draws a case (plus 100) do not find them."""
    cases: list[Case] = []
    seen: set[str] = set()
    for _ in range(100 * count + 100):
        if len(cases) >= count:
            return cases
        case = draw()
        if case.name not in seen:
            seen.add(case.name)
            cases.append(case)
    if len(cases) >= count:
        return cases
    raise ValueError(f"{what}: cannot draw {count} distinct cases")


def sweep_cases(bench: Bench, seed: int, count: int) -> list[Case]:
    """``bench.sweep``'s cases for ``seed``: its generator gets ``random.Random(f"{seed}:{bench.name}")``, so
    one seed repeats every bench's shapes, and each bench's draws do not depend on the others'."""
    if bench.sweep is None:
        raise ArgumentError(f"sweep_cases: bench {bench.name!r} has no sweep (Bench.sweep is None)")
    drawn = bench.sweep(random.Random(f"{seed}:{bench.name}"), count)
    drawn = list(drawn) if drawn is not None else []
    if not all(isinstance(c, Case) for c in drawn):
        kinds = sorted({type(c).__name__ for c in drawn if not isinstance(c, Case)})
        raise ArgumentError(f"Bench {bench.name!r}: sweep must return a list of Case, got items of {', '.join(kinds)}")
    if len(drawn) != count:
        raise ArgumentError(f"Bench {bench.name!r}: sweep was asked for {count} cases, returned {len(drawn)}")
    return drawn


def run_sweep(benches: Bench | Sequence[Bench], *, seed: int, count: int = DEFAULT_SWEEP_COUNT, **kwargs) -> Results:
    """:func:`run` over the sweeps of ``benches`` (those without one are left out): ``count`` random shapes
    split by :func:`sweep_counts`, drawn by :func:`sweep_cases` from ``seed``, timed with the "sweep" profile.
    ``kwargs`` go to :func:`run` (``quick`` is ignored: a sweep has no quick cases). The seed, count and
    cases per bench are kept in ``Results.sweep`` (and the JSON)."""
    specs = [benches] if isinstance(benches, Bench) else list(benches)
    counts = sweep_counts(specs, count)
    swept = []
    for b in specs:
        if b.name in counts:
            drawn = sweep_cases(b, seed, counts[b.name])
            swept.append(replace(b, cases=drawn, quick_cases=drawn))
    kwargs.pop("quick", None)
    out_dir, stem = kwargs.pop("out_dir", None), kwargs.pop("stem", None)
    kwargs.setdefault("profile", "sweep")
    info = {"seed": seed, "count": count, "cases_per_bench": counts}
    user_on_bench = kwargs.pop("on_bench", None)

    def on_bench(partial: Results) -> None:
        partial.sweep = info
        if user_on_bench is not None:
            user_on_bench(partial)

    results = run(swept, on_bench=on_bench, **kwargs)
    results.sweep = info
    if out_dir is not None:
        write_all(results, out_dir, stem)
    return results


# ------------------------------------------------------------------ outputs


def gpu_slug(device_name: str, limit: int = 40) -> str:
    """File-name form of a device name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return slug[:limit].rstrip("-") or "device"


def results_path(results: Results, out_dir: str | Path, stem: str | None = None) -> Path:
    """Where :func:`write_all` puts ``results``' JSON: ``<out_dir>/<stem>.json``, stem default the device
    slug, with ``-sweep`` after it for a sweep's results."""
    stem = stem or gpu_slug(str(results.env.get("device_name", "device")))
    return Path(out_dir) / f"{stem}{'-sweep' if results.sweep else ''}.json"


def write_all(results: Results, out_dir: str | Path, stem: str | None = None) -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` (stem default: the device slug; a sweep's results
    get ``-sweep`` after the stem, beside the tuned set's); returns the paths.

    The PNG is skipped with a message when matplotlib is missing (it is the
    ``bench`` extra), so a results file is never lost to a plotting problem.
    """
    json_path = results_path(results, out_dir, stem)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    paths = {"json": results.to_json(json_path)}
    paths["md"] = json_path.with_suffix(".md")
    results.to_markdown(paths["md"])
    try:
        paths["png"] = results.plot(json_path.with_suffix(".png"))
    except ImportError as e:
        print(f"plot skipped: {e} (pip install matplotlib)", file=sys.stderr)
    except ValueError as e:  # nothing timed to draw (every provider skipped or failed): the tables say why
        print(f"plot skipped: {e}", file=sys.stderr)
    return paths


# The command line is built on this module (it imports run, run_sweep and the ceilings from here), so its
# names are re-exported last, once everything it takes from here is defined.
from .cli import main_for, results_dir  # noqa: E402
