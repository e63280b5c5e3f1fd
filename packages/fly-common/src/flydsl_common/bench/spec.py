"""The spec of a benchmark (DESIGN.md section 8): what :func:`~flydsl_common.bench.harness.run` runs.

A :class:`Bench` names its cases (:class:`Case`), a ``setup`` that builds one
case's inputs, the :class:`Provider` objects to compare and a bytes/flops
model; a provider that cannot serve a case raises :class:`Skip`.
:class:`CompiledPeer` is the ``torch.compile`` peer families add beside torch
eager; :class:`GradCheck` checks a backward's several gradients as one output. How the harness checks and
times a spec: :mod:`flydsl_common.bench.harness`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flydsl.errors import ArgumentError

from .results import MATMUL_BF16_TFLOPS, TIMINGS

__all__ = ["Bench", "Case", "CompiledPeer", "GradCheck", "Provider", "Skip"]


class Skip(Exception):
    """Raised by ``Provider.make`` / ``Provider.step`` (or their callable's first call) when it cannot serve a case.

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
    case. ``is_ours`` marks FlyDSL providers (they get a ratio to the best
    peer per timing). ``check`` runs the output against the reference once before
    timing. ``output`` overrides the spec's ``output`` extractor for this
    provider (a peer may return its result in another layout).

    ``step(inputs)`` returns a zero-argument callable running one training
    step, or None when this provider has no step for the case (``step_us``
    then stays None). Each call builds a fresh graph: new leaf tensors with
    ``requires_grad`` (detached from ``inputs``), the forward, ``backward``
    with a given upstream gradient, weight ``.grad`` filled. Example::

        def step(t):
            x, w, dy = t
            def call():
                xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
                rms_norm(xl, wl).backward(dy)
            return call
    """

    name: str
    make: Callable[[Any], Callable[[], Any] | None]
    is_ours: bool = False
    check: bool = True
    output: Callable[[Any], torch.Tensor] | None = None
    step: Callable[[Any], Callable[[], Any] | None] | None = None


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
      smaller than L2, the timed calls of every timing rotate over copies from
      ``rotating_copies`` (``make`` and ``step`` are called once per copy).
      Inputs of any other type are not rotated: size them past L2 in ``setup``.
    - ``x_param``: the case parameter on the plot's x axis (log2 when numeric);
      ``group_by``: parameters that split the cases into separate panels
      (e.g. ``("mode", "dtype")``).
    - ``quick_cases``: the cases of ``--quick`` (default: those with
      ``params["quick"]``, else the first case).
    - ``sweep(rng, count) -> list[Case]``: the unseen-shape generator: given a
      seeded ``random.Random`` and a count, that many cases drawn from the
      family's realistic range (odd sizes, small M, widths not powers of two),
      never used for tuning. Draw every number from ``rng`` so a seed repeats
      the sweep.
    - ``timings``: which of "gpu", "call", "step", "host" to measure (module
      docstring); "step" only for providers with a ``step``. A host-cost bench
      uses ``("host",)``.
    - ``timer_kwargs``: this bench's timer settings over the run's (windows,
      target_window_ms, warmup_ms, max_calls_per_window), for every timing.
    - ``interleave``: when > 0, a case's timings are taken in that many rounds
      of one window each, provider after provider (each of its timings in turn)
      within a round, and each time is the median over its rounds: a host whose
      speed drifts then slows every provider alike, where timing one provider's
      windows after another's puts the drift between them.
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
    timer_kwargs: dict = field(default_factory=dict)
    interleave: int = 0  # > 0: rounds of one window per provider and timing, alternating (see above)
    sweep: Callable[[random.Random, int], list[Case]] | None = None
    timings: tuple[str, ...] = ("gpu", "call", "step")

    def __post_init__(self) -> None:
        timings = tuple(self.timings) if not isinstance(self.timings, str) else (self.timings,)
        bad = [t for t in timings if t not in TIMINGS]
        if bad or not timings:
            raise ArgumentError(
                f"Bench {self.name!r}: timings must be a non-empty tuple of {', '.join(TIMINGS)}, got {self.timings!r}"
            )
        object.__setattr__(self, "timings", timings)
        if self.sweep is not None and not callable(self.sweep):
            raise ArgumentError(
                f"Bench {self.name!r}: sweep must be a callable (random.Random, count) -> list[Case], "
                f"got {type(self.sweep).__name__}"
            )
        if self.interleave < 0:
            raise ArgumentError(f"Bench {self.name!r}: interleave must be >= 0, got {self.interleave}")

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


class GradCheck:
    """A backward's gradients checked in one relative error: each divided by its reference's norm and all
    concatenated, so each weighs the same whatever their scales (one of ``n`` gradients all wrong gives
    ~``sqrt(1 / n)``; a plain concatenation would let a wrong gradient of small norm pass beside a large one).
    Pass ``reference`` and ``output`` to the :class:`Bench`; ``grads_ref(inputs)`` returns the reference
    gradients in the order the providers return theirs.

    The harness computes a case's reference before it extracts any provider's output, so ``reference``
    leaves the norms that ``output`` divides by."""

    def __init__(self, grads_ref: Callable[[Any], Any]) -> None:
        self.grads_ref = grads_ref
        self.norms: list[float] | None = None

    def reference(self, inputs) -> torch.Tensor:
        grads = self.grads_ref(inputs)
        self.norms = [float(torch.linalg.vector_norm(g)) or 1.0 for g in grads]
        return self._join(grads)

    def output(self, grads) -> torch.Tensor:
        if self.norms is None:
            raise RuntimeError("GradCheck.output: the case's reference was not computed first")
        return self._join(grads)

    def _join(self, grads) -> torch.Tensor:
        if len(grads) != len(self.norms):
            raise ValueError(f"expected {len(self.norms)} gradients, got {len(grads)}")
        return torch.cat([(g.float() / n).flatten() for g, n in zip(grads, self.norms, strict=True)])


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
