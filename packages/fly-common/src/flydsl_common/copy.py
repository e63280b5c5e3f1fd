"""Strided copies as kernels: what host code would otherwise do with torch ops.

A family's host path that copies with torch (``dst.copy_(src)``, ``.contiguous()`` of a permuted view, a
zero-padded staging buffer filled by ``copy_`` and ``zero_``) cannot be replayed by :mod:`flydsl.direct`,
which records allocations, views and flydsl launches only. :func:`copy_padded` is that copy as one launch
(one dtype, bit for bit):

    dst[b, r, s] = src[b, r, s]   where src has the element (r < R and s < S)
                 = 0              elsewhere in dst (the padding)

over ``src`` ``[B, R, S]`` and ``dst`` ``[B, R', S']`` (R' >= R, S' >= S), any strides, so a transpose is a
copy into a transposed view of the destination. A program moves a ``BLOCK_R x BLOCK_S`` tile; Triton reads
it along the source's unit stride and writes it along the destination's, turning it through shared memory
between the two when they differ, so both sides are coalesced where their unit stride is.
"""

from __future__ import annotations

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.checks import describe, dtype_name
from flydsl.errors import DTypeError, ShapeError

from .device import row_offset

__all__ = ["copy_padded", "MAX_BATCH"]

MAX_BATCH = 65535  # grid axis 1 (the batch) of a launch


@flyc.kernel  # sizes and strides specialized on 16-divisibility: vector accesses where they allow
def _copy_padded_kernel(
    src_ptr, dst_ptr, R, S, RD, SD, s_b, s_r, s_s, d_b, d_r, d_s,
    BYTES: fx.constexpr, BLOCK_R: fx.constexpr, BLOCK_S: fx.constexpr,
):  # fmt: skip
    # The elements move as integers of their width: bit for bit (NaN payloads, -0.0), and the padding's 0 is
    # the integer 0, every format's +0 (a float 0 does not convert to fp8 in Triton's interpreter).
    if BYTES == 1:
        bits = fx.int8
    elif BYTES == 2:
        bits = fx.int16
    elif BYTES == 4:
        bits = fx.int32
    else:
        bits = fx.int64
    src = src_ptr.to(fx.pointer_type(bits))
    dst = dst_ptr.to(fx.pointer_type(bits))
    s_tiles = fx.cdiv(SD, BLOCK_S)
    pid = fx.program_id(0)
    b = fx.program_id(1)
    rr = (pid // s_tiles) * BLOCK_R + fx.arange(0, BLOCK_R)
    rs = (pid % s_tiles) * BLOCK_S + fx.arange(0, BLOCK_S)
    inside = (rr < R)[:, None] & (rs < S)[None, :]
    v = fx.load(src + row_offset(b, s_b) + row_offset(rr, s_r)[:, None] + row_offset(rs, s_s)[None, :],
                mask=inside, other=0)  # fmt: skip
    fx.store(dst + row_offset(b, d_b) + row_offset(rr, d_r)[:, None] + row_offset(rs, d_s)[None, :], v,
             mask=(rr < RD)[:, None] & (rs < SD)[None, :])  # fmt: skip


def _as_3d(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 2:
        return t.unsqueeze(0)
    if t.dim() != 3:
        raise ShapeError(f"{name}: expected a 2-D or 3-D tensor, got {describe(t)}")
    return t


@flyc.jit(skip_empty=False)  # an empty src still zero-fills its dst
def copy_padded(src: torch.Tensor, dst: torch.Tensor, stream=None) -> torch.Tensor:
    """``dst`` = ``src`` where src has the element, 0 in the rest of ``dst``; returns ``dst``.

    ``src`` ``[B, R, S]`` (or ``[R, S]``) and ``dst`` ``[B, R', S']`` (or ``[R', S']``), R' >= R, S' >= S,
    the same batch, B at most :data:`MAX_BATCH`; any strides (a transposed view of the destination makes
    the copy a transpose); one dtype (copied bit for bit). One launch, nothing else: replayable by
    :mod:`flydsl.direct`.
    """
    if dst.dtype != src.dtype:
        raise DTypeError(f"dst: expected src's dtype ({dtype_name(src.dtype)}), got {describe(dst)}")
    s3, d3 = _as_3d("src", src), _as_3d("dst", dst)
    nb, r, s = s3.shape
    if d3.shape[0] != nb or d3.shape[1] < r or d3.shape[2] < s or nb > MAX_BATCH:
        raise ShapeError(f"dst: expected [{nb}, >= {r}, >= {s}] (src's batch, at least its rows and columns; "
                         f"batch <= {MAX_BATCH}), got {describe(dst)} for src {describe(src)}")  # fmt: skip
    rd, sd = d3.shape[1], d3.shape[2]
    if nb == 0 or rd == 0 or sd == 0:
        return dst
    block_s = max(16, min(64, flyc.next_power_of_2(sd)))
    block_r = max(16, min(64, flyc.next_power_of_2(rd)))
    grid = (flyc.cdiv(rd, block_r) * flyc.cdiv(sd, block_s), nb)
    flyc.launch(
        _copy_padded_kernel, grid, s3, d3, r, s, rd, sd, *s3.stride(), *d3.stride(),
        BYTES=src.element_size(), BLOCK_R=block_r, BLOCK_S=block_s, num_warps=4, num_stages=1,
    )  # fmt: skip
    return dst
