"""Rows too wide for one program, split over several programs of one resident wave (GPU only).

Used by the RMSNorm / LayerNorm forward and by softmax forward and backward
for rows of tens of thousands of columns and more, where the one-program
chunked paths (:mod:`fly_norm._kernels.norm`, :mod:`fly_norm.softmax`) read
each row twice and the second read misses L2 once 132 rows of 128 KB+ are in
flight.

A row of N columns is cut into ``parts`` slices of SLICE columns (the last
may be short). The grid is one resident wave of ``groups * parts`` programs;
program ``pid`` always works on slice ``pid % parts`` of the rows ``group,
group + groups, ...`` (``group = pid // parts``). For each of its rows a
program

1. reduces its slice, already in registers, to the slice's partial result
   (norms: the sum of squares, or the slice's mean and M2; softmax forward:
   the slice's max and sum of exponentials; softmax backward: the slice's
   sum of dy * y) and publishes it in the row's slot for this slice (a
   tagged word: :func:`.exchange.publish`, no fence);
2. loads the slice of its next row (a prefetch: those loads are in flight
   while it waits);
3. waits until every slot of the row is published, merges the partial
   results (LayerNorm: Chan's parallel formula; softmax: rescaling each
   slice's sum to the row's max) and writes its slice of the output from
   registers.

Every element is read once and written once: the copy's floor.

The tiled norm backward (``BWD_TILED``) instead holds nothing across the
wait: a program walks tiles of a few rows of its slice, exchanges the tile's
sums, then re-reads the tile (from L2) to write dx; with a lead (the config's
``lead``) it publishes its next tile before waiting on the current one (the
lead of 1 that BWD_TILED ships was measured on the H200; see BWD_TILED). What limits the speed is
the exchange's latency (a publish reaching L2 and a poll seeing it, ~1 us a
row), hidden by the loads in flight during it: the other programs resident on
the same SM (small slices, few registers, several programs an SM) and the
next row's slice, prefetched (prefetching two rows ahead measured worse on the
H200: its registers let fewer programs fit an SM).

The staged kernels (bf16 rows: the backward, ``BWD_STAGED``, and the norms' plain forward from 64K
columns, ``FWD_STAGED``) hold only int32 words of a row (two columns each) and let the software pipeliner
stage the next rows in shared memory
(``fx.range(..., num_stages=)``). Pass 1 runs a row ahead: the next row's partial result is
published before this row's are awaited. The wait starts
from the slots as read before pass 1 (:func:`.exchange.peek` /
:func:`~.exchange.collect_from`), inside one asm statement, since the pipeliner refuses
loops with nested loops (Triton 3.6: a loop holding a nested loop is left unpipelined).

The waits need every program of a row to be running at once: the grid never
exceeds one wave (:func:`flydsl.compiler.programs_per_sm`), and rows of more
than SPLIT_MAX_PARTS slices are left to the chunked paths. A wait that does
not end within SPIN_LIMIT polls poisons its row with NaN instead of hanging
the GPU. The interpreter runs programs one at a time, so the public ops never
take these paths there (:func:`fly_norm.routing.route`; the configurations and launchers named here are
in :mod:`fly_norm._split_host`); tests run them through it with
one slice a row (no waiting) and with a tiny spin limit (the give-up path, and
the last program of each row merging every slice: ``tests/test_split.py``).
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import (
    absmax_f32,
    cast_sat_fp8e4m3,
    cast_sat_int8,
    inverse_scale,
    pdl_launch_dependents,
    pdl_wait,
    quant_scale,
    row_offset,
)

from .affine import load_bwd_rows, load_weight
from .exchange import collect, collect_from, collect_pairs_from, collect_sum, peek, publish, publish_pair
from .pairs import as_words, bf16_pairs, bf16_pairs_again, bf16_pairs_third, bf16_words, sum2_f32
from .passes import LOG2E, NEG_INF, clear_share, row_mean, stored_sum

__all__ = [
    "norm_fwd_split_kernel", "softmax_fwd_split_kernel", "softmax_bwd_split_kernel", "norm_bwd_split_kernel",
    "norm_bwd_tiled_kernel", "norm_bwd_staged_kernel", "norm_fwd_staged_kernel", "staged_dx", "zero_slots_kernel",
]  # fmt: skip


@flyc.kernel(do_not_specialize=["n"])
def zero_slots_kernel(slot_ptr, n, BLOCK: fx.constexpr):
    """Zero ``n`` int64 words at ``slot_ptr``: a split launch's fresh slots (all unpublished), launched just
    before it on the same stream. (A ``torch.zeros`` would do the same on the device, but it is a torch op,
    which keeps the call's recording from being replayed: :mod:`flydsl.direct`.)"""
    w = fx.program_id(0) * BLOCK + fx.arange(0, BLOCK)
    fx.store(slot_ptr + w, fx.zeros([BLOCK], dtype=fx.int64), mask=w < n)


@flyc.func
def _pair_slots(base, part, p_idx, p_ok):
    """Slots of two values a slice, interleaved: this slice's two, every slice's [PARTS_POW2, 2] and mask."""
    k = fx.arange(0, 2)
    return base + 2 * part, base + 2 * p_idx[:, None] + k[None, :], p_ok[:, None] & (k[None, :] < 2)


@flyc.func
def _unpair(v):
    """Columns 0 and 1 of a [*, 2] block."""
    k = fx.arange(0, 2)[None, :]
    return fx.sum(fx.where(k == 0, v, 0.0), axis=1), fx.sum(fx.where(k == 1, v, 0.0), axis=1)


@flyc.func
def _merge_slices(base, p_idx, p_ok, p_count, N, IS_RMS: fx.constexpr, SPIN_LIMIT: fx.constexpr):
    """A norm row's (mean, var, ok) from every slice's published statistics at ``base``: RMSNorm's sums of
    squares (slots 0, 2, ...), or LayerNorm's (mean, M2) pairs merged with Chan's formula (``p_count``:
    each slice's columns). ``ok``: see :func:`.exchange.collect`."""
    if IS_RMS:
        a, ok = collect(base + 2 * p_idx, p_ok, SPIN_LIMIT)  # masked-off slots read 0
        return 0.0, fx.sum(a, axis=0) / N, ok
    _, pairs, pairs_ok = _pair_slots(base, 0, p_idx, p_ok)
    ab, ok = collect(pairs, pairs_ok, SPIN_LIMIT)
    a, b = _unpair(ab)
    mean = row_mean(fx.sum(a * p_count, axis=0), N)
    dm = fx.where(p_ok, a - mean, 0.0)
    return mean, (fx.sum(b, axis=0) + fx.sum(p_count * dm * dm, axis=0)) / N, ok


@flyc.func
def _exchange_amax(base, part, p_idx, p_ok, amax, live, PARTS_POW2: fx.constexpr, SPIN_LIMIT: fx.constexpr):
    """The quantized forwards' second exchange: this slice's max |y| published (``live``: the row exists),
    the row's returned with its ``ok``. Slots after the (s1, s2) pairs: ``base + 2 * PARTS_POW2 + part``.
    A NaN slice makes the row's NaN, as torch's amax (the masked-off slots' zeros would win a plain max)."""
    publish(base + 2 * PARTS_POW2 + part, amax, live)
    amax_p, ok = collect(base + 2 * PARTS_POW2 + p_idx, p_ok, SPIN_LIMIT)
    return absmax_f32(amax_p, 0), ok


@flyc.func
def _merge_softmax_slices(pairs, pairs_ok, p_ok, SPIN_LIMIT: fx.constexpr):
    """A softmax row's (base, 1 / sum) from every slice's published (max, sum of exp(x - max)) pair: each
    slice's sum rescaled to the row's max. 1 / sum is NaN for a row given up on, and for an all -inf row
    (0 * inf, as torch.softmax)."""
    ms_ss, ok = collect(pairs, pairs_ok, SPIN_LIMIT)
    ms, ss = _unpair(ms_ss)  # masked-off slots read 0: their max is made -inf, their sum stays 0
    ms = fx.where(p_ok, ms, NEG_INF)
    m = fx.max(ms, axis=0)
    row_base = fx.where(m > NEG_INF, m, 0.0)
    slice_base = fx.where(ms > NEG_INF, ms, 0.0)
    s = fx.sum(fx.where(ss > 0, ss * fx.exp2((slice_base - row_base) * LOG2E), 0.0), axis=0)
    return row_base, fx.where(ok, 1.0 / s, float("nan"))


@flyc.func
def _load_row(ptr, row, stride, c, mask, other, EVICT: fx.constexpr):
    """Columns ``c`` of row ``row`` (int64 offsets), with the cache hint ``EVICT``."""
    return fx.load(ptr + row_offset(row, stride) + c, mask=mask, other=other, eviction_policy=EVICT)


@flyc.func
def _my_slice(N, parts, SLICE: fx.constexpr, PARTS_POW2: fx.constexpr):
    """This program's place in the wave: (group, groups, part, its columns, their mask, part indices, their mask)."""
    pid = fx.program_id(0)
    groups = fx.num_programs(0) // parts
    part = pid % parts
    c = part * SLICE + fx.arange(0, SLICE)
    p_idx = fx.arange(0, PARTS_POW2)
    return pid // parts, groups, part, c, c < N, p_idx, p_idx < parts


@flyc.func
def _my_words(N, parts, SLICE: fx.constexpr, PARTS_POW2: fx.constexpr):
    """:func:`_my_slice` for the staged kernels, which read their slice of a 16-bit row as int32 words: (group,
    groups, part, the slice's words (column pairs), their mask, part indices, their mask)."""
    group, groups, part, _, _, p_idx, p_ok = _my_slice(N, parts, SLICE, PARTS_POW2)
    c2 = part * (SLICE // 2) + fx.arange(0, SLICE // 2)
    return group, groups, part, c2, c2 < N // 2, p_idx, p_ok


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def norm_fwd_split_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr, s_ptr,       # inputs (None when absent; s: SmoothQuant column scales)
    y_ptr, h_ptr, mean_ptr, rstd_ptr, qs_ptr,  # outputs (None when not wanted; y holds q when quantizing)
    slot_ptr,                                # int64 [M, 3 * PARTS_POW2] slice statistics (zeroed)
    M, N, parts, stride_x, stride_r, stride_y, stride_h, eps, weight_offset,
    IS_RMS: fx.constexpr, HAS_RESIDUAL: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_BIAS: fx.constexpr,
    HAS_SMOOTH: fx.constexpr, STORE_STATS: fx.constexpr, QUANT: fx.constexpr, QMAX: fx.constexpr,
    SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, SPIN_LIMIT: fx.constexpr,
    ROW_EVICT: fx.constexpr = "", COL_EVICT: fx.constexpr = "",  # cache hints (SPLIT_EVICT)
):
    # fmt: on
    group, groups, part, c, cmask, p_idx, p_ok = _my_slice(N, parts, SLICE, PARTS_POW2)
    n_here = fx.minimum(N - part * SLICE, SLICE) * 1.0  # elements of this slice
    p_count = fx.where(p_ok, fx.minimum(N - p_idx * SLICE, SLICE) * 1.0, 0.0)

    x_nx = _load_row(x_ptr, group, stride_x, c, cmask & (group < M), 0.0, ROW_EVICT)
    if HAS_RESIDUAL:
        r_nx = _load_row(r_ptr, group, stride_r, c, cmask & (group < M), 0.0, ROW_EVICT)
    # The per-column operands (weight, bias, smooth scale) are loaded again for every row, after the wait
    # (L1 hits): held in registers for the whole loop instead, they cost a resident program per SM, and
    # measured slower on the H200.
    for row in range(group, M, groups):
        h = x_nx.to(fx.float32)
        if HAS_RESIDUAL:  # the sum as residual_out stores it (passes.load_h)
            h = stored_sum(h, r_nx)
            fx.store(h_ptr + row_offset(row, stride_h) + c, h.to(h_ptr.dtype.element_ty), mask=cmask)
        # 1. this slice's statistics, published
        if IS_RMS:
            s1 = fx.sum(h * h, axis=0)
            s2 = s1 * 0.0
        else:
            s1 = fx.sum(h, axis=0) / n_here
            d = fx.where(cmask, h - s1, 0.0)
            s2 = fx.sum(d * d, axis=0)
        base = slot_ptr + row_offset(row, 3 * PARTS_POW2)  # [(s1, s2) pairs | amax] slots per row
        mine = base + 2 * part
        publish(mine, s1, row < M)
        if not IS_RMS:
            publish(mine + 1, s2, row < M)
        # 2. the next row's slice, in flight during the wait
        nxt = row + groups
        x_nx = _load_row(x_ptr, nxt, stride_x, c, cmask & (nxt < M), 0.0, ROW_EVICT)
        if HAS_RESIDUAL:
            r_nx = _load_row(r_ptr, nxt, stride_r, c, cmask & (nxt < M), 0.0, ROW_EVICT)
        # 3. the row's statistics from every slice, then y
        mean, var, ok = _merge_slices(base, p_idx, p_ok, p_count, N, IS_RMS, SPIN_LIMIT)
        rstd = fx.where(ok, fx.rsqrt(var + eps), float("nan"))
        y = (h - mean) * rstd
        if HAS_WEIGHT:
            y = y * load_weight(w_ptr, c, cmask, weight_offset, HAS_WEIGHT, COL_EVICT)
        if HAS_BIAS:
            y = y + fx.load(b_ptr + c, mask=cmask, other=0.0, eviction_policy=COL_EVICT).to(fx.float32)
        if QUANT == 0:
            fx.store(y_ptr + row_offset(row, stride_y) + c, y.to(y_ptr.dtype.element_ty), mask=cmask)
        else:
            # 4. quantized output: a second exchange, of the slices' |y| maxima (NaN where y holds a NaN, as
            # torch's amax: a plain max drops it, and the zeros past N in a short slice would win).
            if HAS_SMOOTH:
                y = y * fx.load(s_ptr + c, mask=cmask, other=0.0, eviction_policy=COL_EVICT).to(fx.float32)
            amax, ok2 = _exchange_amax(base, part, p_idx, p_ok, absmax_f32(fx.where(cmask, y, 0.0), 0),
                                       row < M, PARTS_POW2, SPIN_LIMIT)  # fmt: skip
            inv = inverse_scale(amax, QMAX)  # an all-zero row: q = 0
            if QUANT == 1:
                q = cast_sat_int8(y * inv)
            else:
                q = cast_sat_fp8e4m3(y * inv)
            fx.store(y_ptr + row_offset(row, stride_y) + c, q, mask=cmask)
            # a row given up on (see collect) gets a NaN scale: every value dequantizes to NaN
            fx.store(qs_ptr + row, fx.where(ok & ok2, quant_scale(amax, QMAX), float("nan")), mask=part == 0)
        if STORE_STATS:
            if not IS_RMS:
                fx.store(mean_ptr + row, mean, mask=part == 0)
            fx.store(rstd_ptr + row, rstd, mask=part == 0)


@flyc.kernel(do_not_specialize=["M"])
def softmax_fwd_split_kernel(
    x_ptr, y_ptr, slot_ptr, M, N, parts, stride_x, stride_y,
    SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, SPIN_LIMIT: fx.constexpr, ROW_EVICT: fx.constexpr = "",
):  # fmt: skip
    group, groups, part, c, cmask, p_idx, p_ok = _my_slice(N, parts, SLICE, PARTS_POW2)
    x_nx = _load_row(x_ptr, group, stride_x, c, cmask & (group < M), NEG_INF, ROW_EVICT)
    for row in range(group, M, groups):
        x = x_nx.to(fx.float32)
        # 1. the slice's max and its sum of exp(x - max) (an all -inf slice: max -inf, sum 0)
        m_b = fx.max(x, axis=0)
        base_b = fx.where(m_b > NEG_INF, m_b, 0.0)
        s_b = fx.sum(fx.exp2((x - base_b) * LOG2E), axis=0)
        base = slot_ptr + row_offset(row, 2 * PARTS_POW2)
        mine, pairs, pairs_ok = _pair_slots(base, part, p_idx, p_ok)
        publish(mine, m_b, row < M)
        publish(mine + 1, s_b, row < M)
        # 2. the next row's slice, in flight during the wait
        nxt = row + groups
        x_nx = _load_row(x_ptr, nxt, stride_x, c, cmask & (nxt < M), NEG_INF, ROW_EVICT)
        # 3. the row's max and sum from every slice, then y
        row_base, inv = _merge_softmax_slices(pairs, pairs_ok, p_ok, SPIN_LIMIT)
        y = fx.exp2((x - row_base) * LOG2E) * inv
        fx.store(y_ptr + row_offset(row, stride_y) + c, y.to(y_ptr.dtype.element_ty), mask=cmask)


@flyc.kernel(do_not_specialize=["M"])
def softmax_bwd_split_kernel(
    dy_ptr, y_ptr, dx_ptr, slot_ptr, M, N, parts, stride_dy, stride_y, stride_dx,
    SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, SPIN_LIMIT: fx.constexpr, LANES: fx.constexpr,
    ROW_EVICT: fx.constexpr = "",
):  # fmt: skip
    group, groups, part, c, cmask, _, _ = _my_slice(N, parts, SLICE, PARTS_POW2)
    dy_nx = _load_row(dy_ptr, group, stride_dy, c, cmask & (group < M), 0.0, ROW_EVICT)
    y_nx = _load_row(y_ptr, group, stride_y, c, cmask & (group < M), 0.0, ROW_EVICT)
    for row in range(group, M, groups):
        dy = dy_nx.to(fx.float32)
        y = y_nx.to(fx.float32)
        base = slot_ptr + row_offset(row, PARTS_POW2)
        publish(base + part, fx.sum(dy * y, axis=0), row < M)
        nxt = row + groups
        dy_nx = _load_row(dy_ptr, nxt, stride_dy, c, cmask & (nxt < M), 0.0, ROW_EVICT)
        y_nx = _load_row(y_ptr, nxt, stride_y, c, cmask & (nxt < M), 0.0, ROW_EVICT)
        dot, ok = collect_sum(base, parts, SPIN_LIMIT, LANES)
        dot = fx.where(ok, dot, float("nan"))
        fx.store(dx_ptr + row_offset(row, stride_dx) + c, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=cmask)


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def norm_bwd_split_kernel(
    h_ptr, w_ptr, dy_ptr, dres_ptr, mean_ptr, rstd_ptr,   # inputs (None when absent)
    dx_ptr, dwp_ptr, dbp_ptr, slot_ptr,                   # dx, [groups, N] weight-gradient partials, row slots
    M, N, parts, stride_h, stride_dy, stride_dres, stride_dx, weight_offset,
    IS_RMS: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_DRES: fx.constexpr, COMPUTE_DW: fx.constexpr,
    COMPUTE_DB: fx.constexpr, SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, SPIN_LIMIT: fx.constexpr,
    ROWS: fx.constexpr = 1, ROW_EVICT: fx.constexpr = "",
):
    # fmt: on
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * (w + offset): the two row means are
    # the partial results; dweight / dbias accumulate per column over the program's rows, for its slice.
    # A program takes ROWS rows at a time ([ROWS, SLICE] tiles, row blocks group, group + groups, ...):
    # the weight slice and the weight-gradient sums are per column, so more rows a tile and a
    # narrower slice hold the same row bytes in fewer registers.
    group, groups, part, c, cmask, p_idx, p_ok = _my_slice(N, parts, SLICE, PARTS_POW2)
    r = fx.arange(0, ROWS)
    k = fx.arange(0, 2)
    dw = fx.zeros([SLICE], dtype=fx.float32)
    db = fx.zeros([SLICE], dtype=fx.float32)
    rows = group * ROWS + r
    h_nx, dy_nx, rstd_nx, mean_nx = load_bwd_rows(h_ptr, dy_ptr, mean_ptr, rstd_ptr, rows, M, c, cmask,
                                                    stride_h, stride_dy, IS_RMS, ROW_EVICT)  # fmt: skip
    wv = load_weight(w_ptr, c, cmask, weight_offset, HAS_WEIGHT, "")[None, :]  # once: no load after the waits
    for blk in range(group, fx.cdiv(M, ROWS), groups):
        rows = blk * ROWS + r
        row_ok = rows < M
        mask = row_ok[:, None] & cmask[None, :]
        h = h_nx.to(fx.float32)
        dy = dy_nx.to(fx.float32)
        rstd = rstd_nx[:, None]
        xhat = fx.where(mask, (h - mean_nx[:, None]) * rstd, 0.0)
        g = dy * wv
        # slots of a row: [PARTS_POW2, 2] (g * xhat, g) pairs; this tile's rows, this slice
        base = slot_ptr + row_offset(rows, 2 * PARTS_POW2)
        mine = base + 2 * part
        if IS_RMS:
            publish(mine, fx.sum(g * xhat, axis=1), row_ok)
        else:
            s_gx, s_g = sum2_f32(g * xhat, g, 1)  # one exchange between warps for both
            publish(mine, s_gx, row_ok)
            publish(mine + 1, s_g, row_ok)
        nxt = (blk + groups) * ROWS + r
        h_nx, dy_nx, rstd_nx, mean_nx = load_bwd_rows(h_ptr, dy_ptr, mean_ptr, rstd_ptr, nxt, M, c, cmask,
                                                        stride_h, stride_dy, IS_RMS, ROW_EVICT)  # fmt: skip
        if COMPUTE_DW:
            dw += fx.sum(dy * xhat, axis=0)
        if COMPUTE_DB:
            db += fx.sum(dy, axis=0)
        slots = base[:, None, None] + 2 * p_idx[None, :, None] + k[None, None, :]
        slots_ok = row_ok[:, None, None] & p_ok[None, :, None] & (k[None, None, :] < 2 - IS_RMS)
        sums, ok = collect(slots, slots_ok, SPIN_LIMIT)  # masked-off slots read 0
        c1, c2 = _unpair(fx.sum(sums, axis=1) / N)  # [ROWS, 2] -> mean(g * xhat), mean(g)
        g = dy * wv
        if IS_RMS:
            dx = (g - xhat * c1[:, None]) * rstd
        else:
            dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd
        if HAS_DRES:
            dres = fx.load(dres_ptr + row_offset(rows, stride_dres)[:, None] + c[None, :], mask=mask, other=0.0,
                           eviction_policy=ROW_EVICT)  # fmt: skip
            dx += dres.to(fx.float32)
        dx = fx.where(ok, dx, float("nan"))
        fx.store(dx_ptr + row_offset(rows, stride_dx)[:, None] + c[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    if COMPUTE_DW:
        fx.store(dwp_ptr + row_offset(group, N) + c, dw, mask=cmask)
    if COMPUTE_DB:
        fx.store(dbp_ptr + row_offset(group, N) + c, db, mask=cmask)


@flyc.func
def _publish_tile(
    h, dy, rstd, mean, w_ptr, slot_ptr, blk, M, c, cmask, r, part, weight_offset,
    IS_RMS: fx.constexpr, HAS_WEIGHT: fx.constexpr, PARTS_POW2: fx.constexpr, ROWS: fx.constexpr,
):  # fmt: skip
    """The tiled backward's pass 1 over tile ``blk`` from its loaded h and dy (storage dtype; rows past M
    load as zeros and publish nothing): the rows' partial sums of g * xhat and g over this program's
    slice, published row by row (scalar atomics: layer_norm tiles published as one block atomic waited
    out the spin limit on the H200)."""
    mask = (blk * ROWS + r < M)[:, None] & cmask[None, :]
    wv = load_weight(w_ptr, c, cmask, weight_offset, HAS_WEIGHT, "evict_last")[None, :]
    xhat = fx.where(mask, (h.to(fx.float32) - mean[:, None]) * rstd[:, None], 0.0)
    g = dy.to(fx.float32) * wv
    if IS_RMS:
        s_gx = fx.sum(g * xhat, axis=1)
        s_g = s_gx
    else:
        s_gx, s_g = sum2_f32(g * xhat, g, 1)  # one exchange between warps for both
    for i in fx.static_range(ROWS):
        mine = slot_ptr + row_offset(blk * ROWS + i, 2 * PARTS_POW2) + 2 * part
        live = blk * ROWS + i < M
        publish(mine, fx.sum(fx.where(r == i, s_gx, 0.0), axis=0), live)
        if not IS_RMS:
            publish(mine + 1, fx.sum(fx.where(r == i, s_g, 0.0), axis=0), live)


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def norm_bwd_tiled_kernel(
    h_ptr, w_ptr, dy_ptr, dres_ptr, mean_ptr, rstd_ptr,   # inputs (None when absent)
    dx_ptr, dwp_ptr, dbp_ptr, slot_ptr,                   # dx, [groups, N] weight-gradient partials, row slots
    M, N, parts, stride_h, stride_dy, stride_dres, stride_dx, weight_offset,
    IS_RMS: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_DRES: fx.constexpr, COMPUTE_DW: fx.constexpr,
    COMPUTE_DB: fx.constexpr, SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, SPIN_LIMIT: fx.constexpr,
    ROWS: fx.constexpr, LEAD: fx.constexpr,
):
    # fmt: on
    # The tiled form of the split backward: a program owns a column slice and walks tiles of ROWS rows.
    # Pass 1 loads the tile (evict_last) and publishes the rows' partial sums (_publish_tile); after the
    # wait pass 2 re-reads the tile (from L2) for dx and the dweight/dbias sums. Nothing is held in
    # registers across the wait. LEAD runs pass 1 one tile ahead: a program publishes its next tile
    # before it waits for this one, which its peers published an iteration ago, so the wait seldom
    # stalls (two tiles a program in L2). LEAD = 2 also keeps the next tile's loads in flight through the
    # wait and pass 2, reducing and publishing them after (their registers held meanwhile). No cycle of
    # waits: with a lead, the tile a program waits on was published by its peers before the loop or in
    # their previous iteration, which itself waited only on an earlier tile.
    group, groups, part, c, cmask, p_idx, p_ok = _my_slice(N, parts, SLICE, PARTS_POW2)
    r = fx.arange(0, ROWS)
    k = fx.arange(0, 2)
    dw = fx.zeros([SLICE], dtype=fx.float32)
    db = fx.zeros([SLICE], dtype=fx.float32)
    ahead = groups * (LEAD != 0)  # the tile pass 1 works on, relative to the one waited for
    if LEAD:
        h0, dy0, rstd0, mean0 = load_bwd_rows(h_ptr, dy_ptr, mean_ptr, rstd_ptr, group * ROWS + r, M, c, cmask,
                                              stride_h, stride_dy, IS_RMS, "evict_last")  # fmt: skip
        _publish_tile(h0, dy0, rstd0, mean0, w_ptr, slot_ptr, group, M, c, cmask, r, part, weight_offset, IS_RMS,
                      HAS_WEIGHT, PARTS_POW2, ROWS)  # fmt: skip
    for blk in fx.range(group, fx.cdiv(M, ROWS), groups, disable_licm=True):
        rows = blk * ROWS + r
        row_ok = rows < M
        mask = row_ok[:, None] & cmask[None, :]
        h1, dy1, rstd1, mean1 = load_bwd_rows(h_ptr, dy_ptr, mean_ptr, rstd_ptr, rows + ahead * ROWS, M, c, cmask,
                                              stride_h, stride_dy, IS_RMS, "evict_last")  # fmt: skip
        if LEAD != 2:
            _publish_tile(h1, dy1, rstd1, mean1, w_ptr, slot_ptr, blk + ahead, M, c, cmask, r, part, weight_offset,
                          IS_RMS, HAS_WEIGHT, PARTS_POW2, ROWS)  # fmt: skip
        base = slot_ptr + row_offset(rows, 2 * PARTS_POW2)
        slots = base[:, None, None] + 2 * p_idx[None, :, None] + k[None, None, :]
        slots_ok = row_ok[:, None, None] & p_ok[None, :, None] & (k[None, None, :] < 2 - IS_RMS)
        sums, ok = collect(slots, slots_ok, SPIN_LIMIT)  # masked-off slots read 0
        c1, c2 = _unpair(fx.sum(sums, axis=1) / N)  # [ROWS, 2] -> mean(g * xhat), mean(g)
        # pass 2: the tile again, from L2
        h, dy, rstd, mean = load_bwd_rows(h_ptr, dy_ptr, mean_ptr, rstd_ptr, rows, M, c, cmask, stride_h,
                                          stride_dy, IS_RMS, "evict_first")  # fmt: skip
        wv = load_weight(w_ptr, c, cmask, weight_offset, HAS_WEIGHT, "evict_last")[None, :]
        xhat = fx.where(mask, (h.to(fx.float32) - mean[:, None]) * rstd[:, None], 0.0)
        dyf = dy.to(fx.float32)
        if IS_RMS:
            dx = (dyf * wv - xhat * c1[:, None]) * rstd[:, None]
        else:
            dx = (dyf * wv - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        if HAS_DRES:
            dres = fx.load(dres_ptr + row_offset(rows, stride_dres)[:, None] + c[None, :], mask=mask, other=0.0)
            dx += dres.to(fx.float32)
        dx = fx.where(ok, dx, float("nan"))
        fx.store(dx_ptr + row_offset(rows, stride_dx)[:, None] + c[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
        if COMPUTE_DW:
            dw += fx.sum(dyf * xhat, axis=0)
        if COMPUTE_DB:
            db += fx.sum(dyf, axis=0)
        if LEAD == 2:
            _publish_tile(h1, dy1, rstd1, mean1, w_ptr, slot_ptr, blk + ahead, M, c, cmask, r, part, weight_offset,
                          IS_RMS, HAS_WEIGHT, PARTS_POW2, ROWS)  # fmt: skip
    if COMPUTE_DW:
        fx.store(dwp_ptr + row_offset(group, N) + c, dw, mask=cmask)
    if COMPUTE_DB:
        fx.store(dbp_ptr + row_offset(group, N) + c, db, mask=cmask)


@flyc.func
def _staged_pass1(
    h_ptr, dy_ptr, mean_ptr, rstd_ptr, slot_ptr, row, M, c2, ok2, we, wo, part, stride_h, stride_dy,
    IS_RMS: fx.constexpr, PARTS_POW2: fx.constexpr, PAIR: fx.constexpr,
):  # fmt: skip
    """The staged backward's pass 1 of ``row`` (nothing past M): its slice of h and dy loaded as int32 words
    (two columns each), the slice's sum of g * xhat (and, LayerNorm, of g) published; returns the words, rstd
    and mean. The sum of g * xhat is taken as rstd * sum(g * (h - mean)), a multiply an element fewer.
    LayerNorm with ``PAIR`` (see the kernel): sum(g * (h - mean)) as sum(g * h) - mean * sum(g), an add
    an element fewer, and both sums one signed pair in the slice's slot, one atomic a slice; without:
    two slots a slice."""
    ok = row < M
    hw = fx.load(as_words(h_ptr) + row_offset(row, stride_h // 2) + c2, mask=ok2 & ok, other=0)
    dyw = fx.load(as_words(dy_ptr) + row_offset(row, stride_dy // 2) + c2, mask=ok2 & ok, other=0)
    rstd = fx.load(rstd_ptr + row, mask=ok, other=0.0)
    mean = 0.0 if IS_RMS else fx.load(mean_ptr + row, mask=ok, other=0.0)
    he, ho = bf16_pairs(hw)
    de, do = bf16_pairs(dyw)
    mine = slot_ptr + row_offset(row, PARTS_POW2) + part  # one slot a slice (RMSNorm, PAIR)
    ge = de * we  # 0 past the row (dy reads 0 there), and so is every term of the sums: no select
    go = do * wo
    if IS_RMS:
        publish(mine, fx.sum(ge * he + go * ho, axis=0) * rstd, ok)
    elif PAIR:
        # one exchange between warps for both sums; where the mean is more than 64 standard deviations from 0
        # (the cancellation would then cost more than ~1e-4 of dx relative) sum(g * (h - mean)) is taken
        # again about the mean, re-widened from the words (nothing more held through the loop)
        s_gh, s_g = sum2_f32(ge * he + go * ho, ge + go, 0)
        s_gh = s_gh - mean * s_g
        if mean * mean * rstd * rstd > 4096.0:  # uniform: row scalars
            he2, ho2 = bf16_pairs_again(hw)
            de2, do2 = bf16_pairs_again(dyw)
            s_gh = fx.sum(de2 * we * (he2 - mean) + do2 * wo * (ho2 - mean), axis=0)
        publish_pair(mine, s_gh * rstd, s_g, ok, True)
    else:
        s_gh, s_g = sum2_f32(ge * (he - mean) + go * (ho - mean), ge + go, 0)  # one exchange between warps
        two = slot_ptr + row_offset(row, 2 * PARTS_POW2) + 2 * part
        publish(two, s_gh * rstd, ok)
        publish(two + 1, s_g, ok)
    return hw, dyw, rstd, mean


@flyc.func
def staged_dx(hw, dyw, mean, rstd, we, wo, c0, c1):
    """A norm backward's dx from a row held as words after its sums: h and dy widened anew (no fp32 copy held
    through the sums), xhat, and dx = (dy * w - c0 - xhat * c1) * rstd, with c1 = mean(g * xhat) and c0 =
    mean(g) (0 for RMSNorm). Returns (dy even, odd, xhat even, odd, dx even, odd) in fp32. Past the row dy
    reads 0, so the weight-gradient terms are 0 there without a select (and dx is not stored). (dx as
    fma(-xhat, c1 rstd, fma(dy w, rstd, -c0 rstd)), an instruction fewer, spills LayerNorm's kernel at 8192
    x 16 warps: 40-56 bytes, sm_90.) xhat is h * rstd - mean * rstd, one FMA an element (its error ~1e-7 *
    |mean| * rstd, absolute)."""
    he, ho = bf16_pairs_again(hw)
    de, do = bf16_pairs_again(dyw)
    mr = mean * rstd
    xe = he * rstd - mr
    xo = ho * rstd - mr
    return de, do, xe, xo, (de * we - c0 - xe * c1) * rstd, (do * wo - c0 - xo * c1) * rstd


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def norm_bwd_staged_kernel(
    h_ptr, w_ptr, dy_ptr, dres_ptr, mean_ptr, rstd_ptr,   # bf16 rows; fp32 statistics (None when absent)
    dx_ptr, dwp_ptr, dbp_ptr, slot_ptr,                   # dx, [groups, N] weight-gradient partials, row slots
    M, N, parts, stride_h, stride_dy, stride_dres, stride_dx, weight_offset,
    IS_RMS: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_DRES: fx.constexpr, COMPUTE_DW: fx.constexpr,
    COMPUTE_DB: fx.constexpr, SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, SPIN_LIMIT: fx.constexpr,
    STAGES: fx.constexpr, PAIR: fx.constexpr = True,
):
    # fmt: on
    # The split backward for bf16 rows, staged: a program's slice of each of its rows (row = group, group +
    # groups, ...) is read as int32 words through the software pipeliner (the row loop STAGES deep: the next
    # rows' bytes wait in shared memory, not in registers), pass 1 runs a row ahead (the next row's sums are
    # published before this row's are awaited, so the wait is on sums published an iteration ago), and the
    # wait starts from the slots as read before pass 1 (peek / collect_from: an asm wait, no loop the
    # pipeliner would refuse). The row's words are widened for pass 1 and again for dx (no fp32 copy held).
    # LayerNorm's PAIR form (_staged_pass1) is a register or two heavier: with a residual gradient it spills
    # (16 bytes, sm_90; H200 at 16K / 32K: 69 / 68% of copy against 92 / 91% without PAIR), so
    # the host passes PAIR only without one.
    group, groups, part, c2, ok2, _, _ = _my_words(N, parts, SLICE, PARTS_POW2)
    we = load_weight(w_ptr, 2 * c2, ok2, weight_offset, HAS_WEIGHT, "")
    wo = load_weight(w_ptr, 2 * c2 + 1, ok2, weight_offset, HAS_WEIGHT, "")
    dwe = fx.zeros([SLICE // 2], dtype=fx.float32)
    dwo = fx.zeros([SLICE // 2], dtype=fx.float32)
    dbe = fx.zeros([SLICE // 2], dtype=fx.float32)
    dbo = fx.zeros([SLICE // 2], dtype=fx.float32)
    if IS_RMS or PAIR:
        k = fx.arange(0, PARTS_POW2)  # a row's slots, one a slice
        kmask = k < parts
    else:
        k = fx.arange(0, 2 * PARTS_POW2)  # [part, (g * xhat, g)] flattened
        kmask = k // 2 < parts
    hw, dyw, rstd, mean = _staged_pass1(h_ptr, dy_ptr, mean_ptr, rstd_ptr, slot_ptr, group, M, c2, ok2, we, wo,
                                        part, stride_h, stride_dy, IS_RMS, PARTS_POW2, PAIR)  # fmt: skip
    for row in fx.range(group, M, groups, num_stages=STAGES):
        slots = slot_ptr + row_offset(row, (1 if IS_RMS or PAIR else 2) * PARTS_POW2) + k
        early = peek(slots)
        hw_nx, dyw_nx, rstd_nx, mean_nx = _staged_pass1(h_ptr, dy_ptr, mean_ptr, rstd_ptr, slot_ptr, row + groups,
                                                        M, c2, ok2, we, wo, part, stride_h, stride_dy, IS_RMS,
                                                        PARTS_POW2, PAIR)  # fmt: skip
        # NaN where a wait gave up: dx poisoned
        if IS_RMS:
            c1 = fx.sum(collect_from(early, slots, kmask, SPIN_LIMIT), axis=0) / N  # mean(g * xhat)
            c0 = 0.0
        else:
            if PAIR:
                s_gx, s_g = collect_pairs_from(early, slots, kmask, SPIN_LIMIT, True)
            else:
                sums = collect_from(early, slots, kmask, SPIN_LIMIT)
                s_gx = fx.where(k % 2 == 0, sums, 0.0)
                s_g = fx.where(k % 2 == 1, sums, 0.0)
            c1, c0 = sum2_f32(s_gx, s_g, 0)
            c1 = c1 / N  # mean(g * xhat)
            c0 = c0 / N  # mean(g)
        de, do, xe, xo, dxe, dxo = staged_dx(hw, dyw, mean, rstd, we, wo, c0, c1)
        if HAS_DRES:
            re, ro = bf16_pairs(fx.load(as_words(dres_ptr) + row_offset(row, stride_dres // 2) + c2, mask=ok2,
                                        other=0))  # fmt: skip
            dxe += re
            dxo += ro
        fx.store(as_words(dx_ptr) + row_offset(row, stride_dx // 2) + c2, bf16_words(dxe, dxo), mask=ok2)
        if COMPUTE_DW:
            dwe += de * xe
            dwo += do * xo
        if COMPUTE_DB:
            dbe += de
            dbo += do
        hw, dyw, rstd, mean = hw_nx, dyw_nx, rstd_nx, mean_nx
    part_cols = row_offset(group, N) + 2 * c2
    if COMPUTE_DW:
        fx.store(dwp_ptr + part_cols, dwe, mask=ok2)
        fx.store(dwp_ptr + part_cols + 1, dwo, mask=ok2)
    if COMPUTE_DB:
        fx.store(dbp_ptr + part_cols, dbe, mask=ok2)
        fx.store(dbp_ptr + part_cols + 1, dbo, mask=ok2)


@flyc.func
def _fwd_staged_pass1(
    x_ptr, slot_ptr, row, M, c2, ok2, n_mine, part, stride_x, IS_RMS: fx.constexpr, PARTS_POW2: fx.constexpr
):  # fmt: skip
    """The staged forward's pass 1 of ``row`` (nothing past M): its slice of x as int32 words; publishes the
    slice's sum of squares (RMSNorm), or its sum and its M2 (LayerNorm; ``n_mine``: the slice's columns).
    Returns the words.

    LayerNorm's M2 comes from one exchange between warps, of the sum and the sum of squares, as
    ``sum x^2 - sum x * mean``; where that cancels more than 6 bits (``M2 < sum x^2 / 64``: a mean beyond
    ~8 standard deviations) it is taken again about the mean, from the words still held. So M2 keeps 17+
    of fp32's 24 bits in every case at the cost of one reduction a row where the data are ordinary (on
    the H200, two reductions a row measured 3 points of copy bandwidth slower)."""
    ok = row < M
    xw = fx.load(as_words(x_ptr) + row_offset(row, stride_x // 2) + c2, mask=ok2 & ok, other=0)
    xe, xo = bf16_pairs(xw)
    if IS_RMS:
        publish(slot_ptr + row_offset(row, PARTS_POW2) + part, fx.sum(xe * xe + xo * xo, axis=0), ok)
    else:
        s1, s2 = sum2_f32(xe + xo, xe * xe + xo * xo, 0)  # masked-off words read 0
        mean = s1 / n_mine
        m2 = s2 - s1 * mean
        if m2 * 64.0 < s2:  # uniform: every thread holds the reductions' results
            de = fx.where(ok2, xe - mean, 0.0)
            do = fx.where(ok2, xo - mean, 0.0)
            m2 = fx.sum(de * de + do * do, axis=0)
        # one word a slice, M2's sign bit the tag (never negative here: the fallback takes the exact M2 where
        # the sums' M2 would be; H200: +0.7 points of copy bandwidth over two words)
        publish_pair(slot_ptr + row_offset(row, PARTS_POW2) + part, s1, m2, ok)
    return xw


@flyc.func
def _widened_each_row(words, rstd):
    """bf16 ``words`` (a weight or bias held packed across the row loop) widened to fp32 pairs after ``rstd``:
    their zero bytes come from rstd's sign bit (0; a NaN rstd's garbage meets a NaN row), which the compiler
    cannot know, so it cannot hoist the widening out of the loop and hold the fp32 pairs instead."""
    return bf16_pairs_third(words, fx.zeros_like(words) + (rstd.to(fx.int32, bitcast=True) >> 31))


# fmt: off
@flyc.kernel(do_not_specialize=["M", "clear_n"])
def norm_fwd_staged_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, slot_ptr, clear_ptr,
    M, N, parts, stride_x, stride_y, eps, weight_offset, clear_n,
    IS_RMS: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_BIAS: fx.constexpr, STORE_STATS: fx.constexpr,
    SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, SPIN_LIMIT: fx.constexpr, STAGES: fx.constexpr,
):
    # fmt: on
    # The split forward for bf16 rows, staged as the backward (norm_bwd_staged_kernel): the slice of each
    # row read as int32 words through the software pipeliner, pass 1 a row ahead, the wait from the slots as
    # read before it. RMSNorm holds its weight in fp32; LayerNorm holds its bf16 weight and bias as words,
    # widened each row (as fp32 pairs they would spill at 16 warps x 16384 columns, sm_90) and merges
    # the slices' (sum, M2) with Chan's formula. Part 0 of a row stores its statistics.
    # Launched with PDL (pdl_options): the launch overlaps the kernel before's tail; the wait is before
    # anything is read or written (the slots this launch takes were zeroed by that kernel, or one before
    # it). Every program of the wave has passed it when the next PDL launch on the stream may start.
    pdl_wait()
    pdl_launch_dependents()
    group, groups, part, c2, ok2, _, _ = _my_words(N, parts, SLICE, PARTS_POW2)
    n_mine = fx.minimum(N - part * SLICE, SLICE) * 1.0
    k = fx.arange(0, PARTS_POW2)  # a row's slots, one a slice
    kmask = k < parts
    if IS_RMS:
        we = load_weight(w_ptr, 2 * c2, ok2, weight_offset, HAS_WEIGHT, "")
        wo = load_weight(w_ptr, 2 * c2 + 1, ok2, weight_offset, HAS_WEIGHT, "")
    else:
        if HAS_WEIGHT:
            ww = fx.load(as_words(w_ptr) + c2, mask=ok2, other=0)
        if HAS_BIAS:
            bw = fx.load(as_words(b_ptr) + c2, mask=ok2, other=0)
        n_k = fx.maximum(fx.minimum(N - k * SLICE, SLICE), 1) * 1.0  # each slice's width
    xw = _fwd_staged_pass1(x_ptr, slot_ptr, group, M, c2, ok2, n_mine, part, stride_x, IS_RMS, PARTS_POW2)
    for row in fx.range(group, M, groups, num_stages=STAGES):
        slots = slot_ptr + row_offset(row, PARTS_POW2) + k
        early = peek(slots)
        xw_nx = _fwd_staged_pass1(x_ptr, slot_ptr, row + groups, M, c2, ok2, n_mine, part, stride_x, IS_RMS,
                                  PARTS_POW2)  # fmt: skip
        # NaN where a wait gave up: the row poisoned
        if IS_RMS:
            rstd = fx.rsqrt(fx.sum(collect_from(early, slots, kmask, SPIN_LIMIT), axis=0) / N + eps)
            xe, xo = bf16_pairs_again(xw)
            y = bf16_words(xe * rstd * we, xo * rstd * wo)
        else:
            sums, m2s = collect_pairs_from(early, slots, kmask, SPIN_LIMIT)
            mean = row_mean(fx.sum(sums, axis=0), N)
            dev = fx.where(kmask, sums / n_k - mean, 0.0)  # each slice's mean against the row's
            m2, spread = sum2_f32(m2s, n_k * dev * dev, 0)  # Chan: the slices' M2s and their means' spread
            rstd = fx.rsqrt((m2 + spread) / N + eps)
            xe, xo = bf16_pairs_again(xw)
            # y = (x - mean) * (rstd * w) + b: the scale per column, then one FMA an element
            se = rstd
            so = rstd
            if HAS_WEIGHT:
                we, wo = _widened_each_row(ww, rstd)
                if weight_offset is not None:
                    se = fx.fma(we, rstd, weight_offset * rstd)
                    so = fx.fma(wo, rstd, weight_offset * rstd)
                else:
                    se = we * rstd
                    so = wo * rstd
            if HAS_BIAS:
                be, bo = _widened_each_row(bw, rstd)
                ye = fx.fma(xe - mean, se, be)
                yo = fx.fma(xo - mean, so, bo)
            else:
                ye = (xe - mean) * se
                yo = (xo - mean) * so
            y = bf16_words(ye, yo)
            if STORE_STATS:
                fx.store(mean_ptr + row, mean, mask=part == 0)
        if STORE_STATS:
            fx.store(rstd_ptr + row, rstd, mask=part == 0)
        fx.store(as_words(y_ptr) + row_offset(row, stride_y // 2) + c2, y, mask=ok2)
        xw = xw_nx
    clear_share(clear_ptr, clear_n)  # the other pooled slots, after the loop (take_fwd_slots)
