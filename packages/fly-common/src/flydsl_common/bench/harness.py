"""The benchmark harness every FlyDSL family uses (DESIGN.md sections 8, 9 and 11.11).

A benchmark is data: a :class:`Bench` names its cases, a ``setup`` that
builds one case's inputs, the providers to compare (ours and the peers a user
would pick instead) and a bytes/flops model. :func:`run` then, per case,

1. builds the inputs and asks every provider for the zero-argument callable
   to time (a provider that cannot serve the case is *skipped*, with a reason);
2. runs every checked provider once and compares its output with the
   reference (``||out - ref|| / ||ref||``); a wrong provider is *failed* and
   never timed, so a fast wrong kernel cannot win a table;
3. times each remaining provider with the runtime's timer (median of
   event-timed windows behind a GPU backlog), rotating input copies when one
   set fits in L2;
4. derives GB/s and TFLOP/s from the model, the fraction of the ceilings
   measured in the same run (:func:`measure_ceilings`) and, for each of our
   providers, the speedup over the best peer.

:class:`Results` prints a table and writes JSON, markdown and a PNG plot;
:func:`main_for` is the command line every family's ``benchmarks/run.py``
calls. Example::

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
    )
    results = run(spec, out_dir="benchmarks/results")
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

import flydsl.arch  # flydsl picks compiled vs interpreted Triton before anything imports triton
from flydsl.autotune.timer import Timing, rotating_copies
from flydsl.autotune.timer import bench as timer_bench
from flydsl.testing import default_device, rel_error

from .results import (
    COPY_GBPS,
    ERROR,
    FAILED,
    MATMUL_BF16_TFLOPS,
    OK,
    SKIPPED,
    BenchResult,
    Results,
    Row,
)

__all__ = [
    "COPY_GBPS",
    "MATMUL_BF16_TFLOPS",
    "Bench",
    "BenchResult",
    "Case",
    "CompiledPeer",
    "Provider",
    "Results",
    "Row",
    "Skip",
    "copy_gbps",
    "environment",
    "gpu_slug",
    "main_for",
    "measure_ceilings",
    "results_dir",
    "run",
    "timer_bench",
    "write_all",
]

# Timer settings. Quick runs only check the plumbing, so they time briefly.
_TIMER_FULL = {"windows": 5, "target_window_ms": 20.0, "warmup_ms": 25.0}
_TIMER_QUICK = {"windows": 3, "target_window_ms": 5.0, "warmup_ms": 5.0}



# --------------------------------------------------------------------- spec


class Skip(Exception):
    """Raised by ``Provider.make`` (or its callable's first call) when it cannot serve a case.

    The message is the reason shown in the results.
    """


@dataclass(frozen=True)
class Case:
    """One problem of a benchmark: a display name and the parameters ``setup`` reads.

    ``params["quick"] = True`` marks the cases ``--quick`` runs (unless the
    spec gives ``quick_cases``).
    """

    name: str
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Provider:
    """One implementation to time.

    ``make(inputs)`` returns the zero-argument callable to time, or None (or
    raises :class:`Skip` with a reason) when this provider cannot serve the
    case. ``is_ours`` marks FlyDSL providers (they get a speedup over the
    best peer). ``check`` runs the output against the reference once before
    timing. ``output`` overrides the spec's ``output`` extractor for this
    provider (a peer may return its result in another layout).
    """

    name: str
    make: Callable[[Any], Callable[[], Any] | None]
    is_ours: bool = False
    check: bool = True
    output: Callable[[Any], torch.Tensor] | None = None


@dataclass(frozen=True)
class Bench:
    """A benchmark: cases, inputs, providers and the model of the minimum work.

    - ``setup(case, device) -> inputs``: any object the providers understand.
      Use random data, never zeros (zeros hide unwritten outputs and can run
      faster than real data).
    - ``bytes(case)``: the fewest bytes the op must move (each input read
      once, each output written once); gives GB/s and the bandwidth fraction.
    - ``flops(case)``: the arithmetic the op must do; gives TFLOP/s and the
      fraction of ``ceilings[flops_ceiling]``.
    - ``reference(inputs) -> Tensor``, ``output(ret) -> Tensor`` (default:
      the return value itself) and ``tolerance`` (a float or ``case -> float``)
      check every provider with ``check=True`` once per case.
    - ``poison(inputs)``: called before each check run to fill preallocated
      outputs with values no kernel writes, so unwritten elements fail.
    - ``rotate``: when ``inputs`` is a tuple of tensors (and other values)
      smaller than L2, the timed calls rotate over copies from
      ``rotating_copies`` (``make`` is called once per copy). Inputs of any
      other type are not rotated: size them past L2 in ``setup``.
    - ``x_param``: the case parameter on the plot's x axis (log2 when numeric);
      ``group_by``: parameters that split the cases into separate panels
      (e.g. ``("mode", "dtype")``).
    - ``quick_cases``: the cases of ``--quick`` (default: those with
      ``params["quick"]``, else the first case).
    - ``timer_kwargs``: this bench's timer settings over the run's; ``{"backlog":
      False}`` measures end-to-end call latency (host + device) instead of GPU time.
    - ``interleave``: when > 0, a case's providers are timed in that many rounds
      of one window each, provider after provider within a round, and each
      provider's time is the median over its rounds: a host whose speed drifts
      (host-bound latency benches) then slows every provider alike, where
      timing one provider's windows after another's puts the drift between them.
    """

    name: str
    cases: list[Case]
    setup: Callable[[Case, Any], Any]
    providers: list[Provider]
    bytes: Callable[[Case], int] | None = None
    flops: Callable[[Case], int] | None = None
    reference: Callable[[Any], torch.Tensor] | None = None
    output: Callable[[Any], torch.Tensor] | None = None
    tolerance: float | Callable[[Case], float] = 1e-5
    poison: Callable[[Any], None] | None = None
    x_param: str | None = None
    group_by: tuple[str, ...] = ()
    rotate: bool = True
    quick_cases: list[Case] | None = None
    flops_ceiling: str = MATMUL_BF16_TFLOPS
    description: str = ""
    timer_kwargs: dict = field(default_factory=dict)  # e.g. {"backlog": False} to time host + device latency
    interleave: int = 0  # > 0: rounds of one window per provider, alternating (see above)

    def select_cases(self, quick: bool) -> list[Case]:
        if not quick:
            return list(self.cases)
        if self.quick_cases is not None:
            return list(self.quick_cases)
        flagged = [c for c in self.cases if c.params.get("quick")]
        return flagged or list(self.cases[:1])

    @property
    def metric(self) -> str:
        """The plotted rate: GB/s for a bytes model, else TFLOP/s."""
        return "GB/s" if self.bytes is not None else "TFLOP/s" if self.flops is not None else "us"


class CompiledPeer:
    """The ``torch.compile`` peer of a torch function, compiled for one case at a time.

    ``make(case_key, *args)`` compiles ``fn`` for this case (dynamo is reset
    when the case changes, so each case gets the static-shape code a user
    with that fixed shape would get, and a long case list never reaches
    dynamo's recompile limit, past which it silently falls back to eager),
    runs it once so compile time stays out of the timing, and returns the
    zero-argument callable. A compile failure (no compiler, an inductor bug)
    is a :class:`Skip`: the peer is unavailable, not wrong. On the CPU the
    peer is skipped: inductor's C++ build there costs tens of seconds per
    shape for a number that means nothing.
    """

    def __init__(self, fn: Callable[..., Any], **compile_kwargs: Any) -> None:
        self._fn = fn
        self._kwargs = {"dynamic": False, **compile_kwargs}
        self._key: Any = None
        self._compiled: Callable[..., Any] | None = None

    def make(self, case_key: Any, *args: Any) -> Callable[[], Any]:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and tensors[0].device.type != "cuda":
            raise Skip("torch.compile is benchmarked on the GPU only")
        try:
            if case_key != self._key or self._compiled is None:
                torch._dynamo.reset()
                self._compiled = torch.compile(self._fn, **self._kwargs)
                self._key = case_key
            fn = self._compiled
            fn(*args)
        except Exception as e:  # noqa: BLE001 - any compile failure means the peer is unavailable
            self._key = None
            first = (str(e).strip().splitlines() or [""])[0][:120]
            raise Skip(f"torch.compile failed: {type(e).__name__}: {first}") from e
        return lambda: fn(*args)


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
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
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
    provider: Provider, fn: Callable[[], Any], sets: list | None
) -> tuple[Callable[..., Any], list[tuple] | None]:
    """What to hand the timer: ``fn`` alone, or one callable per input copy rotated through ``arg_sets``."""
    if not sets or len(sets) < 2:
        return fn, None
    fns = [fn] + [provider.make(s) for s in sets[1:]]
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


def _record(row: Row, t: Timing, bench: Bench, ceilings: dict) -> None:
    """A provider's timing into its row, with its rates."""
    row.time_us = float(t.median_us)
    row.windows_us = [float(w) for w in t.windows_us]
    row.calls_per_window = int(t.calls_per_window)
    if t.median_us > 0:
        row.spread = (max(t.windows_us) - min(t.windows_us)) / t.median_us
    _rates(row, bench, ceilings)


def _interleaved(timed: list, bench: Bench, dev: torch.device, ceilings: dict) -> None:
    """Time ``timed``'s providers in ``bench.interleave`` rounds of one window each, provider after provider
    within a round; each row's time is the median over its rounds (its windows: one a round). A provider
    that raises leaves the rounds, its row an error."""
    windows: dict[int, list[float]] = {i: [] for i in range(len(timed))}
    calls: dict[int, int] = {}
    for _ in range(bench.interleave):
        for i, (row, call, arg_sets, settings) in enumerate(timed):
            if row.status != OK:
                continue
            try:
                t = timer_bench(call, arg_sets=arg_sets, device=dev, **settings)
            except Exception as e:  # noqa: BLE001 - recorded as an error row, the others go on
                row.status, row.reason = ERROR, _short(e)
                continue
            windows[i].extend(t.windows_us)
            calls[i] = t.calls_per_window
    for i, (row, *_) in enumerate(timed):
        if row.status == OK and windows[i]:
            _record(row, Timing(statistics.median(windows[i]), tuple(windows[i]), calls[i]), bench, ceilings)


def _run_case(
    bench: Bench, case: Case, providers: list[Provider], dev: torch.device, timing: dict, ceilings: dict, l2: int
) -> list[Row]:
    try:
        inputs = bench.setup(case, dev)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory at one size: the other cases still run
        reason = f"setup: {_short(e)}"
        _release(dev)
        return [Row(case.name, dict(case.params), p.name, p.is_ours, False, ERROR, reason) for p in providers]
    model_bytes = int(bench.bytes(case)) if bench.bytes is not None else None
    model_flops = int(bench.flops(case)) if bench.flops is not None else None
    rows: list[Row] = []
    timed: list = []  # with bench.interleave: (row, call, arg_sets, timer settings) of each provider to time
    ref = None
    sets = None
    for p in providers:
        checked = p.check and bench.reference is not None
        row = Row(case.name, dict(case.params), p.name, p.is_ours, checked, OK, bytes=model_bytes, flops=model_flops)
        rows.append(row)
        fn, row.status, row.reason = _make(p, inputs)
        if fn is None:
            continue
        try:
            if checked:
                if ref is None:
                    ref = bench.reference(inputs)
                if bench.poison is not None:
                    bench.poison(inputs)
                ret = fn()
                extract = p.output or bench.output
                out = extract(ret) if extract is not None else ret
                row.tolerance = _tolerance(bench, case)
                row.rel_error = rel_error(out, ref)
                del ret, out
                if not (row.rel_error <= row.tolerance):  # written so NaN fails
                    row.status = FAILED
                    row.reason = f"relative error {row.rel_error:.3e} > tolerance {row.tolerance:.1e}"
                    continue
            if sets is None:
                sets = _input_sets(bench, inputs, dev, l2) or []
            call, arg_sets = _rotated_calls(p, fn, sets)
            settings = {**timing, **bench.timer_kwargs}
            if bench.interleave > 0:  # timed below, round by round with the other providers
                timed.append((row, call, arg_sets, {**settings, "windows": 1}))
                continue
            _record(row, timer_bench(call, arg_sets=arg_sets, device=dev, **settings), bench, ceilings)
        except Skip as e:  # e.g. a compiled peer that only fails when first called
            row.status, row.reason = SKIPPED, str(e) or "cannot serve this case"
        except Exception as e:  # noqa: BLE001 - same: recorded as an error row, the other providers still run
            row.status, row.reason = ERROR, _short(e)
    _interleaved(timed, bench, dev, ceilings)
    _speedups(rows)
    del inputs, sets, ref
    _release(dev)
    return rows


def _rates(row: Row, bench: Bench, ceilings: dict) -> None:
    if not row.time_us or row.time_us <= 0:
        return
    if row.bytes is not None:
        row.gbps = row.bytes / row.time_us / 1e3  # bytes/us -> GB/s (1e9)
        if ceilings.get(COPY_GBPS):
            row.bw_fraction = row.gbps / ceilings[COPY_GBPS]
    if row.flops is not None:
        row.tflops = row.flops / row.time_us / 1e6  # flop/us -> TFLOP/s (1e12)
        if ceilings.get(bench.flops_ceiling):
            row.flops_fraction = row.tflops / ceilings[bench.flops_ceiling]


def _speedups(rows: list[Row]) -> None:
    peers = [r for r in rows if not r.is_ours and r.status == OK and r.time_us]
    if not peers:
        return
    best = min(peers, key=lambda r: r.time_us)
    for r in rows:
        if r.is_ours and r.status == OK and r.time_us:
            r.speedup = best.time_us / r.time_us
            r.best_peer = best.provider


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
) -> Results:
    """Check, time and rate every (case, provider) of ``bench`` (one spec or several).

    Args:
        device: where to run (default: the GPU when kernels compile, else the CPU).
        out_dir: when given, :func:`write_all` writes ``<stem>.json|md|png`` there.
        ceilings: ``None`` measures them now (:func:`measure_ceilings`); pass
            a dict to reuse measured ones, ``{}`` to skip them (no fractions).
        quick: the spec's quick cases and a shorter timer (a smoke run).
        providers / cases: keep only these names (case-insensitive), or a predicate on the name.
        timer_kwargs: overrides of the timer settings (windows, target_window_ms, warmup_ms, ...).
        progress: called with one line per case (e.g. ``print``).

    Returns:
        :class:`Results`; a failed check shows as status ``failed`` (not timed),
        a provider that cannot serve a case as ``skipped`` with the reason.
    """
    specs = [bench] if isinstance(bench, Bench) else list(bench)
    dev = _resolve_device(device)
    timing = dict(_TIMER_QUICK if quick else _TIMER_FULL)
    timing.update(timer_kwargs or {})
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
            if progress is not None:
                progress(f"{spec.name}: {case.name}")
            rows += _run_case(spec, case, chosen, dev, timing, results.ceilings, l2)
        results.benches.append(
            BenchResult(spec.name, spec.x_param, spec.metric, list(spec.group_by), spec.description, rows)
        )
    if out_dir is not None:
        write_all(results, out_dir, stem)
    return results


# ------------------------------------------------------------------ outputs


def gpu_slug(device_name: str, limit: int = 40) -> str:
    """File-name form of a device name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return slug[:limit].rstrip("-") or "device"


def write_all(results: Results, out_dir: str | Path, stem: str | None = None) -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` (stem default: the device slug); returns the paths.

    The PNG is skipped with a message when matplotlib is missing (it is the
    ``bench`` extra), so a results file is never lost to a plotting problem.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or gpu_slug(str(results.env.get("device_name", "device")))
    paths = {"json": results.to_json(out_dir / f"{stem}.json")}
    paths["md"] = out_dir / f"{stem}.md"
    results.to_markdown(paths["md"])
    try:
        paths["png"] = results.plot(out_dir / f"{stem}.png")
    except ImportError as e:
        print(f"plot skipped: {e} (pip install matplotlib)", file=sys.stderr)
    return paths


# ---------------------------------------------------------------------- CLI


def _names(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [n.strip() for v in values for n in v.split(",") if n.strip()]


def results_dir(package: str, module_file: str | Path) -> Path:
    """A package's results folder, ``packages/<package>/benchmarks/results`` of the source tree that
    ``module_file`` (the calling module's ``__file__``) lives in; ``./bench-results`` for an installed copy."""
    for parent in Path(module_file).resolve().parents:
        benchmarks = parent / "packages" / package / "benchmarks"
        if benchmarks.is_dir():
            return benchmarks / "results"
    return Path.cwd() / "bench-results"


def main_for(
    benches: Sequence[Bench],
    argv: Sequence[str] | None = None,
    default_out_dir: str | Path = "bench-results",
    *,
    prog: str | None = None,
    description: str | None = None,
) -> int:
    """The command line of a family's benchmarks; returns the exit status.

    Options: ``--quick`` (the quick cases, short timing), ``--out DIR``,
    ``--only NAME`` (bench names), ``--providers NAME``, ``--cases TEXT``
    (case names containing TEXT), ``--no-ceilings``, ``--stem``, ``--device``,
    ``--list``. Name options take several values or commas. Exits 1 when any
    provider failed its check or raised, 2 on a bad option.

    On the CPU (interpreter) ``--quick`` is implied: full-size cases would run
    for hours there, and CPU times say nothing about the GPU anyway.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description or "FlyDSL benchmarks")
    parser.add_argument("--quick", action="store_true", help="few, small cases and short timing (a smoke run)")
    parser.add_argument("--out", default=None, help=f"output folder (default: {default_out_dir})")
    parser.add_argument("--only", nargs="+", metavar="BENCH", help="run only these benches")
    parser.add_argument("--providers", nargs="+", metavar="NAME", help="time only these providers")
    parser.add_argument("--cases", nargs="+", metavar="TEXT", help="only cases whose name contains TEXT")
    parser.add_argument("--no-ceilings", action="store_true", help="skip measuring copy bandwidth and matmul peak")
    parser.add_argument("--stem", default=None, help="output file stem (default: the device name, e.g. nvidia-h200)")
    parser.add_argument("--device", default=None, help="torch device (default: the GPU, else the CPU interpreter)")
    parser.add_argument("--list", action="store_true", help="list benches, cases and providers, then exit")
    args = parser.parse_args(list(argv) if argv is not None else None)

    by_name = {b.name: b for b in benches}
    only = _names(args.only)
    if only:
        unknown = [n for n in only if n not in by_name]
        if unknown:
            print(f"unknown bench {', '.join(unknown)}; known: {', '.join(by_name)}", file=sys.stderr)
            return 2
        benches = [by_name[n] for n in only]
    dev = _resolve_device(args.device)
    quick = args.quick
    if dev.type != "cuda" and not quick:
        print("no GPU: running the --quick cases through the interpreter (CPU times are not GPU numbers)")
        quick = True
    if args.list:
        for b in benches:
            print(f"{b.name}: providers {', '.join(p.name for p in b.providers)}")
            for c in b.select_cases(quick):
                print(f"  {c.name}")
        return 0

    providers = _names(args.providers)
    substrings = _names(args.cases)
    case_filter = None if not substrings else (lambda name: any(s.lower() in name.lower() for s in substrings))
    ceilings: dict = {}
    if not args.no_ceilings:
        print("measuring ceilings (device copy, bf16 matmul) ...", flush=True)
        ceilings = measure_ceilings(dev, quick=quick)
    results = run(
        benches,
        device=dev,
        ceilings=ceilings,
        quick=quick,
        providers=providers,
        cases=case_filter,
        progress=lambda line: print(f"  {line}", flush=True),
    )
    if not results.rows():
        print("nothing matched the filters", file=sys.stderr)
        return 2
    paths = write_all(results, args.out or default_out_dir, args.stem)
    print()
    results.print_table()
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    bad = results.failures()
    if bad:
        print(f"\n{len(bad)} provider run(s) failed or raised:", file=sys.stderr)
        for r in bad:
            print(f"  {r.case} / {r.provider}: {r.reason}", file=sys.stderr)
        return 1
    return 0
