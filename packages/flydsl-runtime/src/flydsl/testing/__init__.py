"""Test helpers every FlyDSL package uses (the opt-in pytest plugin lives in ``plugin``).

- ``gpu``: ``@pytest.mark.gpu`` marks a test that needs a CUDA/HIP device; it is
  skipped automatically where kernels run through the interpreter, and
  ``pytest --require-gpu`` turns "no GPU" into an error instead (GPU CI).
- ``device`` fixture: the GPU when kernels compile, the CPU otherwise.
- tolerances per dtype on the relative error ||out - ref|| / ||ref||.
- ``poison`` / ``empty_poisoned``: fill outputs with values a kernel never
  writes (NaN for floats), so unwritten elements fail the comparison.
- ``rel_error`` / ``assert_rel_close``: the comparison, in float64; NaN never passes.
- ``host_work``: what a call does on the device, its kernels recorded and not run: the check that a host
  path is replayable by :mod:`flydsl.direct` (and capturable in a CUDA graph).
"""

from __future__ import annotations

import math

import torch

from .. import _backend

__all__ = [
    "TOLERANCES",
    "tolerance",
    "fp8_fast_accum_tolerance",
    "gpu_available",
    "default_device",
    "poison",
    "empty_poisoned",
    "cpu_select",
    "rel_error",
    "assert_rel_close",
    "host_work",
    "seeded_generator",
]

# Relative error budgets of a result whose output (or operands) have this dtype.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
    torch.float8_e4m3fn: 7e-2,  # 3 mantissa bits: half an ulp is 1/16
    torch.float8_e5m2: 1.3e-1,  # 2 mantissa bits
    torch.int8: 1e-2,  # per-row scaled int8: half a step of 1/127 of the row's range
}
TF32_TOLERANCE = 3e-4


def fp8_fast_accum_tolerance(k: int) -> float:
    """The relative-error budget of a sum over ``k`` products of fp8 operands accumulated in Hopper's fp8 MMA
    accumulator for the whole K (Triton's sm_90 default, torch's ``use_fast_accum=True``): that accumulator
    keeps about 14 bits of mantissa, one rounding an MMA instruction (32 of K), so random roundings grow the
    normwise error as sqrt(K / 32): 4 * 2^-14 * sqrt(ceil(K / 32)), a fourfold margin over the 1.6e-4 seen
    at K = 179 on the H200; at least the fp32 budget. The products themselves are exact in fp32."""
    return max(TOLERANCES[torch.float32], 4 * 2.0**-14 * math.sqrt(max(1, -(-k // 32))))


def tolerance(dtype: torch.dtype, *, tf32: bool = False) -> float:
    """The relative-error budget for an output of ``dtype`` (fp32 through tf32 tensor cores: 3e-4)."""
    if tf32 and dtype == torch.float32:
        return TF32_TOLERANCE
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise KeyError(f"no tolerance defined for {dtype}") from None


def gpu_available() -> bool:
    """True when kernels compile for a visible GPU in this process."""
    return (not _backend.interpreting()) and torch.cuda.is_available()


def default_device() -> torch.device:
    return torch.device("cuda") if gpu_available() else torch.device("cpu")


_INT_POISON = {torch.int8: -128, torch.uint8: 255, torch.int16: -(2**15), torch.int32: -(2**31), torch.int64: -(2**63)}


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a value no kernel should write: NaN for floats, the minimum for ints."""
    if t.dtype.is_floating_point:
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t.view(torch.uint8).fill_(0x7F)  # NaN in both fp8 formats (e4m3fn: 0x7F; e5m2: 0x7F is NaN too)
        else:
            t.fill_(float("nan"))
    elif t.dtype in _INT_POISON:
        t.fill_(_INT_POISON[t.dtype])
    elif t.dtype == torch.bool:
        raise TypeError("bool outputs cannot be poisoned: every value is legal")
    else:
        t.fill_(-1)
    return t


def cpu_select(t: torch.Tensor, index) -> torch.Tensor:
    """``t[index]`` on the CPU for any dtype: 8-bit floats through their bytes (torch before 2.10 has no CPU
    indexing of fp8), the same elements and dtype."""
    t = t.cpu()
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        return t.view(torch.uint8)[index].view(t.dtype)
    return t[index]


def empty_poisoned(*shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    return poison(torch.empty(shape, dtype=dtype, device=device))


def rel_error(out: torch.Tensor, ref: torch.Tensor, terms: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, terms) in float64 (absolute error when both are 0); NaN/inf in out gives
    nan. ``terms``: the size (root-sum-square) of the terms ``ref`` sums, for a result that cancels: its plain
    relative error cannot keep digits its fp32 terms do not hold, so it is held to the terms' size instead.

    Computed on ``out``'s device: a benchmark's 2^27-element check took ~5 s through the host (two fp64
    copies and the norms on the CPU) and is milliseconds on a GPU; fp64 is fp64 on either."""
    if tuple(out.shape) != tuple(ref.shape):
        raise AssertionError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    o = out.detach().to(dtype=torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    if not torch.isfinite(o).all() and torch.isfinite(r).all():
        return math.nan
    if o.numel() == 0:
        return 0.0
    num = torch.linalg.vector_norm(o - r).item()
    den = max(torch.linalg.vector_norm(r).item(), terms)
    return num / den if den > 0 else num


def assert_rel_close(out, ref, *, tol: float | None = None, dtype: torch.dtype | None = None, name: str = "output",
                     terms: float = 0.0):  # fmt: skip
    """Assert ||out - ref|| / max(||ref||, terms) <= tol (default: the tolerance of ``dtype`` or out.dtype); NaN
    fails. ``terms`` as in :func:`rel_error`."""
    if tol is None:
        tol = tolerance(dtype if dtype is not None else out.dtype)
    err = rel_error(out, ref, terms)
    if not (err <= tol):  # written so NaN fails
        o = out.detach().double().cpu()
        bad = (~torch.isfinite(o)).sum().item()
        raise AssertionError(
            f"{name}: relative error {err:.3e}{' (to max(||ref||, terms))' if terms else ''} exceeds {tol:.1e} "
            f"(shape {tuple(out.shape)}, dtype {out.dtype}, non-finite elements {bad})"
        )
    return err


def seeded_generator(seed: int, device=None) -> torch.Generator:
    g = torch.Generator(device=device or "cpu")
    g.manual_seed(seed)
    return g


def host_work(fn, *args, **kwargs) -> tuple[list[str], list[str]]:
    """(the torch ops ``fn(*args, **kwargs)`` runs other than allocations and views, the names of the kernels
    it launches through ``flydsl.compiler.launch``), every launch recorded and not run (the interpreter's own
    tensor work is not the call's). What a :mod:`flydsl.direct` recording watches: a call replays only where
    the first list is empty."""
    from .. import compiler, direct

    launches: list[str] = []
    real = compiler.launch
    compiler.launch = lambda kernel, grid, *a, **k: launches.append(kernel.__name__)
    try:
        watch = direct._Watch(launches)
        with watch:
            fn(*args, **kwargs)
    finally:
        compiler.launch = real
    return [str(op) for op in watch.foreign], launches
