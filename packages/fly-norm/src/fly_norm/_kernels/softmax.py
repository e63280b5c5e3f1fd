"""Softmax's row kernels, forward and backward: the single pass, bf16 rows held packed, and the chunked
passes (how each works: :mod:`fly_norm.softmax`'s docstring). Device code only: which rows take them, their
configs and launches are in :mod:`fly_norm.softmax`.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx

from .pairs import as_words, bf16_pairs, bf16_pairs_again, bf16_pairs_third, bf16_words
from .passes import LOG2E, NEG_INF, finite_or_zero, softmax_lane_stats, softmax_write

__all__ = ["softmax_fwd_kernel", "softmax_bwd_kernel"]


# Two bf16 -inf in an int32 word (0xFF80FF80): what masked-off words of a packed row read as.
_NEG_INF_PAIR = fx.constexpr(-8323200)


@flyc.func
def _packed_softmax_rows(x_rows, y_rows, row_ok, N, BLOCK_N: fx.constexpr):
    """The single pass with bf16 rows held packed, two columns an int32 word (as the norms' packed passes):
    the max over the words widened once, the sum of exp over them widened again, y from a third widening,
    written as bf16 pairs. Each widening is an instruction of its own (:func:`.device.bf16_pairs_again`,
    :func:`.device.bf16_pairs_third`), so the compiler holds no fp32 copy of the row through the
    reductions (half the registers: two programs an SM at 32K columns over 8 warps)."""
    c2 = fx.arange(0, BLOCK_N // 2)
    mask2 = row_ok[:, None] & (c2 < N // 2)[None, :]
    words = fx.load(as_words(x_rows) + c2[None, :], mask=mask2, other=_NEG_INF_PAIR)
    e, o = bf16_pairs(words)
    m = finite_or_zero(fx.max(fx.maximum(e, o), axis=1))[:, None]
    e, o = bf16_pairs_again(words)
    s = fx.sum(fx.exp2((e - m) * LOG2E) + fx.exp2((o - m) * LOG2E), axis=1)
    inv = 1.0 / fx.where(row_ok, s, 1.0)  # padding rows: no 1/0
    # A zero the compiler cannot prove: the sign bit of a sum of exponentials (a NaN row stays NaN anyway).
    e, o = bf16_pairs_third(words, (s.to(fx.int32, bitcast=True) >> 31)[:, None])
    inv = inv[:, None]
    out = bf16_words(fx.exp2((e - m) * LOG2E) * inv, fx.exp2((o - m) * LOG2E) * inv)
    fx.store(as_words(y_rows) + c2[None, :], out, mask=mask2)


@flyc.kernel(do_not_specialize=["M"])
def softmax_fwd_kernel(
    x_ptr,
    y_ptr,
    M,
    N,
    stride_x,
    stride_y,
    BLOCK_M: fx.constexpr,
    BLOCK_N: fx.constexpr,
    SINGLE_PASS: fx.constexpr,
    N_FIXED: fx.constexpr,
    PACKED: fx.constexpr = False,
):
    if N_FIXED != 0:
        N = N_FIXED  # chunked rows: a compile-time width (passes.row_meta)
    # Row indices in int64: M x N past 2**31 elements must not overflow.
    rows = fx.program_id(0).to(fx.int64) * BLOCK_M + fx.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = fx.arange(0, BLOCK_N)
    x_rows = x_ptr + rows[:, None] * stride_x
    y_rows = y_ptr + rows[:, None] * stride_y

    if PACKED:  # bf16 rows of even width and strides, 4-byte aligned (passes.packed_plan)
        _packed_softmax_rows(x_rows, y_rows, row_ok, N, BLOCK_N)
    elif SINGLE_PASS:
        mask = row_ok[:, None] & (cols[None, :] < N)
        x = fx.load(x_rows + cols[None, :], mask=mask, other=NEG_INF).to(fx.float32)
        m = finite_or_zero(fx.max(x, axis=1))
        e = fx.exp2((x - m[:, None]) * LOG2E)
        inv = 1.0 / fx.where(row_ok, fx.sum(e, axis=1), 1.0)  # padding rows: no 1/0
        fx.store(y_rows + cols[None, :], (e * inv[:, None]).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Chunked rows (passes.py): pass 1 keeps an online (max, sum) per lane, merged once; pass 2
        # re-reads the row (from L2) back to front and writes y.
        m, s = softmax_lane_stats(x_rows, row_ok, cols, N, BLOCK_M, BLOCK_N)
        inv = 1.0 / fx.where(row_ok, s, 1.0)  # padding rows: no 1/0
        softmax_write(x_rows, y_rows, row_ok, cols, N, finite_or_zero(m), inv, BLOCK_N)


@flyc.kernel(do_not_specialize=["M"])
def softmax_bwd_kernel(
    dy_ptr,
    y_ptr,
    dx_ptr,
    M,
    N,
    stride_dy,
    stride_y,
    stride_dx,
    BLOCK_M: fx.constexpr,
    BLOCK_N: fx.constexpr,
    SINGLE_PASS: fx.constexpr,
    N_FIXED: fx.constexpr,
    PACKED: fx.constexpr = False,
):
    if SINGLE_PASS:
        rows = fx.program_id(0).to(fx.int64) * BLOCK_M + fx.arange(0, BLOCK_M)
        row_ok = rows < M
        cols = fx.arange(0, BLOCK_N)
        dy_rows = dy_ptr + rows[:, None] * stride_dy
        y_rows = y_ptr + rows[:, None] * stride_y
        dx_rows = dx_ptr + rows[:, None] * stride_dx
        mask = row_ok[:, None] & (cols[None, :] < N)
        dy = fx.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(fx.float32)
        y = fx.load(y_rows + cols[None, :], mask=mask, other=0.0).to(fx.float32)
        dot = fx.sum(dy * y, axis=1)
        fx.store(dx_rows + cols[None, :], (y * (dy - dot[:, None])).to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        fx.static_assert(BLOCK_M == 1, "chunked rows: one row a program (row_config_valid)")
        if N_FIXED != 0:
            N = N_FIXED  # chunked rows: a compile-time width (passes.row_meta)
        _softmax_bwd_chunked_row(dy_ptr, y_ptr, dx_ptr, N, stride_dy, stride_y, stride_dx, BLOCK_N)


@flyc.func
def _softmax_bwd_chunked_row(dy_ptr, y_ptr, dx_ptr, N, stride_dy, stride_y, stride_dx, BLOCK_N: fx.constexpr):
    """The chunked backward of this program's row (chunked configs hold one row a program, and the grid
    is the row count: no row mask): sum(dy * y) accumulated lane-wise over the chunks and reduced once (no
    cross-warp reduction a chunk, shorter fp32 chains), then dx chunk by chunk, front to back, the row read
    again (from L2: evict_last on the first read, evict_first on the second). One row in 1D, the loads
    unpredicated where N is fixed: 440 SASS instructions at 16K x 8192 x 16 warps against 512 with a row
    mask on [1, BLOCK_N] blocks (sm_90)."""
    row = fx.program_id(0).to(fx.int64)
    cols = fx.arange(0, BLOCK_N)
    dy_row = dy_ptr + row * stride_dy
    y_row = y_ptr + row * stride_y
    dx_row = dx_ptr + row * stride_dx
    acc = fx.zeros([BLOCK_N], dtype=fx.float32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        dy = fx.load(dy_row + c, mask=c < N, other=0.0, eviction_policy="evict_last")
        y = fx.load(y_row + c, mask=c < N, other=0.0, eviction_policy="evict_last")
        acc += dy.to(fx.float32) * y.to(fx.float32)
    dot = fx.sum(acc, axis=0)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        dy = fx.load(dy_row + c, mask=c < N, other=0.0, eviction_policy="evict_first")
        y = fx.load(y_row + c, mask=c < N, other=0.0, eviction_policy="evict_first").to(fx.float32)
        fx.store(dx_row + c, (y * (dy.to(fx.float32) - dot)).to(dx_ptr.dtype.element_ty), mask=c < N)
