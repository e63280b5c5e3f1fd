"""The command line every family's ``benchmarks/run.py`` calls: :func:`main_for`, and :func:`results_dir`.

It parses the options, picks the benches and cases, measures the ceilings and
hands the rest to :func:`~flydsl_common.bench.harness.run` (the tuned set) and
:func:`~flydsl_common.bench.harness.run_sweep` (the unseen-shape sweep), then
prints each table and writes the results.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from flydsl.errors import ArgumentError

from .harness import (
    DEFAULT_SWEEP_COUNT,
    _matches,
    _resolve_device,
    measure_ceilings,
    results_path,
    run,
    run_sweep,
    sweep_cases,
    sweep_counts,
    write_all,
)
from .prewarm import parse_shard, prewarm, warm_cases
from .results import Results
from .spec import Bench

__all__ = ["main_for", "results_dir"]


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
    ``--list``; the unseen-shape sweep: ``--sweep`` (the tuned set, then every
    bench's sweep, written as ``<stem>-sweep.json|md|png``), ``--sweep-only``,
    ``--seed N`` (default: a fresh random seed; printed first, and kept in the
    sweep's JSON), ``--sweep-count K`` (default 60 for the family, split by
    :func:`sweep_counts`; under ``--quick``, one shape a bench). Name options take
    several values or commas. A line is printed as each case finishes. Exits 1
    when any provider failed its check or raised, 2 on a bad option.

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
    parser.add_argument("--sweep", action="store_true", help="also run every bench's sweep of unseen random shapes")
    parser.add_argument("--sweep-only", action="store_true", help="run the sweep only (not the tuned set)")
    parser.add_argument("--seed", type=int, default=None, help="the sweep's seed (default: a fresh one, printed)")
    parser.add_argument(
        "--sweep-count",
        type=int,
        default=None,
        metavar="K",
        help=f"sweep shapes for the family (default {DEFAULT_SWEEP_COUNT}; --quick: one a bench), "
        "each bench with a sweep getting ceil(K / benches)",
    )
    parser.add_argument(
        "--prewarm",
        type=int,
        default=0,
        metavar="N",
        help="first compile every case's kernels in N worker processes (filling the compilers' disk caches), "
        "then time as usual: a cold machine's run is mostly compiling",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the benches of the results already in the output folder that this run does not re-run "
        "(a family's run made in parts with --only)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="profile the run (cProfile) and write where its wall time goes to FILE (text, rewritten after "
        "each bench, so a run cut short keeps it)",
    )
    parser.add_argument("--warm-shard", type=parse_shard, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)

    order = [b.name for b in benches]
    by_name = {b.name: b for b in benches}
    only = _names(args.only)
    if only:
        unknown = [n for n in only if n not in by_name]
        if unknown:
            print(f"unknown bench {', '.join(unknown)}; known: {', '.join(by_name)}", file=sys.stderr)
            return 2
        benches = [by_name[n] for n in only]
    if args.sweep_count is not None and args.sweep_count < 1:
        print(f"--sweep-count must be >= 1, got {args.sweep_count}", file=sys.stderr)
        return 2
    dev = _resolve_device(args.device)
    quick = args.quick
    if dev.type != "cuda" and not quick:
        print("no GPU: running the --quick cases through the interpreter (CPU times are not GPU numbers)")
        quick = True
    do_sweep = args.sweep or args.sweep_only
    counts: dict[str, int] = {}
    seed = None
    if do_sweep:
        with_sweep = [b for b in benches if b.sweep is not None]
        if not with_sweep:
            print(f"no sweep: none of {', '.join(b.name for b in benches)} defines one", file=sys.stderr)
            return 2
        count = args.sweep_count or (len(with_sweep) if quick else DEFAULT_SWEEP_COUNT)
        counts = sweep_counts(benches, count)
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
        split = ", ".join(f"{n} {c}" for n, c in counts.items())
        print(f"sweep seed {seed} (repeat: --seed {seed}); {sum(counts.values())} shapes: {split}", flush=True)
    if args.list:
        for b in benches:
            print(f"{b.name}: providers {', '.join(p.name for p in b.providers)}; timings {', '.join(b.timings)}")
            for c in [] if args.sweep_only else b.select_cases(quick):
                print(f"  {c.name}")
            for c in sweep_cases(b, seed, counts[b.name]) if b.name in counts else []:
                print(f"  sweep: {c.name}")
        return 0

    providers = _names(args.providers)
    substrings = _names(args.cases)
    case_filter = None if not substrings else (lambda name: any(s.lower() in name.lower() for s in substrings))
    if args.warm_shard is not None:  # a --prewarm worker: compile its share, time and write nothing
        pairs = []
        for b in benches:
            chosen = replace(b, providers=[p for p in b.providers if _matches(p.name, providers)])
            cases = [] if args.sweep_only else b.select_cases(quick)
            cases += sweep_cases(b, seed, counts[b.name]) if b.name in counts else []
            pairs += [(chosen, c) for c in cases if case_filter is None or case_filter(c.name)]
        warm_cases(pairs, dev, args.warm_shard)
        return 0
    if args.prewarm > 0 and dev.type == "cuda":
        print(f"prewarm: compiling every case in {args.prewarm} worker processes ...", flush=True)
        took = prewarm(["--seed", str(seed)] if seed is not None else [], args.prewarm)
        print(f"prewarm: {took:.0f} s", flush=True)
    ceilings: dict = {}
    if not args.no_ceilings:
        print("measuring ceilings (device copy, bf16 matmul) ...", flush=True)
        ceilings = measure_ceilings(dev, quick=quick)
    common = {"device": dev, "ceilings": ceilings, "providers": providers, "cases": case_filter}
    common["progress"] = lambda line: print(f"  {line}", flush=True)
    out_dir = args.out or default_out_dir
    merge = order if args.merge else None
    # Each finished bench is written at once, so a run cut short keeps what it measured.
    profiler = cProfile.Profile() if args.profile else None

    def mark_profiled(results: Results) -> Results:
        if profiler is not None:
            for b in results.benches:
                b.profiled = True
        return results

    def on_bench(partial: Results) -> None:
        _write(mark_profiled(partial), out_dir, args.stem, merge, quiet=True)
        if profiler is not None:  # reading the stats stops the profiler: it is started again after
            profiler.disable()
            _write_profile(profiler, args.profile)
            profiler.enable()

    common["on_bench"] = on_bench
    if profiler is not None:
        print("--profile: cProfile inflates the call, step and host timings; the results mark these benches",
              flush=True)  # fmt: skip
        profiler.enable()
    written: list[Results] = []
    if not args.sweep_only:
        print("tuned set:", flush=True)
        tuned = run(benches, quick=quick, **common)
        if tuned.rows():
            _report(mark_profiled(tuned), out_dir, args.stem, merge)
            written.append(tuned)
    if do_sweep:
        print(f"sweep (seed {seed}):", flush=True)
        swept = run_sweep(benches, seed=seed, count=count, **common)
        if swept.rows():
            _report(mark_profiled(swept), out_dir, args.stem, merge)
            written.append(swept)
    if profiler is not None:
        profiler.disable()
        _write_profile(profiler, args.profile)
        print(f"profile: {args.profile}", flush=True)
    if not written:
        print("nothing matched the filters", file=sys.stderr)
        return 2
    bad = [r for res in written for r in res.failures()]
    if bad:
        print(f"\n{len(bad)} provider run(s) failed or raised:", file=sys.stderr)
        for r in bad:
            print(f"  {r.case} / {r.provider}: {r.reason}", file=sys.stderr)
        return 1
    return 0


def _write(
    results: Results, out_dir: str | Path, stem: str | None, merge: list[str] | None, quiet: bool = False
) -> dict[str, Path]:
    """Write ``results`` (with ``merge``: merged into the results of the same stem already there, keeping the
    benches this run did not re-run, in that bench order)."""
    if merge is not None:
        path = results_path(results, out_dir, stem)
        if path.is_file():
            try:
                earlier = Results.load(path)
            except (ArgumentError, ValueError, KeyError, TypeError) as e:
                print(f"--merge: {path} not merged ({e})", file=sys.stderr)
            else:
                results, note = results.merged_with(earlier, merge)
                if not quiet:
                    print(f"--merge: {note}", flush=True)
    return write_all(results, out_dir, stem)


def _write_profile(profiler: cProfile.Profile, path: str | Path) -> None:
    """Where the profiled run's time went, as text: the top functions by cumulative and by own time."""
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(40)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text.getvalue(), encoding="utf-8")


def _report(results: Results, out_dir: str | Path, stem: str | None, merge: list[str] | None = None) -> None:
    paths = _write(results, out_dir, stem, merge)
    print()
    results.print_table()
    print("\nwrote " + ", ".join(str(p) for p in paths.values()), flush=True)
