"""The eager fast path's shared half: is this a small plain inference call, and its launch plan cache.

Small eager calls (decode-time batches) cost more on the host than on the
GPU: the general paths check every operand, look the config up, key the
launch on every argument. A plain call (a compiled GPU run, dense rows on the
current device, nothing for autograd to record, no tracing) instead looks up
a plan under a cheap key of its own, a :class:`flydsl.compiler.Bound` launch
and the rows a program takes, and launches it. The callers
(:func:`fly_norm._kernels.norm.eager_forward`, :func:`fly_norm.softmax.softmax`)
build the key from everything the kernel's compiled specialization depends
on for such a call: the operands' dtypes and 16-byte alignment (fresh outputs
are always aligned), the row width (also the row stride), the device and
whether M needs 64 bits (its value is never specialized).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

import flydsl.compiler as flyc
from flydsl import env

__all__ = ["plain_rows", "may_launch", "launch", "general_path_only"]

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_OFF: list = []  # non-empty while every call must take the general path (general_path_only)


@contextmanager
def general_path_only():
    """Calls made inside take the general path, never a plan: the tuning harness runs an op to capture
    the search task that only the general path builds."""
    _OFF.append(True)
    try:
        yield
    finally:
        _OFF.pop()


def plain_rows(x, max_n: int, *others) -> tuple[int, int, int] | None:
    """(m, n, device index) when ``x`` is dense rows of at most ``max_n`` columns on the current CUDA device
    in a compiled run, and neither ``x`` nor ``others`` (tensors or None) needs autograd, outside tracing
    and :func:`general_path_only`; None otherwise (the caller takes its general path)."""
    if torch.compiler.is_compiling() or _OFF:  # first: tracing cannot evaluate what follows
        return None
    if type(x) is not torch.Tensor or not x.is_cuda or flyc.interpreting() or x.dtype not in _FLOAT:
        return None
    if not x.dim() or not x.is_contiguous():
        return None
    n = x.shape[-1]
    dev = x.get_device()
    if not 0 < n <= max_n or dev != torch._C._cuda_getDevice():
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(t is not None and t.requires_grad for t in others)):
        return None
    m = x.numel() // n
    return (m, n, dev) if m else None


def may_launch(plans: dict, key) -> bool:
    """Whether :func:`launch` can serve ``key``: a plan is cached, or one may be made (no config search
    may be due: with ``FLYDSL_AUTOTUNE`` set, the general path runs the search, then serves its winner)."""
    return key in plans or not env.get("FLYDSL_AUTOTUNE")


def launch(plans: dict, key, m: int, args: tuple, make) -> None:
    """Launch the plan cached under ``key`` over ``m`` rows; ``make()`` gives (kernel, meta, rows a program)
    when there is none yet, and the plan binds ``kernel`` to ``args``' specialization."""
    plan = plans.get(key)
    if plan is None:
        kernel, meta, block_m = make()
        plan = plans[key] = (flyc.bind(kernel, *args, **meta), block_m)
    bound, block_m = plan
    bound(-(-m // block_m), *args)
