"""The eager fast path's shared half: is this a small plain inference call, and its launch plans.

Small eager calls (decode-time batches) cost more on the host than on the
GPU: the general paths check every operand, look the config up, key the
launch on every argument. A plain call (dense rows on the current CUDA
device, nothing for autograd to record, no tracing, no profiler hook) instead
looks up a plan under a cheap key of its own and launches it through
Triton's C launch function with every pointer given as an integer (the
launcher then skips its driver query a tensor).

The callers (:func:`fly_norm._kernels.norm.eager_forward`,
:func:`fly_norm.softmax.softmax`) build the key from everything the kernel's
compiled specialization depends on for such a call: the operands' dtypes,
shapes and 16-byte alignment (fresh outputs are always aligned), the row
width (also the row stride) and the device (M is never specialized). What
the key holds, the plan's ``make`` validates once: a key no plan can serve
(a dtype or shape the kernel does not take, too wide a row) caches None, and
those calls take the general path, which names what is wrong.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

import flydsl.compiler as flyc
from flydsl import env

__all__ = ["rows_device", "vector_key", "MISSING", "make_plan", "launch", "general_path_only", "grad_enabled"]

_TENSORS = (torch.Tensor, torch.nn.Parameter)  # a Parameter's torch-function handling is the tensor's
_OFF: list = []  # non-empty while every call must take the general path (general_path_only)
MISSING = object()  # what ``plans.get(key, MISSING)`` returns for a key with no plan yet: make one (make_plan)
# Bound once (each attribute chain costs ~50-100 ns a call): torch's current device and raw stream (absent
# from CPU-only builds, where no x is a CUDA tensor), the tracing and grad-mode probes, Triton's hooks.
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_compiling = torch.compiler.is_compiling
_hooks_idle = flyc.hooks_idle
grad_enabled = torch.is_grad_enabled


@contextmanager
def general_path_only():
    """Calls made inside take the general path, never a plan: the tuning harness runs an op to capture
    the search task that only the general path builds."""
    _OFF.append(True)
    try:
        yield
    finally:
        _OFF.pop()


def rows_device(x) -> int | None:
    """x's device index when x may be a plan's rows: a contiguous CUDA tensor (not a subclass) of at least one
    dimension on the current device, in an eager call with no profiler hook installed (not traced, not
    under :func:`general_path_only`); None otherwise (the caller takes its general path). The caller
    checks what autograd needs."""
    if _OFF or _compiling():  # first: tracing cannot evaluate what follows
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
    ``make()`` gives (kernel, bind arguments, bind meta, rows a program), or None when no plan can serve the
    key (cached as None: those calls take the general path). None, and nothing cached, while
    ``FLYDSL_AUTOTUNE`` is set: the general path runs the search, then serves its winner."""
    if env.get("FLYDSL_AUTOTUNE") or flyc.interpreting():
        return None
    made = make()
    if made is None:
        plans[key] = None
        return None
    kernel, args, meta, block_m = made
    direct = flyc.bind(kernel, *args, **meta).direct()
    p = plans[key] = None if direct is None else (*direct, block_m)
    return p


def launch(p: tuple, m: int, *args) -> None:
    """Launch plan ``p`` over ``m`` rows on the current stream; tensors in ``args`` given as ``data_ptr()``."""
    c_launch, function, coop, pdl, packed, tail, device, block_m = p
    c_launch(-(-m // block_m), 1, 1, _current_stream(device), function, coop, pdl, None, None, packed,
             None, None, None, *args, *tail)  # fmt: skip
