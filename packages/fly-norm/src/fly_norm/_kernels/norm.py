"""One kernel family for RMSNorm and LayerNorm: forward (plain, fused residual, quantized) and backward.

Both norms share every line of device code: ``IS_RMS`` only decides whether the
row mean is subtracted (RMSNorm: mean = 0, var = mean(h^2)), so the two public
modules (:mod:`fly_norm.rmsnorm`, :mod:`fly_norm.layernorm`) are thin.

Forward, per row ``h = x (+ residual)``::

    y = (h - mean) * rstd * (weight + weight_offset) + bias       rstd = 1 / sqrt(var + eps)

- single pass (the row fits in one ``BLOCK_N`` step): the row stays in
  registers between the reduction and the write; ``BLOCK_M`` rows per program.
  The quantized RMSNorm of bf16 rows of 32K columns and up keeps them packed,
  two columns an int32 (``PACKED``, :func:`_packed_quant_rows`): half the
  registers, so two programs of a 32K row fit an SM;
- chunked (wider rows, ``BLOCK_M == 1``): pass 1 accumulates the statistics
  per lane over the row's chunks and merges the lanes once after the loop,
  pass 2 re-reads the row (from L2) and writes y (:mod:`.passes`).
  The quantized LayerNorm needs the row's absolute max of y before writing, so
  it adds a third pass; the quantized RMSNorm gets it from pass 1
  (``max |y| = rstd * max |h * w|``, :func:`.passes.weighted`);
- split (rows wider than 32K columns on a GPU, ``SPLIT_MIN_N``): each row over
  several programs of one resident wave, read once (:mod:`.split`); bf16 rows
  from 64K columns with no residual, smooth scale or quantized output take the
  staged kernel (``FWD_STAGED``).

Backward, with xhat = (h - mean) * rstd and g = dy * (weight + weight_offset)::

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm drops mean(g))
    dweight = sum_rows dy * xhat,  dbias = sum_rows dy

dweight/dbias are reduced deterministically without float atomics: each
program accumulates its rows into fp32 registers and writes one row of a
``[programs, N]`` partial buffer; a second small kernel sums the partials
column-wise in a fixed order. Rows wider than 8K columns on a GPU go through the
split backward of :mod:`.split` (same partials, one row per row group), except
RMSNorm's bf16 rows of up to 16K columns (``PIPELINED``, :func:`_pipelined_bwd_rows`):
one row a program at a time, its h and dy read as int32 words (two columns each)
through the software pipeliner, so the next rows' bytes wait in shared memory
rather than in registers.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import absmax_f32, inverse_scale, pdl_wait, quant_scale, row_offset

from .affine import load_bwd_rows, load_weight
from .pairs import (
    as_words,
    bf16_pairs,
    bf16_pairs_again,
    bf16_pairs_third,
    bf16_words,
    offsets_after,
    sum2_f32,
    sum_absmax_f32,
)
from .passes import (
    clear_share,
    lane_amax,
    lane_stats,
    load_h,
    normalize,
    quantize,
    quantize_pairs,
    row_mean,
    row_ptrs,
    weighted,
    write_y,
)

__all__ = ["norm_fwd_kernel", "norm_bwd_kernel", "sum_partials_kernel"]

# ---------------------------------------------------------------- device code


@flyc.func
def _packed_quant_rows(
    x_rows, y_rows, w_ptr, qs_ptr, rows, row_ok, N, eps, QUANT: fx.constexpr, QMAX: fx.constexpr,
    BLOCK_N: fx.constexpr,
):  # fmt: skip
    """The quantized RMSNorm's single pass with the bf16 rows held packed: column pairs (2c, 2c + 1) read
    as one int32 each (N even, rows 4-byte aligned), kept as read through the row's reduction, widened
    again after it. Its rstd. The codes are written as int16 pairs, four to a thread's store, in the
    words' layout (wider stores would need a layout change through shared memory).

    The fp32 row held through the reduction instead takes twice the registers: at 32K columns over 8 warps
    172 registers a thread (one program an SM) against 128 packed (two; sm_90). The weight is read again
    after the reduction (an L1/L2 hit), under a mask that depends on it, so that the compiler does not
    hoist that read above it and hold the weight through it as well. The mask's form steers ptxas's
    schedule of the first reads: as below it issues the row's reads first (from memory) and the weight's
    (from L2) as they are used; with a bound taken from the max over the block's rows it did the reverse,
    and a 32K row ran 114.5 us against 105 (H200, bf16, 2^27 elements)."""
    c2 = fx.arange(0, BLOCK_N // 2)
    ok2 = (c2 < N // 2)[None, :]
    mask2 = row_ok[:, None] & ok2
    words = fx.load(as_words(x_rows) + c2[None, :], mask=mask2, other=0)
    w_words = as_words(w_ptr) + c2[None, :]
    we, wo = bf16_pairs(fx.load(w_words, mask=ok2, other=0))
    he, ho = bf16_pairs(words)
    # u = h * w (passes.weighted): the sum of squares and max |u| in one exchange
    ss, umax = sum_absmax_f32(he * he + ho * ho, fx.maximum(fx.abs(he * we), fx.abs(ho * wo)), 1)
    rstd = fx.rsqrt(ss / N + eps)
    fx.store(qs_ptr + rows, quant_scale(umax * rstd, QMAX), mask=row_ok)
    inv = inverse_scale(umax, QMAX)
    after = ok2 & (umax >= 0)[:, None]  # ok2, known only after the reduction
    we, wo = bf16_pairs(fx.load(w_words, mask=after, other=0, eviction_policy="evict_last"))
    he, ho = bf16_pairs_again(words)
    codes = quantize_pairs(he * we, ho * wo, inv, QUANT)
    y_pairs = y_rows.to(fx.pointer_type(fx.int16), bitcast=True) + fx.max_contiguous(c2, 4)[None, :]
    fx.store(y_pairs, codes, mask=mask2)
    return rstd


@flyc.func
def _row_part(x_words, row_ok, c, P: fx.constexpr, N):
    """Part ``P`` of a row's int32 words (words P * len(c) + c: columns 2w and 2w + 1), and its mask."""
    w = c + P * c.shape[0]
    ok = row_ok[:, None] & (w < N // 2)[None, :]
    return fx.load(x_words + w[None, :], mask=ok, other=0), ok


@flyc.func
def _part_m2(words, ok, mean):
    """Each pair's squared deviations from ``mean`` summed (0 where masked), the words widened anew after it."""
    he, ho = bf16_pairs_again(words)
    de = fx.where(ok, he - mean[:, None], 0.0)
    do = fx.where(ok, ho - mean[:, None], 0.0)
    return de * de + do * do


@flyc.func
def _write_part(
    y_words, w_ptr, b_ptr, words, ok, c, P: fx.constexpr, mean, rstd, after,
    HAS_WEIGHT: fx.constexpr, HAS_BIAS: fx.constexpr,
):  # fmt: skip
    """y of part ``P`` written as bf16 pairs; its weight and bias words read only once ``after`` (the previous
    part's written words, or the row's rstd) is known. Returns the written words."""
    w = (c + P * c.shape[0])[None, :] + fx.zeros_like(words)
    late = offsets_after(w, after, 4)  # 4 words: 16-byte reads
    ye, yo = bf16_pairs_third(words, (rstd.to(fx.int32, bitcast=True) >> 31)[:, None])  # rstd > 0: zero
    ye = (ye - mean[:, None]) * rstd[:, None]
    yo = (yo - mean[:, None]) * rstd[:, None]
    if HAS_WEIGHT:
        we, wo = bf16_pairs(fx.load(as_words(w_ptr) + late, mask=ok, other=0, eviction_policy="evict_last"))
        ye = ye * we
        yo = yo * wo
    if HAS_BIAS:
        be, bo = bf16_pairs(fx.load(as_words(b_ptr) + late, mask=ok, other=0, eviction_policy="evict_last"))
        ye = ye + be
        yo = yo + bo
    out = bf16_words(ye, yo)
    fx.store(y_words + w, out, mask=ok)
    return out


@flyc.func
def _packed_norm_rows(
    x_rows, y_rows, w_ptr, b_ptr, row_ok, N, eps, HAS_WEIGHT: fx.constexpr, HAS_BIAS: fx.constexpr,
    BLOCK_N: fx.constexpr,
):  # fmt: skip
    """The plain LayerNorm's single pass with the bf16 rows held packed, as :func:`_packed_quant_rows` holds
    them, in four parts: the mean, then M2 about it (as the unpacked single pass), each over the row widened
    anew, then y part after part, written as bf16 pairs in int32 words. Each part's weight and bias are read
    once the previous part's y is known (:func:`.device.offsets_after`): read all at once, the compiler's
    choice otherwise, they took 128 registers beside the row's 64 words at 32K columns over 8 warps (sm_90:
    234 registers in all). (mean, rstd)."""
    c = fx.arange(0, BLOCK_N // 8)
    x_words = as_words(x_rows)
    w0, k0 = _row_part(x_words, row_ok, c, 0, N)
    w1, k1 = _row_part(x_words, row_ok, c, 1, N)
    w2, k2 = _row_part(x_words, row_ok, c, 2, N)
    w3, k3 = _row_part(x_words, row_ok, c, 3, N)
    e0, o0 = bf16_pairs(w0)
    e1, o1 = bf16_pairs(w1)
    e2, o2 = bf16_pairs(w2)
    e3, o3 = bf16_pairs(w3)
    mean = row_mean(fx.sum((e0 + o0) + (e1 + o1) + (e2 + o2) + (e3 + o3), axis=1), N)  # masked words are 0
    m2 = _part_m2(w0, k0, mean) + _part_m2(w1, k1, mean) + _part_m2(w2, k2, mean) + _part_m2(w3, k3, mean)
    rstd = fx.rsqrt(fx.sum(m2, axis=1) / N + eps)
    y_words = as_words(y_rows)
    first = fx.zeros_like(w0) + rstd[:, None].to(fx.int32, bitcast=True)  # part 0's reads wait for rstd
    after = _write_part(y_words, w_ptr, b_ptr, w0, k0, c, 0, mean, rstd, first, HAS_WEIGHT, HAS_BIAS)
    after = _write_part(y_words, w_ptr, b_ptr, w1, k1, c, 1, mean, rstd, after, HAS_WEIGHT, HAS_BIAS)
    after = _write_part(y_words, w_ptr, b_ptr, w2, k2, c, 2, mean, rstd, after, HAS_WEIGHT, HAS_BIAS)
    _write_part(y_words, w_ptr, b_ptr, w3, k3, c, 3, mean, rstd, after, HAS_WEIGHT, HAS_BIAS)
    return mean, rstd


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def norm_fwd_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr, s_ptr,          # inputs: x, residual, weight, bias, smooth scale
    y_ptr, h_ptr, mean_ptr, rstd_ptr, qs_ptr,   # outputs: y (or q), residual_out, stats, row scales
    M, N, stride_x, stride_r, stride_y, stride_h, eps, weight_offset,
    IS_RMS: fx.constexpr, HAS_RESIDUAL: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_BIAS: fx.constexpr,
    HAS_SMOOTH: fx.constexpr, STORE_STATS: fx.constexpr, QUANT: fx.constexpr, QMAX: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, SINGLE_PASS: fx.constexpr, N_FIXED: fx.constexpr,
    PACKED: fx.constexpr,
):
    # fmt: on
    if N_FIXED != 0:
        N = N_FIXED  # chunked rows: a compile-time width (passes.row_meta)
    pid = fx.program_id(0)
    rows = pid * BLOCK_M + fx.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = fx.arange(0, BLOCK_N)
    x_rows, r_rows, y_rows, h_rows = row_ptrs(x_ptr, r_ptr, y_ptr, h_ptr, rows, stride_x, stride_r, stride_y,
                                              stride_h, HAS_RESIDUAL)  # fmt: skip

    # The quantized RMSNorm (FACTORED): y = weighted(h) * rstd, so max |y| = rstd * max |weighted(h)|, which
    # comes out of the same reduction as the sum of squares, and the codes are weighted(h) scaled by
    # QMAX / max |weighted(h)| (passes.weighted).
    FACTORED: fx.constexpr = IS_RMS and QUANT != 0
    if PACKED and FACTORED:  # single pass, bf16 x and weight, no residual, smooth scale or offset (_row_plan)
        mean = fx.zeros([BLOCK_M], dtype=fx.float32)
        rstd = _packed_quant_rows(x_rows, y_rows, w_ptr, qs_ptr, rows, row_ok, N, eps, QUANT, QMAX, BLOCK_N)
    elif PACKED:  # the plain LayerNorm, single pass, bf16 x, weight and bias, no residual or offset
        mean, rstd = _packed_norm_rows(x_rows, y_rows, w_ptr, b_ptr, row_ok, N, eps, HAS_WEIGHT, HAS_BIAS, BLOCK_N)
    elif SINGLE_PASS:
        cmask = cols < N
        mask = row_ok[:, None] & cmask[None, :]
        h = load_h(x_rows, r_rows, cols[None, :], mask, HAS_RESIDUAL, "")
        if HAS_RESIDUAL:
            fx.store(h_rows + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
        if FACTORED:
            mean = fx.zeros([BLOCK_M], dtype=fx.float32)
            u = weighted(h, w_ptr, s_ptr, cols, cmask, weight_offset, HAS_WEIGHT, HAS_SMOOTH)
            ss, umax = sum_absmax_f32(h * h, u, 1)  # one exchange between warps for both
            rstd = fx.rsqrt(ss / N + eps)
            fx.store(qs_ptr + rows, quant_scale(umax * rstd, QMAX), mask=row_ok)
            fx.store(y_rows + cols[None, :], quantize(u, inverse_scale(umax, QMAX), QUANT), mask=mask)
        else:
            if IS_RMS:
                mean = fx.zeros([BLOCK_M], dtype=fx.float32)
                var = fx.sum(h * h, axis=1) / N
            else:
                mean = row_mean(fx.sum(h, axis=1), N)
                d = fx.where(mask, h - mean[:, None], 0.0)
                var = fx.sum(d * d, axis=1) / N
            rstd = fx.rsqrt(var + eps)
            y = normalize(h, mean, rstd, w_ptr, b_ptr, s_ptr, cols, cmask, weight_offset, HAS_WEIGHT, HAS_BIAS,
                          HAS_SMOOTH)  # fmt: skip
            if QUANT == 0:
                fx.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
            else:
                # NaN where y holds one, as torch's amax: a plain max drops NaN, and a row narrower than its
                # block would get the padding's 0 (a NaN row quantized to silent zeros)
                amax = absmax_f32(fx.where(mask, y, 0.0), 1)
                fx.store(qs_ptr + rows, quant_scale(amax, QMAX), mask=row_ok)
                fx.store(y_rows + cols[None, :], quantize(y, inverse_scale(amax, QMAX), QUANT), mask=mask)
    else:
        # Pass 1 (passes.lane_stats): the statistics in per-lane accumulators, merged once; the residual
        # sum written (FACTORED: and max |weighted(h)|). Pass 2 (after the quantized LayerNorm's amax pass):
        # y from a re-read of the inputs (from L2).
        mean, m2, umax = lane_stats(x_rows, r_rows, h_rows, row_ok, cols, N, w_ptr, s_ptr, weight_offset, IS_RMS,
                                    HAS_RESIDUAL, HAS_WEIGHT, HAS_SMOOTH, FACTORED, BLOCK_M, BLOCK_N)  # fmt: skip
        rstd = fx.rsqrt(m2 / N + eps)
        inv = rstd  # unused unless quantizing
        if QUANT != 0:
            if FACTORED:  # the codes scale u = y / rstd (passes.weighted): by QMAX / max |u|
                fx.store(qs_ptr + rows, quant_scale(umax * rstd, QMAX), mask=row_ok)
                inv = inverse_scale(umax, QMAX)
            else:
                amax = lane_amax(x_rows, r_rows, row_ok, cols, N, mean, rstd, w_ptr, b_ptr, s_ptr, weight_offset,
                                 HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, HAS_SMOOTH, BLOCK_M, BLOCK_N)  # fmt: skip
                fx.store(qs_ptr + rows, quant_scale(amax, QMAX), mask=row_ok)
                inv = inverse_scale(amax, QMAX)
        write_y(x_rows, r_rows, y_rows, row_ok, cols, N, mean, rstd, inv, w_ptr, b_ptr, s_ptr, weight_offset,
                HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, HAS_SMOOTH, QUANT, FACTORED, BLOCK_N)  # fmt: skip

    if STORE_STATS:
        if not IS_RMS:
            fx.store(mean_ptr + rows, mean, mask=row_ok)
        fx.store(rstd_ptr + rows, rstd, mask=row_ok)


@flyc.func
def _dx(h, dy, w, mean, rstd, c1, c2, IS_RMS: fx.constexpr):
    """Input gradient of a chunk from the row statistics c1 = mean(g * xhat), c2 = mean(g)."""
    xhat = (h - mean[:, None]) * rstd[:, None]
    g = dy * w
    if IS_RMS:
        return (g - xhat * c1[:, None]) * rstd[:, None]
    else:
        return (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]




@flyc.func
def _pipelined_bwd_rows(
    h_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dwp_ptr, M, N, stride_h, stride_dy, stride_dx, weight_offset,
    HAS_WEIGHT: fx.constexpr, COMPUTE_DW: fx.constexpr, BLOCK_N: fx.constexpr, STAGES: fx.constexpr,
):  # fmt: skip
    """RMSNorm's backward over bf16 rows, one row at a time (row = pid, pid + programs, ...), no residual
    gradient. The row loop is software-pipelined STAGES deep (``num_stages``: the loads of the next rows go
    to shared memory by cp.async while this row is worked on), and h and dy are read as int32 words, two
    columns each, widened once for the row sum and again after it (:func:`.device.bf16_pairs_again`): the
    registers hold one packed row, the weight and the per-column dweight sums. The held-in-registers single
    pass spills at 16K columns (one row in fp32 and the next one ahead); this one fits one 16-warp program an
    SM (sm_90; 90% of copy at 16K on the H200, see PIPELINED_BWD). rstd is read a row ahead by hand (a
    scalar; not left to the pipeliner)."""
    pid = fx.program_id(0)
    programs = fx.num_programs(0)
    c2 = fx.arange(0, BLOCK_N // 2)
    ok2 = c2 < N // 2
    we = load_weight(w_ptr, 2 * c2, ok2, weight_offset, HAS_WEIGHT, "")
    wo = load_weight(w_ptr, 2 * c2 + 1, ok2, weight_offset, HAS_WEIGHT, "")
    dwe = fx.zeros([BLOCK_N // 2], dtype=fx.float32)
    dwo = fx.zeros([BLOCK_N // 2], dtype=fx.float32)
    rstd_nx = fx.load(rstd_ptr + pid, mask=pid < M, other=0.0)
    for row in fx.range(pid, M, programs, num_stages=STAGES):
        hw = fx.load(as_words(h_ptr) + row_offset(row, stride_h // 2) + c2, mask=ok2, other=0)
        dyw = fx.load(as_words(dy_ptr) + row_offset(row, stride_dy // 2) + c2, mask=ok2, other=0)
        rstd = rstd_nx
        rstd_nx = fx.load(rstd_ptr + row + programs, mask=row + programs < M, other=0.0)
        he, ho = bf16_pairs(hw)
        de, do = bf16_pairs(dyw)
        c1 = fx.sum(de * we * he + do * wo * ho, axis=0) * rstd / N  # mean(g * xhat), xhat = h * rstd
        he, ho = bf16_pairs_again(hw)  # the row again, widened anew after the sum
        de, do = bf16_pairs_again(dyw)
        xe = he * rstd
        xo = ho * rstd
        dx = bf16_words((de * we - xe * c1) * rstd, (do * wo - xo * c1) * rstd)
        fx.store(as_words(dx_ptr) + row_offset(row, stride_dx // 2) + c2, dx, mask=ok2)
        if COMPUTE_DW:
            dwe += de * xe
            dwo += do * xo
    if COMPUTE_DW:
        part = row_offset(pid, N) + 2 * c2
        fx.store(dwp_ptr + part, dwe, mask=ok2)
        fx.store(dwp_ptr + part + 1, dwo, mask=ok2)


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def norm_bwd_kernel(
    h_ptr, w_ptr, dy_ptr, dres_ptr, mean_ptr, rstd_ptr,   # inputs (dres: gradient of residual_out)
    dx_ptr, dwp_ptr, dbp_ptr, c_ptr,                      # outputs, [programs, N] partials, [2, M] scratch
    M, N, stride_h, stride_dy, stride_dres, stride_dx, weight_offset,
    IS_RMS: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_DRES: fx.constexpr, COMPUTE_DW: fx.constexpr,
    COMPUTE_DB: fx.constexpr, BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, SINGLE_PASS: fx.constexpr,
    PIPELINED: fx.constexpr = 0, LEAN: fx.constexpr = False,
):
    # fmt: on
    pid = fx.program_id(0)
    programs = fx.num_programs(0)
    cols = fx.arange(0, BLOCK_N)
    part = row_offset(pid, N)  # this program's row of the [programs, N] partial buffers

    if PIPELINED:  # RMSNorm, bf16 rows, no residual gradient, the stages of the row loop (_bwd_plan)
        _pipelined_bwd_rows(h_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dwp_ptr, M, N, stride_h, stride_dy, stride_dx,
                            weight_offset, HAS_WEIGHT, COMPUTE_DW, BLOCK_N, PIPELINED)  # fmt: skip
    elif SINGLE_PASS:
        # Persistent loop over row blocks (blk = pid, pid + programs, ...). The
        # next block's h and dy are loaded, in their storage dtype, before this
        # block is reduced and written: the loads stay in flight through the
        # reductions, which would otherwise leave the memory system idle.
        # dweight/dbias accumulate per element ([BLOCK_M, BLOCK_N]) and are reduced
        # over the rows once, after the loop: no cross-warp reduction per block.
        cmask = cols < N
        dw = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
        db = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
        blk_rows = fx.arange(0, BLOCK_M)
        h_nx, dy_nx, rstd_nx, mean_nx = load_bwd_rows(
            h_ptr, dy_ptr, mean_ptr, rstd_ptr, pid * BLOCK_M + blk_rows, M, cols, cmask, stride_h, stride_dy, IS_RMS, ""
        )
        # disable_licm: nothing loop-invariant is hoisted out and held in registers through the loop
        # (sm_90: layer_norm 88-93 -> 79-86 registers, one more resident program at 1K-2K)
        for blk in fx.range(pid, fx.cdiv(M, BLOCK_M), programs, disable_licm=True):
            rows = blk * BLOCK_M + blk_rows
            row_ok = rows < M
            mask = row_ok[:, None] & cmask[None, :]
            h, dy, rstd, mean = h_nx.to(fx.float32), dy_nx.to(fx.float32), rstd_nx, mean_nx
            h_nx, dy_nx, rstd_nx, mean_nx = load_bwd_rows(
                h_ptr, dy_ptr, mean_ptr, rstd_ptr, (blk + programs) * BLOCK_M + blk_rows, M, cols, cmask,
                stride_h, stride_dy, IS_RMS, "",
            )
            # The weight is re-read per row block (an L1/L2 hit) instead of being held
            # across the loop: registers go to h, dy, the prefetch and the dweight accumulator.
            w = load_weight(w_ptr, cols, cmask, weight_offset, HAS_WEIGHT, "")[None, :]
            if LEAN:  # no select: dy reads 0 past the row and past the last row, so every term there is 0
                xhat = (h - mean[:, None]) * rstd[:, None]
            else:
                xhat = fx.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
            g = dy * w
            if IS_RMS:
                c1 = fx.sum(g * xhat, axis=1) / N
                c2 = c1  # unused
            else:
                c1, c2 = sum2_f32(g * xhat, g, 1)  # one exchange between warps for both row sums
                c1 = c1 / N
                c2 = c2 / N
            dx = _dx(h, dy, w, mean, rstd, c1, c2, IS_RMS)
            if HAS_DRES:
                dres = fx.load(dres_ptr + row_offset(rows, stride_dres)[:, None] + cols[None, :], mask=mask, other=0.0)
                dx += dres.to(fx.float32)
            fx.store(
                dx_ptr + row_offset(rows, stride_dx)[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask
            )
            if COMPUTE_DW:
                dw += dy * xhat
            if COMPUTE_DB:
                db += dy
        if COMPUTE_DW:
            fx.store(dwp_ptr + part + cols, fx.sum(dw, axis=0), mask=cmask)
        if COMPUTE_DB:
            fx.store(dbp_ptr + part + cols, fx.sum(db, axis=0), mask=cmask)
    else:
        # Chunked rows (BLOCK_M == 1): this program owns a contiguous range of
        # rows. Pass 1 reduces each row's c1/c2 into a small fp32 scratch
        # ([2, M]); pass 2 walks the columns chunk by chunk, over all of its
        # rows, so the dweight partial of a chunk lives in registers and is
        # written once (no read-modify-write of the partial buffer).
        per_program = fx.cdiv(M, programs)
        row0 = pid * per_program
        row1 = fx.minimum(row0 + per_program, M)
        zero = fx.zeros([1], dtype=fx.float32)
        for row in range(row0, row1):
            r1 = row + fx.arange(0, 1)  # a [1] block: keeps the int64 offset math on tensors
            h_row = h_ptr + row_offset(r1, stride_h)[:, None]
            dy_row = dy_ptr + row_offset(r1, stride_dy)[:, None]
            rstd = fx.load(rstd_ptr + r1)
            if IS_RMS:
                mean = zero
            else:
                mean = fx.load(mean_ptr + r1)
            s1 = fx.zeros([1, BLOCK_N], dtype=fx.float32)
            s2 = fx.zeros([1, BLOCK_N], dtype=fx.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                cmask = (c < N)[None, :]
                h = fx.load(h_row + c[None, :], mask=cmask, other=0.0).to(fx.float32)
                dy = fx.load(dy_row + c[None, :], mask=cmask, other=0.0).to(fx.float32)
                g = dy * load_weight(w_ptr, c, c < N, weight_offset, HAS_WEIGHT, "")[None, :]
                xhat = fx.where(cmask, (h - mean[:, None]) * rstd[:, None], 0.0)
                s1 += g * xhat
                s2 += g
            fx.store(c_ptr + r1, fx.sum(s1, axis=1) / N)
            fx.store(c_ptr + M + r1, fx.sum(s2, axis=1) / N)
        # Pass 2 reads back the scratch written above by other threads of this program.
        fx.debug_barrier()
        for start in range(0, N, BLOCK_N):
            c = start + cols
            cmask = (c < N)[None, :]
            w = load_weight(w_ptr, c, c < N, weight_offset, HAS_WEIGHT, "")[None, :]
            dw = fx.zeros([BLOCK_N], dtype=fx.float32)
            db = fx.zeros([BLOCK_N], dtype=fx.float32)
            for row in range(row0, row1):
                r1 = row + fx.arange(0, 1)
                rstd = fx.load(rstd_ptr + r1)
                if IS_RMS:
                    mean = zero
                else:
                    mean = fx.load(mean_ptr + r1)
                c1 = fx.load(c_ptr + r1)
                c2 = fx.load(c_ptr + M + r1)
                h = fx.load(h_ptr + row_offset(r1, stride_h)[:, None] + c[None, :], mask=cmask, other=0.0)
                dy = fx.load(dy_ptr + row_offset(r1, stride_dy)[:, None] + c[None, :], mask=cmask, other=0.0)
                h = h.to(fx.float32)
                dy = dy.to(fx.float32)
                dx = _dx(h, dy, w, mean, rstd, c1, c2, IS_RMS)
                if HAS_DRES:
                    dres_row = dres_ptr + row_offset(r1, stride_dres)[:, None]
                    dx += fx.load(dres_row + c[None, :], mask=cmask, other=0.0).to(fx.float32)
                dx_row = dx_ptr + row_offset(r1, stride_dx)[:, None]
                fx.store(dx_row + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=cmask)
                if COMPUTE_DW:
                    xhat = fx.where(cmask, (h - mean[:, None]) * rstd[:, None], 0.0)
                    dw += fx.sum(dy * xhat, axis=0)
                if COMPUTE_DB:
                    db += fx.sum(dy, axis=0)
            if COMPUTE_DW:
                fx.store(dwp_ptr + part + c, dw, mask=c < N)
            if COMPUTE_DB:
                fx.store(dbp_ptr + part + c, db, mask=c < N)


@flyc.kernel(do_not_specialize=["clear_n"])
def sum_partials_kernel(
    p_ptr, out_ptr, q_ptr, out2_ptr, clear_ptr, P, N, clear_n, BLOCK_P: fx.constexpr, BLOCK_N: fx.constexpr
):  # fmt: skip
    """out[c] = sum_p partials[p, c] in fp32 for a narrow band of columns, in a fixed order (deterministic);
    the programs of grid axis 1 index 1 sum q into out2 (dweight's and dbias's partials in one launch).
    Every program also zeroes its share of the ``clear_n`` int64 words at ``clear_ptr`` (the split
    backward's pooled slots, split.take_slots).

    Each step sums a [BLOCK_P, BLOCK_N] tile over its rows: the bands are
    narrow so that there are enough programs to keep every SM loading.
    """
    pdl_wait()  # launched with PDL (launch_sum_partials): the partials are the kernel before's
    clear_share(clear_ptr, clear_n)
    if fx.program_id(1) == 1:
        p_ptr = q_ptr
        out_ptr = out2_ptr
    c = fx.program_id(0) * BLOCK_N + fx.arange(0, BLOCK_N)
    cmask = c < N
    r = fx.arange(0, BLOCK_P)
    acc = fx.zeros([BLOCK_N], dtype=fx.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + r
        mask = (rows < P)[:, None] & cmask[None, :]
        acc += fx.sum(fx.load(p_ptr + row_offset(rows, N)[:, None] + c[None, :], mask=mask, other=0.0), axis=0)
    fx.store(out_ptr + c, acc.to(out_ptr.dtype.element_ty), mask=cmask)
