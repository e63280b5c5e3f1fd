"""The host path's data movement as kernels: a batched transpose (layouts), the weight gradient's split sum
and the bias gradient's channel sum.

Both replace torch ops of the host code (``.contiguous()`` of a permuted view, ``sum(0).to(dtype)``) so
that a call's whole device work is allocations and flydsl launches, which :mod:`flydsl.direct` can replay:

- :func:`launch_transpose`: ``dst[b, s, r] = src[b, r, s]``: an NC* input to channels-last (``[N, C,
  positions]`` to ``[N, positions, C]``), and the weight packs of the implicit GEMM (``[K_out, C_in / groups,
  taps]`` to ``[K_out, taps, C_in / groups]``; the input gradient's ``[groups, K_out / groups, C_in / groups *
  taps]`` to ``[groups, C_in / groups * taps, K_out / groups]``): flydsl-common's strided copy
  (:func:`flydsl_common.copy.copy_padded`) into the destination's transposed view.
- :func:`launch_sum_splits`: the weight gradient's fp32 partial sums added in split order (fixed: the result
  never depends on scheduling) and cast once to the gradient's dtype.
- :func:`launch_channel_sum`: the bias gradient, the output gradient summed over batch and positions per
  channel (fp32 partial sums of row runs, then the split sum). torch's sum over the non-channel dims of a
  channels-last tensor took ~30 us for 12.8 MB on the H200 (under a tenth of the copy rate).
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.copy import MAX_BATCH, copy_padded
from flydsl_common.device import row_offset

__all__ = ["launch_transpose", "launch_sum_splits", "launch_channel_sum", "MAX_BATCH"]


def launch_transpose(src, dst, stream=None):
    """``dst[b, s, r] = src[b, r, s]``; ``src`` ``[B, R, S]`` and ``dst`` ``[B, S, R]`` (any strides, one
    dtype, B at most :data:`MAX_BATCH`): the shared strided copy into dst's transposed view."""
    copy_padded(src, dst.transpose(1, 2), stream=stream)


@flyc.kernel(do_not_specialize=["n", "splits"])
def _sum_splits_kernel(parts_ptr, out_ptr, n, splits, s_split, BLOCK: fx.constexpr, SPLITS_BLOCK: fx.constexpr):
    offs = fx.program_id(0).to(fx.int64) * BLOCK + fx.arange(0, BLOCK)
    mask = offs < n
    acc = fx.zeros([BLOCK], dtype=fx.float32)
    for s0 in range(0, splits, SPLITS_BLOCK):
        rs = s0 + fx.arange(0, SPLITS_BLOCK)
        tile = fx.load(parts_ptr + row_offset(rs, s_split)[:, None] + offs[None, :],
                       mask=(rs < splits)[:, None] & mask[None, :], other=0.0)  # fmt: skip
        acc += fx.sum(tile, axis=0)
    fx.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# (columns a program, splits a load). A loop of one split a step waits out a memory latency a split: 32 splits
# of the 3x3 64 -> 64 weight gradient took 14 us for 4.7 MB on the H200. From 16 splits, 16 a load over 128
# columns (the 1x1 256 -> 64 layer's searched weight gradient: 52.7 -> 42.7 us, now at 128 splits); under 16,
# one a step over 1024 columns, which ran 4 splits of the 256 -> 256 layer's 590K weights ~10 us faster than
# the 16-row tile (mostly masked rows, summed across warps).
_SUM_MANY = (128, 16)
_SUM_FEW = (1024, 1)


@flyc.jit
def launch_sum_splits(parts, out, stream=None):
    """``out = parts.sum(0)`` in ``out``'s dtype, in a fixed order (blocks of splits, each summed as a tree,
    added in split order), so the result never depends on scheduling: ``parts`` ``[splits, n]`` fp32 (rows
    contiguous), ``out`` ``[n]`` contiguous."""
    splits, n = parts.shape
    block, splits_block = _SUM_MANY if splits >= _SUM_MANY[1] else _SUM_FEW
    flyc.launch(_sum_splits_kernel, (flyc.cdiv(n, block),), parts, out, n, splits, parts.stride(0),
                BLOCK=block, SPLITS_BLOCK=splits_block, num_warps=4)  # fmt: skip


@flyc.kernel(do_not_specialize=["rows", "positions", "channels", "rows_per_split"])
def _channel_sum_kernel(g_ptr, parts_ptr, rows, positions, channels, rows_per_split, s_n, s_p, s_c, s_split,
                        BLOCK_R: fx.constexpr, BLOCK_C: fx.constexpr):  # fmt: skip
    # rows: batch x positions (row r is (r // positions, r % positions)); one program a column block and split
    cols = fx.program_id(0) * BLOCK_C + fx.arange(0, BLOCK_C)
    split = fx.program_id(1)
    r_begin = split * rows_per_split
    r_end = fx.minimum(r_begin + rows_per_split, rows)
    col_ok = cols < channels
    col_off = row_offset(cols, s_c)
    acc = fx.zeros([BLOCK_R, BLOCK_C], dtype=fx.float32)
    for r0 in range(r_begin, r_end, BLOCK_R):
        r = r0 + fx.arange(0, BLOCK_R)
        n = r // positions
        off = row_offset(n, s_n) + row_offset(r - n * positions, s_p)
        tile = fx.load(g_ptr + off[:, None] + col_off[None, :], mask=(r < r_end)[:, None] & col_ok[None, :],
                       other=0.0)  # fmt: skip
        acc += tile.to(fx.float32)
    fx.store(parts_ptr + row_offset(split, s_split) + cols, fx.sum(acc, axis=0), mask=col_ok)


# (rows, channels) of a load (8 warps: 16 KB of the output gradient in flight a program); splits at most 128,
# because the split sum walks the splits one block of 16 after another (392 splits of 64 channels took 18 us
# there on the H200, the channel sum itself 6 us); a split at least a few loads' worth of rows.
_CSUM_BLOCK = (128, 64)
_CSUM_WARPS = 8
_CSUM_MAX_SPLITS = 128
_CSUM_MIN_ROWS = 512


def channel_sum_splits(rows: int, channels: int) -> tuple[int, int]:
    """(splits, rows a split) of :func:`launch_channel_sum` for ``rows`` (batch x positions) x ``channels``:
    rows a split a multiple of the row block and at least :data:`_CSUM_MIN_ROWS`, at most
    :data:`_CSUM_MAX_SPLITS` splits, every split holding rows."""
    block_r = _CSUM_BLOCK[0]
    per_split = max(_CSUM_MIN_ROWS, -(-rows // _CSUM_MAX_SPLITS))
    per_split = -(-per_split // block_r) * block_r
    return -(-rows // per_split), per_split


@flyc.jit
def launch_channel_sum(g3, parts, out, stream=None):
    """``out[c] = g3.sum((0, 1))[c]`` in ``out``'s dtype, in a fixed order: ``g3`` ``[N, positions, C]``
    (any strides; rows past 2^31 elements fine), ``parts`` ``[splits, C]`` fp32 with ``splits`` from
    :func:`channel_sum_splits` (contiguous rows), ``out`` ``[C]`` contiguous. At least one row."""
    nb, positions, channels = g3.shape
    splits, per_split = channel_sum_splits(nb * positions, channels)
    block_r, block_c = _CSUM_BLOCK
    flyc.launch(_channel_sum_kernel, (flyc.cdiv(channels, block_c), splits), g3, parts, nb * positions, positions,
                channels, per_split, *g3.stride(), parts.stride(0), BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=_CSUM_WARPS)  # fmt: skip
    launch_sum_splits(parts, out, stream=stream)
