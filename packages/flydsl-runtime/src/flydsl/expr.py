"""The device language: ``import flydsl.expr as fx``.

Kernel code imports only this module, never ``triton.language``, so the
language has one face. It is Triton's language (``fx.load``, ``fx.dot``,
``fx.constexpr``, ``fx.program_id`` ...) plus FlyDSL's helpers:

- index algebra on constexpr shapes: ``idx2crd`` (flat index -> coordinates)
  and ``crd2idx`` (coordinates -> flat index), row-major by default (last mode
  fastest, like torch) or with an explicit constexpr stride tuple;
- ``grouped_tile``: the grouped (L2-friendly) tile order used by matrix
  kernels: consecutive programs walk GROUP_M row-tiles down a column of tiles
  before moving right, so the B tiles they share stay in L2.

``fx.dot`` is Triton's ``tl.dot`` itself when kernels compile. Under Triton's
CPU interpreter it is a thin wrapper: the interpreter keeps bf16 values as
their raw 16-bit patterns and its dot multiplies those integers (results off
by ~1e9, NaN and inf lost), so bf16 operands are widened to fp32 first, which
is exact (a bf16 value is an fp32 value with the low 16 mantissa bits zero)
and keeps NaN and inf. Every family calls ``fx.dot``, never ``tl.dot``, so
all of them get this.
"""

from __future__ import annotations

import triton
import triton.language as _tl

from . import _backend

_OWN = ["idx2crd", "crd2idx", "grouped_tile"]
__all__ = [name for name in dir(_tl) if not name.startswith("_")] + _OWN


def __getattr__(name: str):
    # Triton's names are looked up on triton.language at every access instead of
    # being copied here: Triton's interpreter swaps those attributes for
    # interpreted versions while a kernel runs, and a copy would keep the
    # compiled-mode originals ("Did you forget to add @triton.jit?").
    try:
        return getattr(_tl, name)
    except AttributeError:
        raise AttributeError(f"module 'flydsl.expr' has no attribute {name!r}") from None


def __dir__():
    return sorted(set(__all__) | set(globals()))


@triton.constexpr_function
def _mode_stride(shape, stride, mode):
    """Stride of one mode: the given one, or row-major (product of the later extents)."""
    if stride is not None:
        return stride[mode]
    out = 1
    for extent in shape[mode + 1 :]:
        out *= extent
    return out


@triton.jit
def _coord(idx, shape: _tl.constexpr, mode: _tl.constexpr):
    return (idx // _mode_stride(shape, None, mode)) % shape[mode]


@triton.jit
def idx2crd(idx, shape: _tl.constexpr):
    """Row-major coordinates of flat index ``idx`` in ``shape`` (rank 1 to 4), as a tuple.

    ``idx`` may be a scalar or a block of indices; the first mode is not
    reduced modulo its extent, so indices past the end map past the end of
    mode 0 (callers mask them).
    """
    _tl.static_assert(len(shape) >= 1 and len(shape) <= 4, "idx2crd supports ranks 1 to 4")
    if len(shape) == 1:
        return (idx,)
    elif len(shape) == 2:
        return idx // shape[1], idx % shape[1]
    elif len(shape) == 3:
        return idx // (shape[1] * shape[2]), _coord(idx, shape, 1), idx % shape[2]
    else:
        return (
            idx // (shape[1] * shape[2] * shape[3]),
            _coord(idx, shape, 1),
            _coord(idx, shape, 2),
            idx % shape[3],
        )


@triton.jit
def crd2idx(crd, shape: _tl.constexpr, stride: _tl.constexpr = None):
    """Flat index of coordinate tuple ``crd`` in ``shape``: row-major, or with constexpr ``stride``."""
    _tl.static_assert(len(crd) == len(shape), "crd2idx: coordinate rank must equal shape rank")
    idx = crd[0] * _mode_stride(shape, stride, 0)
    for i in _tl.static_range(1, len(shape)):
        idx += crd[i] * _mode_stride(shape, stride, i)
    return idx


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: _tl.constexpr):
    """Map a linear program id to (pid_m, pid_n) in grouped order for L2 reuse.

    Programs are taken GROUP_M row-tiles at a time, column by column inside
    the group; the last group may be shorter. With GROUP_M = 1 this is plain
    row-major order.
    """
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = _tl.minimum(num_pid_m - first_m, GROUP_M)
    in_group = pid % width
    pid_m = first_m + in_group % size_m
    pid_n = in_group // size_m
    return pid_m, pid_n


if _backend.interpreting():
    # Decided once, when flydsl.expr is imported (the backend is fixed for the process by then): compiled
    # kernels see no ``dot`` here, so ``fx.dot`` falls through __getattr__ to ``tl.dot`` with no wrapper.

    def dot(input, other, acc=None, input_precision=None, allow_tf32=None, max_num_imprecise_acc=None,
            out_dtype=_tl.float32):  # fmt: skip
        """``tl.dot`` for the interpreter: two bf16 operands are widened to fp32 first.

        Triton 3.6's interpreter multiplies bf16 blocks as their uint16 bit patterns. Widened, the
        products are exact in fp32 and accumulate in fp32, as on the GPU's tensor cores. Everything else
        (other dtypes, a mixed pair, ``out_dtype=bf16``) goes to ``tl.dot`` unchanged, so it accepts and
        refuses exactly what the compiled dot does.
        """
        # tl.dot is looked up at each call: the interpreter swaps in its own version while a kernel runs
        if input.dtype == _tl.bfloat16 and other.dtype == _tl.bfloat16:
            input = input.to(_tl.float32)
            other = other.to(_tl.float32)
            if input_precision is None and allow_tf32 is None:
                input_precision = "ieee"  # widened bf16 values are exact in fp32: no tf32 rounding to model
        return _tl.dot(input, other, acc, input_precision, allow_tf32, max_num_imprecise_acc, out_dtype)
