"""The host path's data movement as kernels: a batched transpose (layouts) and the weight gradient's
split sum.

Both replace torch ops of the host code (``.contiguous()`` of a permuted view, ``sum(0).to(dtype)``) so
that a call's whole device work is allocations and flydsl launches, which :mod:`flydsl.direct` can replay:

- :func:`launch_transpose`: ``dst[b, s, r] = src[b, r, s]``: an NC* input to channels-last (``[N, C,
  positions]`` to ``[N, positions, C]``), and the weight packs of the implicit GEMM (``[K_out, C_in / groups,
  taps]`` to ``[K_out, taps, C_in / groups]``; the input gradient's ``[groups, K_out / groups, C_in / groups *
  taps]`` to ``[groups, C_in / groups * taps, K_out / groups]``). A tile is read along ``s`` and written
  along ``r`` (Triton turns the tile through shared memory between the two), so both sides are coalesced
  when their unit stride is there.
- :func:`launch_sum_splits`: the weight gradient's fp32 partial sums added in split order (fixed: the result
  never depends on scheduling) and cast once to the gradient's dtype.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

__all__ = ["launch_transpose", "launch_sum_splits", "MAX_BATCH"]

MAX_BATCH = 65535  # grid axis 1 (the batch) of a transpose launch


@flyc.kernel(do_not_specialize=["R", "S", "s_b", "d_b"])
def _transpose_kernel(
    src_ptr, dst_ptr, R, S, s_b, s_r, s_s, d_b, d_s, d_r, BLOCK_R: fx.constexpr, BLOCK_S: fx.constexpr
):
    s_tiles = fx.cdiv(S, BLOCK_S)
    pid = fx.program_id(0)
    b = fx.program_id(1)
    rr = (pid // s_tiles) * BLOCK_R + fx.arange(0, BLOCK_R)
    rs = (pid % s_tiles) * BLOCK_S + fx.arange(0, BLOCK_S)
    mask = (rr < R)[:, None] & (rs < S)[None, :]
    v = fx.load(src_ptr + row_offset(b, s_b) + row_offset(rr, s_r)[:, None] + row_offset(rs, s_s)[None, :],
                mask=mask)  # fmt: skip
    fx.store(dst_ptr + row_offset(b, d_b) + row_offset(rr, d_r)[:, None] + row_offset(rs, d_s)[None, :], v,
             mask=mask)  # fmt: skip


@flyc.jit
def launch_transpose(src, dst, stream=None):
    """``dst[b, s, r] = src[b, r, s]``; ``src`` ``[B, R, S]`` and ``dst`` ``[B, S, R]`` (any strides, one
    dtype, B at most :data:`MAX_BATCH`)."""
    nb, r, s = src.shape
    block_s = max(16, min(64, flyc.next_power_of_2(s)))
    block_r = max(16, min(64, flyc.next_power_of_2(r)))
    grid = (flyc.cdiv(r, block_r) * flyc.cdiv(s, block_s), nb)
    flyc.launch(
        _transpose_kernel, grid, src, dst, r, s, *src.stride(), *dst.stride(),
        BLOCK_R=block_r, BLOCK_S=block_s, num_warps=4, num_stages=1,
    )  # fmt: skip


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
