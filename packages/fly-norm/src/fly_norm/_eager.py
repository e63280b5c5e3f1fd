"""The eager fast path's shared half: is this a small plain inference call, and its launch plans.

Small eager calls (decode-time batches) cost more on the host than on the
GPU: the general paths check every operand, look the config up, key the
launch on every argument. A plain call (dense rows on the current CUDA
device, nothing for autograd to record, no tracing, no profiler hook) instead
looks up a plan under a cheap key of its own and launches it through
Triton's C launch function with every pointer given as an integer (the
launcher then skips its driver query a tensor).

The key is ``(prefix, dtype, n, device, m >> 31, x.data_ptr() % 16, weight
key, bias key)``: everything the kernel's compiled specialization depends on
for such a call (the operands' dtypes, shapes and 16-byte alignment, fresh
outputs being always aligned; the row width, also the row stride; the
device; M itself is never specialized), with the caller's ``prefix`` for
what else selects the kernel. What the key holds, the plan's ``make``
validates once: a key no plan can serve (a dtype or shape the kernel does not
take, too wide a row) caches None, and those calls take the general path,
which names what is wrong.

Two implementations serve plans. :data:`fast` is ``eager_native.c``
compiled at the first call on a GPU (:func:`flydsl.native.load`): the gate,
the key and the launch of a call without a residual or weight offset in C,
no Python bytecode between the caller and the launch; it reads the tensors
and allocates the output through torch's Python methods. The Python path
(:func:`rows_device`, :func:`vector_key`, :func:`make_plan`, :func:`launch`;
the callers :func:`fly_norm._norm_host.eager_forward` and
:func:`fly_norm.softmax._eager_fwd`) serves everything else and makes the
plans; both build the same key and fill the kernel's arguments from the
plan's layout (``ARG_*``).
"""

from __future__ import annotations

from contextlib import contextmanager
from importlib.resources import files

import torch

import flydsl.compiler as flyc
from flydsl import direct, env, native

__all__ = [
    "rows_device", "vector_key", "MISSING", "make_plan", "launch", "general_path_only", "grad_enabled",
    "compiling", "install",
    "fast", "ARG_NONE", "ARG_X", "ARG_W", "ARG_B", "ARG_Y", "ARG_M", "ARG_N", "ARG_EPS", "ARG_ZERO", "ARG_R", "ARG_H",
    "ARG_OFFSET",
]  # fmt: skip

# A plan's argument layout: for each runtime argument of its kernel, which value goes there (the same codes
# as eager_native.c; the C path fills ARG_NONE..ARG_ZERO and leaves layouts with a residual or a weight offset
# to Python).
ARG_NONE, ARG_X, ARG_W, ARG_B, ARG_Y, ARG_M, ARG_N, ARG_EPS, ARG_ZERO, ARG_R, ARG_H, ARG_OFFSET = range(12)

_TENSORS = (torch.Tensor, torch.nn.Parameter)  # a Parameter's torch-function handling is the tensor's
_OFF: list = []  # non-empty while every call must take the general path (general_path_only)
MISSING = object()  # what ``plans.get(key, MISSING)`` returns for a key with no plan yet: make one (make_plan)
# Bound once (each attribute chain costs ~50-100 ns a call): torch's current device and raw stream (absent
# from CPU-only builds, where no x is a CUDA tensor), the tracing and grad-mode checks, Triton's hooks.
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
compiling = torch.compiler.is_compiling
_hooks_idle = flyc.hooks_idle
grad_enabled = torch.is_grad_enabled


@contextmanager
def general_path_only():
    """Calls made inside take the general path, never a plan or a replay: the tuning harness runs an op to
    capture the search task that only the general path builds."""
    _OFF.append(True)
    try:
        with direct.general_path_only():
            yield
    finally:
        _OFF.pop()


def rows_device(x) -> int | None:
    """x's device index when x may be a plan's rows: a contiguous CUDA tensor (not a subclass) of at least one
    dimension on the current device, in an eager call with no profiler hook installed (not traced, not
    under :func:`general_path_only`); None otherwise (the caller takes its general path). The caller
    checks what autograd needs."""
    if _OFF or compiling():  # first: tracing cannot evaluate what follows
        return None
    if type(x) is not torch.Tensor or not x.is_cuda or not x.ndim or not x.is_contiguous():
        return None
    dev = x.get_device()
    return dev if dev == _current_device() and _hooks_idle() else None


def vector_key(v, dev: int):
    """A per-column operand's (weight, bias) part of a plan key: None when absent; False when no plan can
    take it (another device, not contiguous, a tensor subclass); else (dtype, shape, pointer mod 16)."""
    if v is None:
        return None
    if type(v) not in _TENSORS or not v.is_cuda or v.get_device() != dev or not v.is_contiguous():
        return False
    return v.dtype, v.shape, v.data_ptr() & 15


def make_plan(plans: dict, key, make):
    """Make and cache the plan of ``key`` (the caller found none: ``plans.get(key, MISSING) is MISSING``).
    ``make()`` gives (kernel, bind arguments, bind meta, rows a program, argument layout), or None when no
    plan can serve the key (cached as None: those calls take the general path). None, and nothing cached,
    while ``FLYDSL_AUTOTUNE`` is set: the general path runs the search, then serves its winner."""
    if env.get("FLYDSL_AUTOTUNE") or flyc.interpreting():
        return None
    made = make()
    if made is None:
        plans[key] = None
        return None
    kernel, args, meta, block_m, layout = made
    bound = flyc.bind(kernel, *args, **meta)
    direct = bound.direct()
    p = plans[key] = None if direct is None else (*direct, block_m, layout, bound.driver_signature())
    return p


def launch(p: tuple, m: int, n: int, x: int, w, b, y: int, eps=None, r=None, h=None, offset=None) -> None:
    """Launch plan ``p`` over ``m`` rows of ``n`` columns on the current stream; operands as ``data_ptr()``
    integers (None when absent), placed by the plan's layout."""
    c_launch, function, coop, pdl, packed, tail, device, block_m, layout, _ = p
    values = (None, x, w, b, y, m, n, eps, 0, r, h, offset)
    c_launch(-(-m // block_m), 1, 1, _current_stream(device), function, coop, pdl, None, None, packed,
             None, None, None, *[values[i] for i in layout], *tail)  # fmt: skip


def _first_fast(plans: dict, prefix, x, w, b, eps):
    """:data:`fast` until the first call on a CUDA tensor, which builds eager_native.c and rebinds
    :data:`fast` to its ``call`` (or to a stub returning None where it cannot be built)."""
    global fast
    if type(x) is not torch.Tensor or not x.is_cuda:
        return None  # nothing to build for the CPU: those calls take the general path
    mod = native.load("fly_norm_eager_native", (files(__package__) / "eager_native.c").read_text())
    if mod is None:
        fast = _no_fast
        return None
    install(mod)
    fast = mod.call
    return fast(plans, prefix, x, w, b, eps)


def install(mod) -> None:
    """Give eager_native.c (``mod``, loaded once a process) the live objects it reads and its driver launch.
    Its tests install stand-ins into the same module; they call this afterwards to put these back."""
    import triton  # after flydsl (its backend choice), as everywhere

    mod.setup(torch.Tensor, torch.nn.Parameter, _OFF, grad_enabled, _current_device, _current_stream,
              triton.knobs.runtime, torch.empty_like)  # fmt: skip
    mod.driver()  # launches straight through libcuda's cuLaunchKernel where it is found


def _no_fast(plans, prefix, x, w, b, eps):
    return None


# fast(plans, prefix, x, w, b, eps): y of a plain call through its cached plan (the key prefix ``prefix``;
# weight, bias and eps None where the op has none), or None: the Python path takes the call. Callers gate
# tracing first (``compiling()``): the C function is opaque to torch.compile.
fast = _first_fast
