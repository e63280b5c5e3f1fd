"""Compile a benchmark's kernels in parallel processes before it is timed (``main_for --prewarm N``).

A family's full run spends most of its wall time compiling, not timing: every case of a norm benchmark
compiles torch.compile's peer (a forward graph, or a training graph of forward and backward: several
seconds a shape on a cold cache) and our kernels' specializations at its width, one after the other in
the timing process. The compilers cache what they build on disk (Inductor's FX graph and AOT autograd
caches, Triton's kernel cache), so :func:`prewarm` first runs every case's providers once in ``N``
worker processes, each taking every N-th (bench, case) pair; the timing process then finds each compile
in the caches. Nothing a worker does is timed, checked or written: a worker that fails on a case only
leaves that case cold (the timing run reports the failure), and the timing run's numbers do not depend
on whether a prewarm ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from .harness import _release
from .spec import Bench, Case

__all__ = ["parse_shard", "prewarm", "warm_cases"]


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``0 <= i < n``; ValueError otherwise (argparse reports it)."""
    i, sep, n = text.partition("/")
    if not sep or not i.isdigit() or not n.isdigit() or not 0 <= int(i) < int(n):
        raise ValueError(f"a shard is I/N with 0 <= I < N, got {text!r}")
    return int(i), int(n)


def warm_cases(pairs: Sequence[tuple[Bench, Case]], device: Any, shard: tuple[int, int] = (0, 1)) -> int:
    """Run every provider (its ``make``, one call, and its ``step`` once where it has one) of the pairs of
    ``shard`` (``(i, n)``: the pairs whose index is ``i`` modulo ``n``), so that their compiles land in the
    on-disk caches. Failures are skipped silently (the timing run reports them). Returns the pairs run."""
    i, n = shard
    done = 0
    for k, (bench, case) in enumerate(pairs):
        if k % n != i:
            continue
        try:
            inputs = bench.setup(case, device)
        except Exception:  # noqa: BLE001 - the timing run reports a setup failure
            continue
        for p in bench.providers:
            for factory in (p.make, p.step):
                if factory is None:
                    continue
                try:
                    fn = factory(inputs)
                    if fn is not None:
                        fn()
                except Exception:  # noqa: BLE001 - a skip or a failure: the timing run says which
                    pass
        del inputs
        _release(device)
        done += 1
    return done


def prewarm(argv: Sequence[str], workers: int, *, timeout_s: float = 1800.0) -> float:
    """Start ``workers`` copies of this process's command line (``sys.orig_argv``) plus ``argv`` (the
    options that make a worker: ``--warm-shard i/N`` and the sweep's seed) and wait for them; returns the
    wall seconds. A worker's output goes to the null device: it has nothing to report."""
    start = time.perf_counter()
    base = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
    procs = [
        subprocess.Popen(
            [*base, *argv, "--warm-shard", f"{i}/{workers}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for i in range(workers)
    ]
    deadline = start + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return time.perf_counter() - start
