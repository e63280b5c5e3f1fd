"""Benchmarks of flydsl-common's own kernels: quantization and vec_add.

Run ``python packages/fly-common/benchmarks/run.py [--quick] [--out DIR]`` or
``flydsl bench common [--quick] ...``. Both benches are memory bound, so the
model is bytes (each input read once, each output written once) and the
ceiling is the device copy bandwidth measured in the same run.

- ``quant``: bf16 ``[M, N]`` with ``M * N = 2^27`` (256 MiB of input, far
  past L2) for N in 1024..16384, against what a user writes in torch (amax,
  divide, clamp, round, cast) eagerly and under ``torch.compile``:

  - ``per_token`` int8 and fp8 e4m3: model bytes ``2*M*N + M*N + 4*M``;
  - ``per_tensor_dynamic`` int8: model bytes ``2*M*N + M*N + 4``, i.e. *one*
    read of x. The kernel reads x twice (amax pass, then quantize pass), so
    it shows honestly below what a one-read algorithm could reach;
  - ``per_tensor_static`` int8 (a given scale, one read of x) at 16384 x 8192.

  The sweep (``--sweep``): random shapes no tuning saw (:func:`quant_sweep`):
  M from 1..16 (decode), 17..512 and 513..16384 in equal parts, N from 200 to
  16384, never a power of two and odd in half the draws, at most 2^27 elements;
  the mode and dtype drawn from the four above.

- ``vec_add``: fp32 at n = 2^20, 2^24, 2^28 against ``torch.add``; model bytes
  ``3 * 4 * n``. The 2^20 case fits in L2, so the harness rotates input copies.

Timings: ``gpu`` and ``call`` (quantization has no backward, so no ``step``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from ..quant import quantize_per_tensor, quantize_per_token
from ..reference import dequantize_ref, quantize_per_tensor_ref, quantize_per_token_ref, vec_add_ref
from ..vec_add import vec_add
from .harness import Bench, Case, CompiledPeer, Provider, main_for, results_dir

__all__ = ["benches", "default_out_dir", "main", "quant_bench", "quant_sweep", "vec_add_bench"]

_QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}

_ELEMENTS = 1 << 27  # 128M bf16 elements: 256 MiB read, several times any L2
_QUANT_N = (1024, 4096, 8192, 16384)
# Tiny shapes for --quick: the CPU interpreter runs them in milliseconds. The
# second one is wider than a single-pass row of 256 so both row layouts run.
_QUANT_QUICK = ((16, 256), (4, 1024))


# -------------------------------------------------------------------- quant


def torch_quant(
    x: torch.Tensor, qdtype: torch.dtype, per_token: bool, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a user writes in eager torch: amax, divide, clamp, round (int8), cast.

    Returns ``(q, scale)`` with ``scale`` of shape ``[M, 1]`` (per token) or 0-d;
    a given per-tensor ``scale`` skips the amax (static quantization).
    """
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax()
        scale = amax / qmax
    q = (xf / scale).clamp(-qmax, qmax)
    q = q.round().to(qdtype) if qdtype == torch.int8 else q.to(qdtype)
    return q, scale


_COMPILED = CompiledPeer(torch_quant)


def _dequantized(ret) -> torch.Tensor:
    """(q [M, N], scale [M] / [M, 1] / 0-d) -> q * scale in float64, comparable across providers."""
    q, scale = ret
    return q.double() * scale.double().reshape(-1, 1)


def _quant_bytes(case: Case) -> int:
    m, n = case.params["M"], case.params["N"]
    scales = 4 * m if case.params["mode"] == "per_token" else 4
    return 2 * m * n + m * n + scales  # read bf16 x once, write 1-byte q, write fp32 scales


def _quant_cases(quick: bool) -> list[Case]:
    shapes = _QUANT_QUICK if quick else tuple((_ELEMENTS // n, n) for n in _QUANT_N)
    groups = [("per_token", "int8"), ("per_token", "fp8"), ("per_tensor_dynamic", "int8")]
    cases = [
        Case(f"{mode} {dt} {m}x{n}", {"mode": mode, "dtype": dt, "M": m, "N": n})
        for mode, dt in groups
        for m, n in shapes
    ]
    m, n = shapes[-1] if quick else (16384, 8192)
    static = {"mode": "per_tensor_static", "dtype": "int8", "M": m, "N": n}
    cases.append(Case(f"per_tensor_static int8 {m}x{n}", static))
    return cases


_SWEEP_GROUPS = (
    ("per_token", "int8"),
    ("per_token", "fp8"),
    ("per_tensor_dynamic", "int8"),
    ("per_tensor_static", "int8"),
)
_SWEEP_M = ((1, 16), (17, 512), (513, 16384))  # decode, small batches, large batches: drawn in turn
_SWEEP_N = (200, 16384)
_SWEEP_MAX_ELEMENTS = 1 << 27  # the tuned set's size: 256 MiB of bf16 input at most


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi], its logarithm uniform."""
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def quant_sweep(rng: random.Random, count: int) -> list[Case]:
    """``count`` unseen quantization shapes: M from the three ranges of ``_SWEEP_M`` in turn (so M = 1..16
    is a third of them), log-uniform within a range; N log-uniform in ``_SWEEP_N``, moved off powers of two
    and odd in half the draws; M shrunk to keep M * N <= 2^27; mode and dtype drawn from the four groups."""
    cases = []
    for i in range(count):
        lo, hi = _SWEEP_M[i % len(_SWEEP_M)]
        n = _log_uniform(rng, *_SWEEP_N)
        if rng.random() < 0.5:
            n = n | 1 if n < _SWEEP_N[1] else n - 1  # odd: the row's tail is masked
        elif n & (n - 1) == 0:
            n -= 2 * rng.randrange(1, 8)  # even, but never a power of two
        m = min(_log_uniform(rng, lo, hi), max(1, _SWEEP_MAX_ELEMENTS // n))
        mode, dt = rng.choice(_SWEEP_GROUPS)
        cases.append(Case(f"{mode} {dt} {m}x{n}", {"mode": mode, "dtype": dt, "M": m, "N": n}))
    return cases


def quant_bench() -> Bench:
    """The ``quant`` bench: per-token int8/fp8 and per-tensor dynamic int8, bf16 input, vs torch eager and compile."""

    # The providers see only the inputs, so the case's mode travels with them:
    # setup returns (x, mode, dtype name, static scale or None); rotating_copies clones only tensors.
    def setup(case: Case, device):
        p = case.params
        # Random data, never zeros: zero rows take the scale-0 path and hide bugs. Seeded, so a case's check
        # judges the same data every run: bf16 rows put many elements exactly on a rounding tie, and which
        # ones flip a step (a last-bit difference in x * QMAX / amax) makes the error of a small case
        # (--quick: 4K elements) vary from run to run around the fp8 budget (1.03e-2 seen once in ~10 runs).
        gen = torch.Generator(device=device).manual_seed(p["M"] * 7919 + p["N"])
        x = torch.randn(p["M"], p["N"], device=device, dtype=torch.bfloat16, generator=gen)
        # Static mode: a calibrated scale (here the tensor's own), given to every provider.
        scale = (x.float().abs().amax() / 127.0).reshape(()) if p["mode"] == "per_tensor_static" else None
        return (x, p["mode"], p["dtype"], scale)

    def ours(inputs):
        x, mode, dt, scale = inputs
        qdtype = _QDTYPES[dt]
        if mode == "per_token":
            return lambda: quantize_per_token(x, qdtype)
        return lambda: quantize_per_tensor(x, qdtype, scale=scale)

    def eager(inputs):
        x, mode, dt, scale = inputs
        qdtype, per_token = _QDTYPES[dt], mode == "per_token"
        return lambda: torch_quant(x, qdtype, per_token, scale)

    def compiled(inputs):
        x, mode, dt, scale = inputs
        return _COMPILED.make((tuple(x.shape), dt, mode), x, _QDTYPES[dt], mode == "per_token", scale)

    def reference(inputs) -> torch.Tensor:
        x, mode, dt, scale = inputs
        per_token = mode == "per_token"
        if per_token:
            return dequantize_ref(*quantize_per_token_ref(x, _QDTYPES[dt]), True)
        return dequantize_ref(*quantize_per_tensor_ref(x, _QDTYPES[dt], scale=scale), False)

    def tolerance(case: Case) -> float:
        # bf16 inputs often land exactly on a rounding tie of x * QMAX / amax, and
        # dividing by the scale (as torch users write it) instead of multiplying
        # by its inverse moves such ties one step: measured 5e-4 (int8) and
        # 3.3e-3 (fp8) for the torch peer at 2^24 elements. The budgets leave
        # 3-4x margin yet stay ~4x under the quantization noise itself (8e-3
        # int8, 2.6e-2 fp8), so a wrong scale or rounding mode still fails.
        return 2e-3 if case.params["dtype"] == "int8" else 1e-2

    full, quick = _quant_cases(False), _quant_cases(True)
    return Bench(
        name="quant",
        cases=full,
        quick_cases=quick,
        setup=setup,
        providers=[
            Provider("flydsl", ours, is_ours=True),
            Provider("torch", eager),
            Provider("torch.compile", compiled),
        ],
        bytes=_quant_bytes,
        reference=reference,
        output=_dequantized,
        tolerance=tolerance,
        x_param="N",
        group_by=("mode", "dtype"),
        sweep=quant_sweep,
        timings=("gpu", "call"),
        description=(
            "bf16 [M, N] -> int8 / fp8 e4m3 with fp32 scales, M*N = 2^27. Model bytes: x read once (2 B/elem), "
            "q written once (1 B/elem), scales written once. per_tensor_dynamic counts a *single* read of x, but "
            "a dynamic per-tensor scale needs the whole tensor's amax before any element is quantized, so the "
            "kernel reads x twice: its % of ceiling is honestly below what per_token reaches. "
            "torch / torch.compile: amax, divide, clamp, round, cast, as a user writes it."
        ),
    )


# ------------------------------------------------------------------ vec_add

_VEC_N = (1 << 20, 1 << 24, 1 << 28)
_VEC_QUICK = (1 << 16,)


def vec_add_bench() -> Bench:
    """The ``vec_add`` bench: fp32 ``a + b`` into a preallocated ``out``, vs ``torch.add(out=)``."""

    def setup(case: Case, device):
        n = case.params["n"]
        a = torch.randn(n, device=device)
        b = torch.randn(n, device=device)
        return (a, b, torch.empty_like(a))

    def poison(inputs) -> None:
        inputs[2].fill_(float("nan"))  # an element the kernel skips stays NaN and fails the check

    def case(n: int) -> Case:
        return Case(f"fp32 n=2^{n.bit_length() - 1}", {"n": n})

    return Bench(
        name="vec_add",
        cases=[case(n) for n in _VEC_N],
        quick_cases=[case(n) for n in _VEC_QUICK],
        setup=setup,
        providers=[
            Provider("flydsl", lambda t: lambda: vec_add(t[0], t[1], out=t[2]), is_ours=True),
            Provider("torch.add", lambda t: lambda: torch.add(t[0], t[1], out=t[2])),
        ],
        bytes=lambda c: 3 * 4 * c.params["n"],
        reference=lambda t: vec_add_ref(t[0], t[1]),
        tolerance=1e-6,  # fp32 addition is exact to rounding: any real bug is far above this
        poison=poison,
        x_param="n",
        timings=("gpu", "call"),
        description="fp32 out = a + b into a preallocated out. Model bytes: 3 * 4 * n (read a and b, write out).",
    )


def benches() -> list[Bench]:
    return [quant_bench(), vec_add_bench()]


# --------------------------------------------------------------------- main


def default_out_dir() -> Path:
    """``packages/fly-common/benchmarks/results`` in a checkout, else ``./bench-results``."""
    return results_dir("fly-common", __file__)


def main(argv: Sequence[str] | None = None) -> int:
    """``flydsl bench common`` / ``benchmarks/run.py``: run the benches, print the table, write the results."""
    return main_for(
        benches(),
        argv,
        default_out_dir(),
        prog="flydsl bench common",
        description="Benchmarks of flydsl-common: quantization and vec_add against torch, with measured ceilings.",
    )
