"""The ``flydsl`` command.

    flydsl info                      backend, arch, SM count, versions, installed families, FLYDSL_* variables
    flydsl cache ls|size|clear       the cache root (--kind triton|tuning)
    flydsl tune [FAMILY ...]         regenerate a family's shipped tuning artifacts on this GPU
    flydsl bench FAMILY [ARGS ...]   run a family's benchmarks (ARGS go to the family)
    flydsl demo [FAMILY ...]         every installed family's kernels on small problems, checked against torch

Families are found through the ``flydsl.families`` entry points, so the
command knows what is installed without importing any family up front.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

from . import __version__, _backend, cache, env
from .families import DemoResult, Family, discover

__all__ = ["main", "run_demo"]


def _version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _pick(families: dict[str, Family], names: Sequence[str]) -> list[Family]:
    if not names:
        return list(families.values())
    unknown = [n for n in names if n not in families]
    if unknown:
        raise SystemExit(
            f"flydsl: unknown family {', '.join(unknown)}; installed: {', '.join(families) or 'none'}"
        )
    return [families[n] for n in names]


# --------------------------------------------------------------------- info


def cmd_info(args) -> int:
    from . import arch

    a = arch.current()
    fams = discover()
    info = {
        "flydsl": __version__,
        "backend": a.backend,
        "interpreter": _backend.interpreting(),
        "arch": a.name,
        "device": a.device_name,
        "sm_count": a.sm_count,
        "smem_per_block": a.smem_per_block,
        "l2_bytes": a.l2_bytes,
        "python": sys.version.split()[0],
        "torch": _version_of("torch"),
        "triton": _version_of("triton"),
        "cache_root": str(cache.root()),
        "families": {f.name: {"distribution": f.distribution, "version": f.version} for f in fams.values()},
        "env": {name: value for name, _t, value, _h in env.describe()},
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"flydsl {__version__}  (python {info['python']}, torch {info['torch']}, triton {info['triton']})")
    mode = "Triton interpreter (CPU)" if info["interpreter"] else "compiled"
    print(f"backend   {a.backend}, {mode}")
    print(f"device    {a.device_name}  arch {a.name}  SMs {a.sm_count}  "
          f"smem/block {_fmt_bytes(a.smem_per_block)}  L2 {_fmt_bytes(a.l2_bytes)}")
    print(f"cache     {info['cache_root']}")
    print("families  " + (", ".join(f"{f.name} ({f.distribution} {f.version})" for f in fams.values()) or "none"))
    print("environment:")
    for name, typ, value, help_ in env.describe():
        print(f"  {name:<22} {typ:<5} {value:<28} {help_}")
    return 0


# -------------------------------------------------------------------- cache


def cmd_cache(args) -> int:
    if args.action == "ls":
        rows = cache.entries()
        if args.kind:
            rows = [r for r in rows if r.kind == args.kind]
        for r in rows:
            print(f"{r.kind:<7} {_fmt_bytes(r.bytes):>10} {r.files:>6} files  {r.path}")
        if not rows:
            print(f"(empty) {cache.root()}")
    elif args.action == "size":
        kinds = [args.kind] if args.kind else list(cache.KINDS)
        for k in kinds:
            print(f"{k:<7} {_fmt_bytes(cache.size(k)):>10}")
    else:
        freed = cache.clear(args.kind)
        print(f"cleared {args.kind or 'all caches'} under {cache.root()}: {_fmt_bytes(freed)} freed")
    return 0


# --------------------------------------------------------------------- tune


def _select_keys(keys, match, missing, tunable, arch_name, out):
    """The keys ``--match`` (every item of each JSON object given, any object) and ``--missing`` (no entry
    for this arch in the artifact being written) leave."""
    from .autotune.store import ArtifactFile

    if match:
        wanted = [json.loads(m) for m in match]
        keys = [k for k in keys if any(all(k.get(f) == v for f, v in w.items()) for w in wanted)]
    path = (out if out is not None else tunable.artifact_path) if missing else None
    if path is not None:  # without an artifact every key is missing
        art = ArtifactFile(path, tunable.name)
        keys = [k for k in keys if art.lookup(arch_name, k) is None]
    return keys


def cmd_tune(args) -> int:
    from . import arch
    from .autotune import TuningError, narrowed, tune_artifact

    fams = _pick(discover(), args.family)
    a = arch.current()
    if a.is_interpreter and not args.allow_interpreter:
        print("flydsl tune: no GPU visible; artifacts must be generated on the GPU they describe", file=sys.stderr)
        return 2
    try:
        where = json.loads(args.candidates) if args.candidates else None
    except json.JSONDecodeError as e:
        print(f"flydsl tune: --candidates: expected a JSON object of config fields, got {args.candidates!r} ({e})",
              file=sys.stderr)  # fmt: skip
        return 2
    total = 0
    for fam in fams:
        tunables = list(fam.tunables())
        if args.only:
            tunables = [t for t in tunables if t.name in args.only]
        if not tunables:
            print(f"{fam.name}: no tunables")
            continue
        for t in tunables:
            keys = [json.loads(k) for k in args.key] if args.key else list(t.tune_keys(a.name))
            out = Path(args.out) / f"{t.name}.json" if args.out else None
            keys = _select_keys(keys, args.match, args.missing, t, a.name, out)
            if where is not None:
                try:
                    t = narrowed(t, where, out)
                except TuningError as e:
                    print(f"flydsl tune: --candidates: {e}", file=sys.stderr)
                    return 2
            if not keys:
                print(f"{fam.name}/{t.name}: no tuning keys for {a.name}")
                continue
            path = tune_artifact(t, keys, a.name, "cuda" if not a.is_interpreter else "cpu", out_path=out,
                                 jobs=args.jobs)  # fmt: skip
            print(f"{fam.name}/{t.name}: {len(keys)} keys -> {path}")
            total += 1
    return 0


# -------------------------------------------------------------------- bench


def cmd_bench(args) -> int:
    fam = _pick(discover(), [args.family])[0]
    if fam.bench is None:
        print(f"{fam.name}: no benchmarks registered")
        return 0
    return int(fam.bench(args.args) or 0)


# --------------------------------------------------------------------- demo


def run_demo(
    families: Sequence[Family],
    *,
    time_it: bool | None = None,
    on_start: Callable[[str, str], None] | None = None,
    on_result: Callable[[DemoResult, float], None] | None = None,
) -> list[DemoResult]:
    """Run every demo case of ``families``: check against the reference; time against torch on a GPU.

    ``on_start(family, case)`` is called before a case runs and ``on_result(result, seconds)``
    as soon as it has finished (the interpreter takes seconds a case), so callers can report
    progress instead of one table at the end.
    """

    from .testing import default_device, rel_error

    device = default_device()
    if time_it is None:
        time_it = device.type == "cuda"
    results = []
    for fam in families:
        for case in fam.demo_cases():
            if on_start is not None:
                on_start(fam.name, case.name)
            t0 = time.perf_counter()
            run = case.prepare(device)
            out = run.ours()
            if run.compare is not None:
                out = run.compare(out)
            ref = run.reference()
            err = rel_error(out, ref)
            ours_us = torch_us = None
            if time_it:
                from .autotune.timer import bench

                ours_us = bench(run.ours).median_us
                torch_us = bench(run.torch_op).median_us
            result = DemoResult(fam.name, case.name, err, run.tolerance, ours_us, torch_us, run.torch_name)
            results.append(result)
            if on_result is not None:
                on_result(result, time.perf_counter() - t0)
    return results


def cmd_demo(args) -> int:
    fams = _pick(discover(), args.family)
    cases = 0
    for fam in fams:
        cases += len(fam.demo_cases())
    if not cases:
        print("no demo cases in the installed families")
        return 0
    mode = "Triton interpreter on the CPU: seconds a case" if _backend.interpreting() else "compiled"
    print(f"{cases} demo case{'s' if cases != 1 else ''} from {', '.join(f.name for f in fams)} ({mode}); "
          "each row prints as its case finishes", flush=True)
    header = (f"{'family':<8} {'problem':<44} {'rel err':>9} {'tol':>7}  {'ok':<4} "
              f"{'flydsl us':>10} {'torch us':>10}  {'wall s':>6}  torch op")
    print(header)
    print("-" * len(header), flush=True)

    def start(family: str, case: str) -> None:
        # The row's first columns now, the rest when the case finishes: the case being run is on screen.
        print(f"{family:<8} {case:<44} ", end="", flush=True)

    def finish(r: DemoResult, seconds: float) -> None:
        ours = f"{r.ours_us:10.2f}" if r.ours_us is not None else f"{'-':>10}"
        theirs = f"{r.torch_us:10.2f}" if r.torch_us is not None else f"{'-':>10}"
        print(f"{r.rel_error:9.2e} {r.tolerance:7.0e}  {'yes' if r.ok else 'NO':<4} {ours} {theirs}  {seconds:6.1f}  "
              f"{r.torch_name}", flush=True)

    try:
        results = run_demo(fams, time_it=False if args.no_time else None, on_start=start, on_result=finish)
    except BaseException:
        print(flush=True)  # end the half-printed row before the traceback
        raise
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


# --------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flydsl", description="FlyDSL runtime command line")
    p.add_argument("--version", action="version", version=f"flydsl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="backend, arch, versions, installed families, environment")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("cache", help="list, size or clear the cache root")
    s.add_argument("action", choices=["ls", "size", "clear"])
    s.add_argument("--kind", choices=list(cache.KINDS), default=None)
    s.set_defaults(func=cmd_cache)

    s = sub.add_parser("tune", help="regenerate families' tuning artifacts on this GPU")
    s.add_argument("family", nargs="*", help="families to tune (default: all installed)")
    s.add_argument("--only", action="append", default=[], help="tunable name (repeatable)")
    s.add_argument("--key", action="append", default=[],
                   help="tuning key as JSON (repeatable); default: the family's list")
    s.add_argument("--match", action="append", default=[],
                   help='only keys holding every item of this JSON object, e.g. \'{"dtype": "bf16"}\' '
                        "(repeatable: any of them)")
    s.add_argument("--missing", action="store_true", help="only keys the artifact being written has no entry for")
    s.add_argument("--candidates", default=None, metavar="JSON",
                   help='search only the candidates holding every item of this JSON object of config fields, '
                        'e.g. \'{"tma": true}\', against the default and each key\'s entry in the artifact '
                        "being written (keys without one: the whole space): what a change added to a space")
    s.add_argument("--out", default=None, help="folder for the artifacts (default: inside the family package)")
    s.add_argument("--jobs", type=int, default=1,
                   help="compile the candidates first in this many processes (each holds one key's operands on "
                        "the GPU at a time); the search then times them one at a time")  # fmt: skip
    s.add_argument("--allow-interpreter", action="store_true", help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_tune)

    s = sub.add_parser("bench", help="run a family's benchmarks")
    s.add_argument("family")
    s.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the family's benchmark")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("demo", help="run every installed family's kernels on small problems against torch")
    s.add_argument("family", nargs="*")
    s.add_argument("--no-time", action="store_true", help="check only, do not time")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
