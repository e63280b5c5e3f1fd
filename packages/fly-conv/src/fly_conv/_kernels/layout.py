"""The host path's data movement as kernels: a batched transpose (layouts) and the weight gradient's
split sum.

Both replace torch ops of the host code (``.contiguous()`` of a permuted view, ``sum(0).to(dtype)``) so
that a call's whole device work is allocations and flydsl launches, which :mod:`flydsl.direct` can replay:

- :func:`launch_transpose`: ``dst[b, s, r] = src[b, r, s]``: an NC* input to channels-last (``[N, C,
  positions]`` to ``[N, positions, C]``), and the weight packs of the implicit GEMM (``[K_out, C_in / groups,
  taps]`` to ``[K_out, taps, C_in / groups]``; the input gradient's ``[groups, K_out / groups, C_in / groups *
  taps]`` to ``[groups, C_in / groups * taps, K_out / groups]``): flydsl-common's strided copy
  (:func:`flydsl_common.copy.copy_padded`) into the destination's transposed view.
- :func:`launch_sum_splits`: the weight gradient's fp32 partial sums added in split order (fixed: the result
  never depends on scheduling) and cast once to the gradient's dtype.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.copy import MAX_BATCH, copy_padded
from flydsl_common.device import row_offset

__all__ = ["launch_transpose", "launch_sum_splits", "MAX_BATCH"]


def launch_transpose(src, dst, stream=None):
    """``dst[b, s, r] = src[b, r, s]``; ``src`` ``[B, R, S]`` and ``dst`` ``[B, S, R]`` (any strides, one
    dtype, B at most :data:`MAX_BATCH`): the shared strided copy into dst's transposed view."""
    copy_padded(src, dst.transpose(1, 2), stream=stream)


@flyc.kernel(do_not_specialize=["n", "splits"])
def _sum_splits_kernel(parts_ptr, out_ptr, n, splits, s_split, BLOCK: fx.constexpr):
    offs = fx.program_id(0).to(fx.int64) * BLOCK + fx.arange(0, BLOCK)
    mask = offs < n
    acc = fx.zeros([BLOCK], dtype=fx.float32)
    for s in range(0, splits):
        acc += fx.load(parts_ptr + row_offset(s, s_split) + offs, mask=mask, other=0.0)
    fx.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_SUM_BLOCK = 1024


@flyc.jit
def launch_sum_splits(parts, out, stream=None):
    """``out = parts.sum(0)`` in ``out``'s dtype, added in split order: ``parts`` ``[splits, n]`` fp32 (rows
    contiguous), ``out`` ``[n]`` contiguous."""
    splits, n = parts.shape
    flyc.launch(_sum_splits_kernel, (flyc.cdiv(n, _SUM_BLOCK),), parts, out, n, splits, parts.stride(0),
                BLOCK=_SUM_BLOCK, num_warps=4)  # fmt: skip
