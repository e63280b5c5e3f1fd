"""Device helpers of the forwards' chunked passes over a row's ``N`` columns, shared by :mod:`.norm`
and :mod:`.softmax` (and their constants by :mod:`.split`). Device code only: the host side of these
passes (the chunked config, packing, launch constexprs) is :mod:`fly_norm._row_plans`.

A row too wide to keep in registers is read twice (three times for the
quantized LayerNorm), a chunk of ``BLOCK_N`` columns at a time.

- :func:`lane_stats` (pass 1): each lane of the ``[BLOCK_M, BLOCK_N]`` block
  accumulates its own statistics over the chunks and the lanes are merged
  once after the loop: no reduction across warps (a barrier) before or inside it.
  RMSNorm sums squares; LayerNorm sums each lane's deviations from its first
  element and their squares, never E[h^2] - E[h]^2 about 0 (which cancels
  when |mean| >> std). Its loads are marked evict_last so that the next pass's
  re-read of the row finds it in L2.
- :func:`lane_amax` (quantized LayerNorm): the absolute max of y, per lane, a pass of its own (the
  quantized RMSNorm gets it from pass 1: :func:`weighted`).
- :func:`write_y` (last pass): y (or its quantized codes) from the re-read.
- softmax: :func:`softmax_lane_stats` (pass 1: each lane's online max and sum
  of exponentials, one exp an element, merged once) and :func:`softmax_write`.

``rows`` are ``[BLOCK_M, 1]``-shaped pointer blocks (``x_rows`` ...) and
``row_ok`` masks the rows past M.

Chunked kernels take the row width as a compile-time constant (``N_FIXED``,
see :func:`fly_norm._row_plans.row_meta`): with a fixed trip count ptxas unrolls the chunk loops
and issues a row's chunk loads back to back (sm_90: all 16 loads of a 32K
row's pass 1 at 2048-column chunks, against 4 with N at run time).
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import absmax_f32, cast_sat_fp8e4m3, cast_sat_int8, maximum_nan, row_offset

from .affine import load_weight
from .pairs import sat_fp8e4m3_pairs, sat_int8_pairs, sum_absmax_f32

__all__ = [
    "LOG2E", "NEG_INF", "row_mean", "clear_share", "finite_or_zero", "row_ptrs", "load_h",
    "normalize", "weighted", "quantize", "quantize_pairs", "lane_stats", "lane_amax", "write_y",
    "softmax_lane_stats", "softmax_write",
]  # fmt: skip

# exp(x) = exp2(x * log2(e)): exp2 is the hardware instruction (and the interpreter has no libdevice).
# The difference x - max is formed first, so large magnitudes (|x| ~ 1e4) lose no precision to the scaling.
LOG2E = fx.constexpr(1.4426950408889634)
NEG_INF = fx.constexpr(float("-inf"))


@flyc.func
def row_mean(total, N):
    """total / N correctly rounded (div_rn), not Triton's approximate `/` (within 2 ulp on the GPU): a row
    whose sum is exact (a row of one value, as padding rows are) then has its mean exactly, so LayerNorm gives
    it exact zeros as torch does, where one ulp off would leave ulp * rstd of noise that the quantized
    variants scale up to full-range codes."""
    return fx.div_rn(total, fx.zeros_like(total) + N)


@flyc.func
def clear_share(clear_ptr, clear_n):
    """Zero this program's share of the ``clear_n`` int64 words at ``clear_ptr`` (an equal cut of them over
    every program of the grid, in 256-word stores): a split launch's pooled slots, made ready for a later
    launch in stream order (:func:`fly_norm._split_host.take_slots`, ``take_fwd_slots``)."""
    programs = fx.num_programs(0) * fx.num_programs(1)
    per = (clear_n + programs - 1) // programs
    first = (fx.program_id(1) * fx.num_programs(0) + fx.program_id(0)) * per
    last = fx.minimum(first + per, clear_n)
    for i in range(first, last, 256):
        w = i + fx.arange(0, 256)
        fx.store(clear_ptr + w, fx.zeros([256], dtype=fx.int64), mask=w < last)


@flyc.func
def finite_or_zero(m):
    """A running max with -inf replaced by 0.

    A row (or a padding row) whose elements so far are all -inf has max -inf;
    subtracting it would give exp(-inf - -inf) = NaN. Against 0, those
    elements give exp(-inf) = 0 and the row's sum stays 0.
    """
    return fx.where(m > NEG_INF, m, 0.0)


@flyc.func
def row_ptrs(x_ptr, r_ptr, y_ptr, h_ptr, rows, stride_x, stride_r, stride_y, stride_h, HAS_RESIDUAL: fx.constexpr):
    """[rows, 1] pointer blocks of x, residual, y and residual_out for ``rows`` (int64 offsets). Without a
    residual (its operands arrive as None) x's and y's blocks stand in for its two: callers use them only
    under HAS_RESIDUAL, and a device function returns one type from both branches."""
    x_rows = x_ptr + row_offset(rows, stride_x)[:, None]
    y_rows = y_ptr + row_offset(rows, stride_y)[:, None]
    r_rows = x_rows
    h_rows = y_rows
    if HAS_RESIDUAL:
        r_rows = r_ptr + row_offset(rows, stride_r)[:, None]
        h_rows = h_ptr + row_offset(rows, stride_h)[:, None]
    return x_rows, r_rows, y_rows, h_rows


@flyc.func
def load_h(x_rows, r_rows, c, mask, HAS_RESIDUAL: fx.constexpr, EVICT: fx.constexpr):
    """h = x (+ residual) of one chunk, in fp32 (16-bit arithmetic is never used); ``EVICT``: cache hint.

    With a residual, h is the sum as residual_out stores it: added in fp32, rounded to the residual's dtype
    (residual_out's). The norm of that stored h is what the backward differentiates (it reads h back from
    residual_out against the forward's statistics) and what torch's ``norm(x + residual)`` computes: the
    statistics of the unrounded sum beside a rounded h put a row of one value's rounding error, times
    rstd = 1 / sqrt(eps), into the gradient."""
    h = fx.load(x_rows + c, mask=mask, other=0.0, eviction_policy=EVICT).to(fx.float32)
    if HAS_RESIDUAL:
        h = stored_sum(h, fx.load(r_rows + c, mask=mask, other=0.0, eviction_policy=EVICT))
    return h


@flyc.func
def stored_sum(h, r):
    """fp32 ``h`` + residual ``r``, added in fp32 and rounded to r's dtype (residual_out's), back in fp32."""
    return (h + r.to(fx.float32)).to(r.dtype).to(fx.float32)


@flyc.func
def normalize(
    h, mean, rstd, w_ptr, b_ptr, s_ptr, c, cmask, weight_offset,
    HAS_WEIGHT: fx.constexpr, HAS_BIAS: fx.constexpr, HAS_SMOOTH: fx.constexpr,
):  # fmt: skip
    """(h - mean) * rstd * (w + offset) + b (* smooth) for a [BLOCK_M, BLOCK_N] chunk of columns ``c``."""
    y = (h - mean[:, None]) * rstd[:, None]
    if HAS_WEIGHT:
        y = y * load_weight(w_ptr, c, cmask, weight_offset, True, "")[None, :]
    if HAS_BIAS:
        y = y + fx.load(b_ptr + c, mask=cmask, other=0.0).to(fx.float32)[None, :]
    if HAS_SMOOTH:
        y = y * fx.load(s_ptr + c, mask=cmask, other=0.0).to(fx.float32)[None, :]
    return y


@flyc.func
def weighted(h, w_ptr, s_ptr, c, cmask, weight_offset, HAS_WEIGHT: fx.constexpr, HAS_SMOOTH: fx.constexpr):
    """h * (w + offset) (* smooth): RMSNorm's y before its row scale rstd (RMSNorm has no bias).

    The quantized RMSNorm: y = u * rstd with u = weighted(h), and rstd > 0 scales every element of the
    row alike, so max |y| = rstd * max |u|: the row's sum of squares and max |u| come out of one
    reduction, before rstd is known (:func:`lane_stats` with UMAX). The codes, y * QMAX / max |y|, are
    then u * QMAX / max |u| (one product an element, rstd cancelled); the row scale is rstd * max |u| /
    QMAX.
    """
    u = h
    if HAS_WEIGHT:
        u = u * load_weight(w_ptr, c, cmask, weight_offset, True, "")[None, :]
    if HAS_SMOOTH:
        u = u * fx.load(s_ptr + c, mask=cmask, other=0.0).to(fx.float32)[None, :]
    return u


@flyc.func
def quantize(y, inv, QUANT: fx.constexpr):
    """Codes of y scaled by the per-row ``inv``: int8 (QUANT 1) or fp8 e4m3 (QUANT 2), saturating."""
    if QUANT == 1:
        return cast_sat_int8(y * inv[:, None])
    else:
        return cast_sat_fp8e4m3(y * inv[:, None])


@flyc.func
def quantize_pairs(even, odd, inv, QUANT: fx.constexpr):
    """:func:`quantize` of two adjacent columns' values, their codes packed as one int16 (``even`` low)."""
    if QUANT == 1:
        return sat_int8_pairs(even * inv[:, None], odd * inv[:, None])
    else:
        return sat_fp8e4m3_pairs(even * inv[:, None], odd * inv[:, None])


@flyc.func
def _chunk_y(
    x_rows, r_rows, row_ok, c, N, mean, rstd, w_ptr, b_ptr, s_ptr, weight_offset,
    HAS_RESIDUAL: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_BIAS: fx.constexpr, HAS_SMOOTH: fx.constexpr,
    EVICT: fx.constexpr, FACTORED: fx.constexpr,
):  # fmt: skip
    """y of columns ``c`` (those below ``N``) re-read from the inputs with cache hint ``EVICT``, and its mask;
    FACTORED: weighted(h) alone, which the quantized RMSNorm scales straight to its codes."""
    cmask = c < N
    mask = row_ok[:, None] & cmask[None, :]
    h = load_h(x_rows, r_rows, c[None, :], mask, HAS_RESIDUAL, EVICT)
    if FACTORED:  # the codes need no rstd: y * QMAX / max |y| = u * QMAX / max |u| (see weighted)
        y = weighted(h, w_ptr, s_ptr, c, cmask, weight_offset, HAS_WEIGHT, HAS_SMOOTH)
    else:
        y = normalize(h, mean, rstd, w_ptr, b_ptr, s_ptr, c, cmask, weight_offset, HAS_WEIGHT, HAS_BIAS, HAS_SMOOTH)
    return y, mask


@flyc.func
def lane_stats(
    x_rows, r_rows, h_rows, row_ok, cols, N, w_ptr, s_ptr, weight_offset,
    IS_RMS: fx.constexpr, HAS_RESIDUAL: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_SMOOTH: fx.constexpr,
    UMAX: fx.constexpr, BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr,
):  # fmt: skip
    """Pass 1 over the N columns: (mean, M2, umax) of each row (RMSNorm: (0, sum of squares, umax)); writes
    the residual sum h through ``h_rows`` when HAS_RESIDUAL. ``cols``: ``arange(0, BLOCK_N)``. With UMAX
    (RMSNorm only) umax = max |weighted(h)|, reduced with the sum of squares in one exchange (the
    quantized RMSNorm's amax is rstd * umax: no pass of its own); else 0.

    LayerNorm: lane p of the block sees the k_p elements h[p], h[p + BLOCK_N], ... and sums d = h - h[p]
    and d^2 about its own first element, so the loop starts without a reduction (a barrier the chunk
    loads cannot pass); the lanes' (k_p, mean_p, M2_p) are merged once after it (Chan), about the
    row's first element. A lane's M2_p = sum d^2 - (sum d)^2 / k_p loses about (mean_p - h[p])^2 / var_p
    units of rounding, and any one element lies within sqrt(k_p) standard deviations of its lane's
    mean, so the loss stays within k_p = N / BLOCK_N units (|mean| >> std costs nothing), at 4
    operations an element. (A per-lane Welford update measured 71% of copy at 32K columns on the
    H200, bf16.)
    """
    acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)  # sum of squares (RMS) or of d^2 (LayerNorm)
    acc1 = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)  # LayerNorm: sum of d; RMS with UMAX: max |u|
    shift = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
    if not IS_RMS:  # (names of their own: values assigned before a loop and in it are carried through it)
        mask0 = row_ok[:, None] & (cols < N)[None, :]
        shift = load_h(x_rows, r_rows, cols[None, :], mask0, HAS_RESIDUAL, "evict_last")
    for start in range(0, N, BLOCK_N):
        c = start + cols
        mask = row_ok[:, None] & (c < N)[None, :]
        h = load_h(x_rows, r_rows, c[None, :], mask, HAS_RESIDUAL, "evict_last")
        if HAS_RESIDUAL:
            fx.store(h_rows + c[None, :], h.to(h_rows.dtype.element_ty), mask=mask)
        if IS_RMS:
            acc += h * h  # masked elements are 0
            if UMAX:
                acc1 = fx.maximum(acc1, fx.abs(weighted(h, w_ptr, s_ptr, c, c < N, weight_offset, HAS_WEIGHT,
                                                         HAS_SMOOTH)))  # fmt: skip
        else:
            d = fx.where(mask, h - shift, 0.0)
            acc1 += d
            acc += d * d
    zero = fx.zeros([BLOCK_M], dtype=fx.float32)
    if IS_RMS:
        if UMAX:
            ss, umax = sum_absmax_f32(acc, acc1, 1)
            return zero, ss, umax
        return zero, fx.sum(acc, axis=1), zero
    k = ((N - cols + (BLOCK_N - 1)) // BLOCK_N).to(fx.float32)  # elements of lane p: 0 past N
    valid = row_ok[:, None] & (k > 0)[None, :]
    kk = fx.where(valid, k[None, :], 1.0)
    first = fx.max(load_h(x_rows, r_rows, fx.zeros([1, 1], dtype=fx.int32), row_ok[:, None], HAS_RESIDUAL, ""), axis=1)
    lane_mean = fx.where(valid, (shift - first[:, None]) + acc1 / kk, 0.0)  # mean_p - h[0]
    # The row mean, then M2 about it (two reductions back to back: a pairwise Chan merge in one tuple
    # reduction had one exchange fewer but measured 13-14 points of copy bandwidth slower at 16K-32K on the H200)
    mean = fx.sum(kk * lane_mean, axis=1) / N  # - h[0]
    dm = fx.where(valid, lane_mean - mean[:, None], 0.0)
    m2 = fx.sum(fx.where(valid, acc - acc1 * (acc1 / kk), 0.0) + kk * dm * dm, axis=1)
    return first + mean, fx.maximum(m2, 0.0), zero


@flyc.func
def lane_amax(
    x_rows, r_rows, row_ok, cols, N, mean, rstd, w_ptr, b_ptr, s_ptr, weight_offset,
    HAS_RESIDUAL: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_BIAS: fx.constexpr, HAS_SMOOTH: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr,
):  # fmt: skip
    """The quantized forwards' middle pass: max |y| of each row over its N columns, per lane then merged; NaN
    where y holds a NaN, as torch's amax (a plain max drops NaN, in the lanes as in the merge: the zeros of
    masked columns and of lanes past N would give a NaN row a finite scale)."""
    amax = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
    for start in range(0, N, BLOCK_N):
        y, mask = _chunk_y(x_rows, r_rows, row_ok, start + cols, N, mean, rstd, w_ptr, b_ptr, s_ptr,
                           weight_offset, HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, HAS_SMOOTH, "evict_last",
                           False)  # fmt: skip
        amax = maximum_nan(amax, fx.abs(fx.where(mask, y, 0.0)))
    return absmax_f32(amax, 1)


@flyc.func
def write_y(
    x_rows, r_rows, y_rows, row_ok, cols, N, mean, rstd, inv, w_ptr, b_ptr, s_ptr, weight_offset,
    HAS_RESIDUAL: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_BIAS: fx.constexpr, HAS_SMOOTH: fx.constexpr,
    QUANT: fx.constexpr, FACTORED: fx.constexpr, BLOCK_N: fx.constexpr,
):  # fmt: skip
    """The last pass over the N columns: y, or its codes scaled by ``inv`` when QUANT != 0 (FACTORED: the
    codes of u = weighted(h), ``inv`` = QMAX / max |u|, see :func:`weighted`). h is recomputed from x and
    residual rather than read back from residual_out, so the result is identical to the single-pass path's.
    The quantized pass is unrolled 8 chunks deep: rolled (as the compiler left it), a 32K row at 4096 x 16
    warps took 39 registers a thread, three programs an SM; unrolled, 32 registers and four (sm_90), the
    occupancy of the plain forward's pass: 75 -> 78% of the copy on the H200. Back to front,
    as softmax's last pass runs, measured slower there."""
    for start in fx.range(0, N, BLOCK_N, loop_unroll_factor=8 if QUANT != 0 else 1):
        y, mask = _chunk_y(x_rows, r_rows, row_ok, start + cols, N, mean, rstd, w_ptr, b_ptr, s_ptr,
                           weight_offset, HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, HAS_SMOOTH, "evict_first",
                           FACTORED)  # fmt: skip
        if QUANT == 0:
            fx.store(y_rows + (start + cols)[None, :], y.to(y_rows.dtype.element_ty), mask=mask)
        else:
            fx.store(y_rows + (start + cols)[None, :], quantize(y, inv, QUANT), mask=mask)


@flyc.func
def softmax_lane_stats(x_rows, row_ok, cols, N, BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr):
    """Softmax pass 1 over the N columns: each row's max and sum of exp(x - finite_or_zero(max)).

    Each lane carries its own online (max, sum), merged once after the loop. One exp an element: with
    d = x - max, e = exp(-|d|) is exp(x - max) when x does not raise the max (s += e) and exp(old max - x)
    when it does (s = s * e + 1, the new max being x). Loads are marked evict_last for the re-read.
    """
    m_l = fx.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=fx.float32)
    s_l = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        mask = row_ok[:, None] & (c[None, :] < N)
        xc = fx.load(x_rows + c[None, :], mask=mask, other=NEG_INF, eviction_policy="evict_last").to(fx.float32)
        e = fx.exp2(-fx.abs(xc - m_l) * LOG2E)  # NaN where both are -inf: not used there
        s_l = fx.where(xc > m_l, s_l * e + 1.0, fx.where(xc > NEG_INF, s_l + e, s_l))
        m_l = fx.maximum(m_l, xc)
    m = fx.max(m_l, axis=1)
    s = fx.sum(s_l * fx.exp2((m_l - finite_or_zero(m)[:, None]) * LOG2E), axis=1)  # empty lanes: 0 * 0
    return m, s


@flyc.func
def softmax_write(x_rows, y_rows, row_ok, cols, N, base, inv, BLOCK_N: fx.constexpr):
    """Softmax's last pass over the N columns: y = exp(x - base) * inv, back to front (the chunks read
    last in pass 1 are the likeliest still to be in L2)."""
    num_chunks = fx.cdiv(N, BLOCK_N)
    for i in range(0, num_chunks):
        c = (num_chunks - 1 - i) * BLOCK_N + cols
        mask = row_ok[:, None] & (c[None, :] < N)
        xc = fx.load(x_rows + c[None, :], mask=mask, other=NEG_INF, eviction_policy="evict_first")
        e = fx.exp2((xc.to(fx.float32) - base[:, None]) * LOG2E)
        fx.store(y_rows + c[None, :], (e * inv[:, None]).to(y_rows.dtype.element_ty), mask=mask)
