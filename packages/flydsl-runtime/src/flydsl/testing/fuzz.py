"""The fuzzing profile every family's property-based tests share (needs ``hypothesis``, a test extra).

Two profiles, chosen by the device: ``cpu`` (the interpreter: 80 cases a test, small shapes) and ``gpu``
(500 cases a test, gpu-marked so a GPU shard's ``-m gpu`` runs it). ``FLYDSL_FUZZ_EXAMPLES`` and
``FLYDSL_FUZZ_SEED`` override the count and the seed (40); ``FLYDSL_FUZZ_SHRINK=1`` turns shrinking on.
Usage::

    from flydsl.testing.fuzz import fuzz, banner

    @fuzz                                  # or @fuzz(cpu_examples=30) for a slow interpreted op
    @given(...)
    def test_op(...): ...

A fixed seed gives the same cases whatever ran before in the process: Hypothesis (6.1xx) also draws
numbers and strings found in the source of every local module loaded so far, so a test's cases would
depend on which other tests imported what first (seen: a fly-norm case reached only in the full suite).
That pool is emptied here, where this Hypothesis has it.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, seed, settings

from .. import env
from . import gpu_available

__all__ = ["SEED", "PROFILE", "MAX_EXAMPLES", "FUZZ", "fuzz", "examples", "banner", "finding"]

SEED = env.get("FLYDSL_FUZZ_SEED")
PROFILE = "gpu" if gpu_available() else "cpu"
MAX_EXAMPLES = env.get("FLYDSL_FUZZ_EXAMPLES") or {"cpu": 80, "gpu": 500}[PROFILE]
FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    # Shrinking a failure through the interpreter takes minutes (each step reruns kernels): off unless asked
    # for; the failing draw is printed whole either way.
    phases=[p for p in Phase if p is not Phase.shrink or env.get("FLYDSL_FUZZ_SHRINK")],
)


def fuzz(test=None, *, cpu_examples: int | None = None):
    """The shared settings and seed on a ``@given`` test; on a GPU machine also the ``gpu`` marker (the CPU
    profile stays unmarked, so the CPU suite runs it). ``@fuzz(cpu_examples=N)``: N cases on the CPU profile
    instead of the shared count, for tests the interpreter runs slowly (each case a kernel of many programs);
    ``FLYDSL_FUZZ_EXAMPLES`` still sets every count, and the GPU profile keeps its own."""
    if test is None:
        return lambda t: fuzz(t, cpu_examples=cpu_examples)
    count = examples(cpu_examples)
    return finding(seed(SEED)((FUZZ if count == MAX_EXAMPLES else settings(FUZZ, max_examples=count))(test)))


def finding(test):
    """A failure the fuzzing found, kept as a fixed example test: run by both profiles' suites, as
    :func:`fuzz` tests are (gpu-marked on a GPU machine, whose shard selects ``-m gpu``; the CPU suite runs
    what is unmarked)."""
    return pytest.mark.gpu(test) if PROFILE == "gpu" else test


def examples(cpu_examples: int | None = None) -> int:
    """The case count of a test: :data:`MAX_EXAMPLES`, or ``cpu_examples`` (at most that) on the CPU profile
    when FLYDSL_FUZZ_EXAMPLES is not set."""
    if cpu_examples is None or PROFILE != "cpu" or env.get("FLYDSL_FUZZ_EXAMPLES") is not None:
        return MAX_EXAMPLES
    return min(cpu_examples, MAX_EXAMPLES)


def banner(family: str, cpu_examples: int | None = None) -> str:
    """The line a fuzz module prints once: profile, case count, seed, and how to change them."""
    return (f"{family} fuzz: profile {PROFILE}, {examples(cpu_examples)} examples a test, seed {SEED} "
            f"(FLYDSL_FUZZ_SEED, FLYDSL_FUZZ_EXAMPLES, FLYDSL_FUZZ_SHRINK)")  # fmt: skip


def _no_local_constants() -> None:
    try:
        from hypothesis.internal.conjecture import providers as p

        def empty():  # the shape of Hypothesis's own empty pool
            return p.Constants(integers=p.SortedSet(), floats=p.SortedSet(key=p.float_to_int), bytes=p.SortedSet(),
                               strings=p.SortedSet())  # fmt: skip

        empty()
    except (ImportError, AttributeError, TypeError):  # another Hypothesis: nothing to turn off
        return
    if hasattr(p, "_get_local_constants"):
        p._get_local_constants = empty


_no_local_constants()
