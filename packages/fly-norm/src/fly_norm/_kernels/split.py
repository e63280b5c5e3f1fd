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
   tagged word: :func:`flydsl_common.device.publish`, no fence);
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
from the slots as read before pass 1 (:func:`flydsl_common.device.peek` /
:func:`~flydsl_common.device.collect_from`), inside one asm statement, since the pipeliner refuses
loops with nested loops (Triton 3.6: a loop holding a nested loop is left unpipelined).

The waits need every program of a row to be running at once: the grid never
exceeds one wave (:func:`flydsl.compiler.programs_per_sm`), and rows of more
than SPLIT_MAX_PARTS slices are left to the chunked paths. A wait that does
not end within SPIN_LIMIT polls poisons its row with NaN instead of hanging
the GPU. The interpreter runs programs one at a time, so the public ops never
take these paths there (:func:`split_applies`); tests run them through it with
one slice a row (no waiting) and with a tiny spin limit (the give-up path, and
the last program of each row merging every slice: ``tests/test_split.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

import flydsl.arch
import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import (
    as_words,
    bf16_pairs,
    bf16_pairs_again,
    bf16_pairs_third,
    bf16_words,
    cast_sat_fp8e4m3,
    cast_sat_int8,
    collect,
    collect_from,
    collect_pairs_from,
    collect_sum,
    pdl_launch_dependents,
    pdl_wait,
    peek,
    publish,
    publish_pair,
    row_offset,
    slot_lanes,
    sum2_f32,
)
from flydsl_common.rows import MAX_SINGLE_PASS

from .affine import load_bwd_rows, load_weight
from .passes import LOG2E, NEG_INF, clear_share, pdl_options, stages_fit, word_aligned

__all__ = [
    "SPLIT_MIN_N", "SPLIT_MIN_N_BWD", "SOFTMAX_SPLIT_MIN_N_BWD", "split_applies", "launch_fwd_split",
    "launch_bwd_split", "launch_softmax_fwd_split", "launch_softmax_bwd_split",
]  # fmt: skip

# On a GPU, the rows the default configs would send down a chunked (two-read) path take a split path:
# Forward: rows up to 32K columns take the chunked paths, their width fixed at compile time (passes.row_meta;
# H200, bf16, 2^27 elements: at 32K rms_norm 97%, softmax 92%, layer_norm 86% of copy chunked, against
# 85/81/75% split); wider rows' second read no longer finds them in L2 (64K: chunked 68-76%, split 69-83%).
SPLIT_MIN_N = 2 * MAX_SINGLE_PASS + 1
# Rows of more slices than this take the chunked paths: the wave then holds only a few rows and every
# program polls as many slots (softmax at 1M columns, 256 slices: 40% of copy against 55% chunked)
SPLIT_MAX_PARTS = 64
SPLIT_MIN_N_BWD = 8192 + 1  # backward: wider than its single-pass default (16 warps x 32 x 16 elements)
# Softmax's backward splits only past 16K: its chunked pass (8192 x 16 warps, the row's second read from L2)
# measured 187.3 us at 16K against the split's 202.9 (H200, bf16, 2^27 elements: 103% / 95% of a copy of
# the same bytes); at 32K the split stays ahead (205.7 against 211.4 us)
SOFTMAX_SPLIT_MIN_N_BWD = 16384 + 1


@dataclass(frozen=True)
class SliceConfig:
    """A register-resident split kernel's launch: each program holds ``slice_cols`` columns of a row (its
    slice) in registers, across ``warps`` warps, its registers capped at ``maxnreg`` (None: uncapped)."""

    slice_cols: int
    warps: int
    maxnreg: int | None = None


@dataclass(frozen=True)
class TiledConfig:
    """The tiled split backward's launch (:func:`_norm_bwd_tiled_kernel`): a program owns ``slice_cols``
    columns, across ``warps`` warps, registers capped at ``maxnreg`` (None: uncapped), and walks tiles of
    ``tile_rows`` rows; ``lead`` (0-2) runs pass 1 that many tiles ahead of the wait (see the kernel)."""

    slice_cols: int
    warps: int
    maxnreg: int | None
    tile_rows: int
    lead: int = 0


@dataclass(frozen=True)
class StagedConfig:
    """A staged split kernel's launch (bf16 rows held as int32 words): a program owns ``slice_cols`` columns,
    across ``warps`` warps, its row loop software-pipelined ``stages`` deep, registers capped at ``maxnreg``
    (None: uncapped)."""

    slice_cols: int
    warps: int
    stages: int
    maxnreg: int | None = None


@dataclass(frozen=True)
class EvictHints:
    """Cache hints of the split kernels' loads: of the rows, and of the per-column operands (weight, bias,
    smooth scale); each "" (none), "evict_first" or "evict_last"."""

    rows: str = ""
    cols: str = ""


# The slice configs: the fastest of the slice widths, warps and caps timed on the H200 (bf16, 2^27 elements,
# 16K-256K columns); several programs share an SM so that one's wait overlaps the others' loads. 32 elements
# a thread (the backward holds two rows: h and dy, or y and dy).
FWD_SLICE = SliceConfig(slice_cols=4096, warps=4)  # RMSNorm and softmax (80 registers: 6 programs an SM)
# From WIDE_MIN_N columns, RMSNorm and softmax slices of 8192 (168 registers, 2 programs an SM): fewer
# slices a row to wait for; H200, bf16: rms 77/73% of copy at 128K/256K against 76/57% with 4096-column
# slices, softmax 64/67 against 64/61
FWD_SLICE_WIDE = SliceConfig(slice_cols=8192, warps=4)
WIDE_MIN_N = 131072
# LayerNorm: 128 registers uncapped (4 programs an SM), 96 capped (5), spill-free
LN_FWD_SLICE = SliceConfig(slice_cols=4096, warps=4, maxnreg=96)
BWD_SLICE = SliceConfig(slice_cols=4096, warps=4)  # the norms' (which also hold per-column weight-gradient sums)
# Rows a norm-backward program takes at a time (a [BWD_ROWS, slice] tile). RMSNorm only: layer_norm with
# tiles of 4 rows waited out the spin limit on the H200 (every row poisoned, 16K-64K columns), cause not
# found; its tiles stay one row until that is understood.
BWD_ROWS = 1
# The tiled split backward (_norm_bwd_tiled_kernel: the tile re-read from L2 after the wait, nothing held
# across it): a TiledConfig, or None for the register-resident kernel above. Measured on the H200 (bf16,
# the whole backward through autograd, 16K/32K/64K columns), 2048
# columns x 4 warps, 4-row tiles, lead 1, capped at 168 registers: RMSNorm 69/69/67% of copy against the
# register-resident kernel's 54/54/52%, LayerNorm 58/60/60% against 58/55/53%. Lead 2 and the uncapped
# lead 1 (184 registers) lost to it everywhere.
BWD_TILED = TiledConfig(slice_cols=2048, warps=4, maxnreg=168, tile_rows=4, lead=1)  # RMSNorm
LN_BWD_TILED = TiledConfig(slice_cols=2048, warps=4, maxnreg=168, tile_rows=4, lead=1)
SOFTMAX_BWD_SLICE = SliceConfig(slice_cols=4096, warps=4)
# Rows of SOFTMAX_BWD_WIDE_MIN_N+ columns take slices of 8192 columns x 8 warps, up to SOFTMAX_BWD_MAX_PARTS
# of them (collect_sum's poll is one reduction whatever the count). H200 (bf16, 2^27 elements, % of copy):
# 256K 93 against 90 for 4096 x 4, 512K 85 and 1M 78 against the chunked pass's 59 and 55 (it reads the rows
# twice; 256 slices of 4096 at 1M: 64); 16384 x 16 and 8192 x 4 no better
SOFTMAX_BWD_SLICE_WIDE = SliceConfig(slice_cols=8192, warps=8)
SOFTMAX_BWD_WIDE_MIN_N = 262144
SOFTMAX_BWD_MAX_PARTS = 256
# The staged norm forward (_norm_fwd_staged_kernel, bf16 rows of FWD_STAGED_MIN_N+ columns, no residual,
# smooth scale or quantized output, LayerNorm's weight and bias bf16 or absent), a StagedConfig. H200 (bf16,
# 2^27 elements): RMSNorm 91 / 90 / 88% of copy at 64K / 128K / 256K against the register-resident split's
# 83 / 77 / 72%; 8192 x 16 and 4096 x 8 slower; at 32K the single passes stay ahead (99% against 91%).
# LayerNorm 86 / 84 / 83% against 68 / 61 / 55%. Softmax's staged forward (81 / 78 / 76%) lost to the
# resident kernel (fly_norm._kernels.resident, 88-91%). 16384 x 8 warps (one uncapped program an SM): -1 to
# +0.5 points; LayerNorm's weight and bias held widened there: -20 to -30.
FWD_STAGED = StagedConfig(slice_cols=16384, warps=16, stages=3)
FWD_STAGED_MIN_N = 65536
# The staged norm backward (_norm_bwd_staged_kernel, bf16 rows), a StagedConfig. H200 (bf16, 2^27
# elements): RMSNorm 32K 85.5% of copy, LayerNorm 16K / 32K 80 / 79%, against the tiled kernel's 69 / 58 /
# 60%; 4096 x 8 warps 81-85 / 53-60%, 2048 x 4 warps 76-81 / 59-66%, 4 stages no better (0 to -20 points);
# 8192 x 8 warps (one uncapped program an SM): LayerNorm the same, RMSNorm 32K -1.3.
BWD_STAGED = StagedConfig(slice_cols=8192, warps=16, stages=3)
# Cache hints of the split kernels' loads (EvictHints). H200, none against rows "evict_first" and per-column
# operands "evict_last": no gain, within 1-3% and worse on the softmax backward; the per-column operands'
# evict_last in the chunked quant and layer_norm forward gained nothing either. None shipped.
SPLIT_EVICT = EvictHints(rows="", cols="")
_SPIN_LIMIT = 1 << 20  # polls of a slot (~1 us each: about a second) before a row is given up, poisoned


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
    each slice's columns). ``ok``: see :func:`flydsl_common.device.collect`."""
    if IS_RMS:
        a, ok = collect(base + 2 * p_idx, p_ok, SPIN_LIMIT)  # masked-off slots read 0
        return 0.0, fx.sum(a, axis=0) / N, ok
    _, pairs, pairs_ok = _pair_slots(base, 0, p_idx, p_ok)
    ab, ok = collect(pairs, pairs_ok, SPIN_LIMIT)
    a, b = _unpair(ab)
    mean = fx.sum(a * p_count, axis=0) / N
    dm = fx.where(p_ok, a - mean, 0.0)
    return mean, (fx.sum(b, axis=0) + fx.sum(p_count * dm * dm, axis=0)) / N, ok


@flyc.func
def _exchange_amax(base, part, p_idx, p_ok, amax, live, PARTS_POW2: fx.constexpr, SPIN_LIMIT: fx.constexpr):
    """The quantized forwards' second exchange: this slice's max |y| published (``live``: the row exists),
    the row's returned with its ``ok``. Slots after the (s1, s2) pairs: ``base + 2 * PARTS_POW2 + part``."""
    publish(base + 2 * PARTS_POW2 + part, amax, live)
    amax_p, ok = collect(base + 2 * PARTS_POW2 + p_idx, p_ok, SPIN_LIMIT)
    return fx.max(amax_p, axis=0), ok


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
def _norm_fwd_split_kernel(
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
        if HAS_RESIDUAL:
            h += r_nx.to(fx.float32)
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
            # 4. quantized output: a second exchange, of the slices' |y| maxima.
            if HAS_SMOOTH:
                y = y * fx.load(s_ptr + c, mask=cmask, other=0.0, eviction_policy=COL_EVICT).to(fx.float32)
            amax, ok2 = _exchange_amax(base, part, p_idx, p_ok, fx.max(fx.abs(fx.where(cmask, y, 0.0)), axis=0),
                                       row < M, PARTS_POW2, SPIN_LIMIT)  # fmt: skip
            inv = fx.where(amax > 0, QMAX / fx.where(amax > 0, amax, 1.0), 0.0)  # an all-zero row: q = 0
            if QUANT == 1:
                q = cast_sat_int8(y * inv)
            else:
                q = cast_sat_fp8e4m3(y * inv)
            fx.store(y_ptr + row_offset(row, stride_y) + c, q, mask=cmask)
            # a row given up on (see collect) gets a NaN scale: every value dequantizes to NaN
            fx.store(qs_ptr + row, fx.where(ok & ok2, amax / QMAX, float("nan")), mask=part == 0)
        if STORE_STATS:
            if not IS_RMS:
                fx.store(mean_ptr + row, mean, mask=part == 0)
            fx.store(rstd_ptr + row, rstd, mask=part == 0)


@flyc.kernel(do_not_specialize=["M"])
def _softmax_fwd_split_kernel(
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
def _softmax_bwd_split_kernel(
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
def _norm_bwd_split_kernel(
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
def _norm_bwd_tiled_kernel(
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
def _norm_bwd_staged_kernel(
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
def _norm_fwd_staged_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, slot_ptr, clear_ptr,
    M, N, parts, stride_x, stride_y, eps, weight_offset, clear_n,
    IS_RMS: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_BIAS: fx.constexpr, STORE_STATS: fx.constexpr,
    SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, SPIN_LIMIT: fx.constexpr, STAGES: fx.constexpr,
):
    # fmt: on
    # The split forward for bf16 rows, staged as the backward (_norm_bwd_staged_kernel): the slice of each
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
            mean = fx.sum(sums, axis=0) / N
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


# ---------------------------------------------------------------- host


def _launch_opts(cfg: SliceConfig | TiledConfig, cols: bool = False) -> dict:
    """Triton launch options of a slice or tiled config (warps, register cap), and the cache hints if any."""
    opts = {"num_warps": cfg.warps} if cfg.maxnreg is None else {"num_warps": cfg.warps, "maxnreg": cfg.maxnreg}
    if SPLIT_EVICT.rows:
        opts["ROW_EVICT"] = SPLIT_EVICT.rows
    if cols and SPLIT_EVICT.cols:
        opts["COL_EVICT"] = SPLIT_EVICT.cols
    return opts


def _staged_opts(cfg: StagedConfig) -> dict:
    """Launch options of a staged kernel's config."""
    opts = {"STAGES": cfg.stages, "num_warps": cfg.warps}
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    return opts


def _fwd_slice(n: int) -> SliceConfig:
    """The RMSNorm / softmax forward's slice config for rows of ``n`` columns."""
    return FWD_SLICE_WIDE if n >= WIDE_MIN_N else FWD_SLICE


def split_applies(n: int, min_n: int = SPLIT_MIN_N) -> bool:
    """Whether rows of ``n`` columns take a split path: compiled GPU runs, rows of ``min_n``+ columns."""
    return n >= min_n and not flyc.interpreting()


def _launch_split(kernel, rows, stat_cols, build, slice_cols, device, tile_rows: int = 1,
                  programs: int | None = None, max_parts: int = SPLIT_MAX_PARTS, slots_of=None) -> int:
    """Allocate the rows' slots (zeroed), size one wave and launch. Returns the row groups
    launched, or 0 (nothing launched) when a row has more than ``max_parts`` slices or one wave cannot
    hold them all: the caller then takes its chunked path. A program takes ``tile_rows`` rows at a time.

    ``build(slots, parts, parts_pow2, groups)`` returns the kernel's (args, meta); it is called once
    with ``groups=None`` to size the wave (buffers that depend on the group count may then be any fresh
    fp32 tensor: only dtypes and alignment decide the compiled specialization), then with the count.
    ``programs`` (tests of a wait's give-up path): launch only the wave's first programs. ``slots_of(words)``:
    where the zeroed slots come from (default: a fresh torch.zeros).
    """
    m, n = rows.shape
    parts = flyc.cdiv(n, slice_cols)
    if parts > max_parts:
        return 0
    pp = flyc.next_power_of_2(parts)
    words = m * stat_cols * pp
    zeros = torch.zeros(words, dtype=torch.int64, device=device) if slots_of is None else slots_of(words)
    slots = zeros.view(m, stat_cols * pp)
    args, meta = build(slots, parts, pp, None)
    wave = flyc.programs_per_sm(kernel, *args, **meta) * flydsl.arch.current(device).sm_count
    if wave < parts:
        return 0
    groups = min(flyc.cdiv(m, tile_rows), wave // parts)
    args, meta = build(slots, parts, pp, groups)
    flyc.launch(kernel, (programs or groups * parts,), *args, **meta)
    return groups


@flyc.jit(skip_empty=False)
def launch_fwd_split(
    x2, r2, w, b, s, y2, h2, mean, rstd, qscale, eps, weight_offset, is_rms, quant: int, qmax: float, stream=None
) -> bool:
    """Forward of either norm on [M, N] row views through the split path (False: not launched, see
    :func:`_launch_split`). Operands as :func:`fly_norm._kernels.norm.launch_fwd` (None when absent);
    ``quant`` is its quantization code (0: float y), ``qmax`` the format's largest value.
    """
    if quant == 0 and r2 is None and s is None and _fwd_staged(x2, y2, None if is_rms else (w, b)):
        return x2.shape[0] == 0 or _launch_fwd_staged(x2, w, b, y2, mean, rstd, eps, weight_offset, is_rms)
    cfg = _fwd_slice(x2.shape[1]) if is_rms else LN_FWD_SLICE

    def build(slots, parts, pp, groups):
        m, n = x2.shape
        # fmt: off
        args = (
            x2, r2, w, b, s, y2, h2, mean, rstd, qscale, slots,
            m, n, parts, x2.stride(0), 0 if r2 is None else r2.stride(0), y2.stride(0),
            0 if h2 is None else h2.stride(0), float(eps), float(weight_offset),
        )
        meta = dict(
            IS_RMS=bool(is_rms), HAS_RESIDUAL=r2 is not None, HAS_WEIGHT=w is not None, HAS_BIAS=b is not None,
            HAS_SMOOTH=s is not None, STORE_STATS=rstd is not None, QUANT=quant, QMAX=qmax, SLICE=cfg.slice_cols,
            PARTS_POW2=pp, SPIN_LIMIT=_SPIN_LIMIT, **_launch_opts(cfg, cols=True),
        )
        # fmt: on
        return args, meta

    return x2.shape[0] == 0 or _launch_split(_norm_fwd_split_kernel, x2, 3, build, cfg.slice_cols, x2.device) > 0


# ------------------------------------------------------- pooled slots
#
# A split launch's slots must read 0 (unpublished) when it starts: a fresh torch.zeros buffer is a memset
# launch before the kernel (~0.8 us, and a launch gap of 1-2 us, on the H200). The staged
# kernels take pooled buffers instead, one pool a (device, stream), zeroed again in stream order by a kernel:
#
# - the staged backward, whose launch is always followed by the column sums of its weight gradients: one
#   buffer, which the column-sum kernel zeroes after it (norm.launch_sum_partials' ``clear``). (Zeroing it
#   inside the staged backward itself, before its loop, slowed LayerNorm's by a third: 220 -> 293 us at
#   16K on the H200.)
# - the staged forward, followed by nothing of ours: two buffers taken in turn; each launch zeroes, after
#   its row loop, the words the launch before it dirtied in the other one (``clear_share``), so the next
#   launch finds that one all zeros.
#
# A buffer taken and not yet handed back (another thread on the stream, or an exception between) is not
# lent again: such a launch takes fresh zeros. Under CUDA graph capture (a replay would find the buffers as
# the capture left them) and past the pools' bound: fresh zeros.

_POOL_LOCK = threading.Lock()
_POOLS: dict = {}  # backward: (device, stream) -> _Slots
_FWD_POOLS: dict = {}  # forward: (device, stream) -> _SlotPair
_POOL_STREAMS = 16


class _Slots:
    """The staged backward's buffer on one stream (all zeros when not lent, in stream order)."""

    def __init__(self):
        self.buf = None
        self.lent = False


class _SlotPair:
    """The staged forward's two buffers on one stream: ``bufs[turn]`` is all zeros (in stream order), the
    first ``dirty[1 - turn]`` words of the other were dirtied by the last launch."""

    def __init__(self):
        self.bufs = [None, None]
        self.dirty = [0, 0]
        self.turn = 0
        self.lent = False


def _lendable(pools: dict, device, new):
    """The current stream's entry in ``pools`` (a ``new()`` one where it has none), or None: under CUDA graph
    capture, past the pools' bound, or lent. Called under ``_POOL_LOCK``."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    key = (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    entry = pools.get(key)
    if entry is None:
        if len(pools) >= _POOL_STREAMS:
            return None
        entry = pools[key] = new()
    return None if entry.lent else entry


def _grown(buf, words: int, device):
    """``buf`` when it holds ``words`` words, else a new all-zero buffer (at least twice as large)."""
    if buf is not None and buf.numel() >= words:
        return buf
    return torch.zeros(max(words, 0 if buf is None else 2 * buf.numel()), dtype=torch.int64, device=device)


def take_slots(words: int, device):
    """An all-zero int64 buffer of ``words`` words from the current stream's backward pool, or None (not
    lent: see above). The caller launches a kernel that zeroes the words it dirtied, then
    :func:`give_back_slots`."""
    device = torch.device(device)
    with _POOL_LOCK:
        entry = _lendable(_POOLS, device, _Slots)
        if entry is None:
            return None
        entry.buf = _grown(entry.buf, words, device)
        entry.lent = True
        return entry.buf[:words]


def give_back_slots(slots) -> None:
    """Hand a :func:`take_slots` buffer back once the kernel that zeroes it is launched."""
    with _POOL_LOCK:
        for entry in _POOLS.values():
            if entry.lent and entry.buf.data_ptr() == slots.data_ptr():
                entry.lent = False


def take_fwd_slots(words: int, device):
    """(slots, clear) from the current stream's forward pool: ``slots`` an all-zero int64 buffer of ``words``
    words, ``clear`` the other buffer's dirtied words, which the launch must zero; or None (not lent: see
    above). Then :func:`give_back_fwd_slots`."""
    device = torch.device(device)
    with _POOL_LOCK:
        pair = _lendable(_FWD_POOLS, device, _SlotPair)
        if pair is None:
            return None
        i = pair.turn
        pair.bufs[i] = _grown(pair.bufs[i], words, device)
        other = pair.bufs[1 - i]
        pair.lent = True
        return pair.bufs[i][:words], pair.bufs[i][:0] if other is None else other[: pair.dirty[1 - i]]


def give_back_fwd_slots(slots, launched: bool) -> None:
    """Hand a :func:`take_fwd_slots` buffer back; ``launched``: the kernel was launched (it dirtied the
    buffer's ``slots.numel()`` words and zeroed the other's), so the next launch takes the other buffer."""
    with _POOL_LOCK:
        for pair in _FWD_POOLS.values():
            i = pair.turn
            if pair.lent and pair.bufs[i].data_ptr() == slots.data_ptr():
                pair.lent = False
                if launched:
                    pair.dirty[i], pair.dirty[1 - i], pair.turn = slots.numel(), 0, 1 - i


def _fwd_staged(x2, y2, packed=None) -> bool:
    """Whether a plain norm forward's rows take the staged kernel: bf16, FWD_STAGED_MIN_N+ columns, word
    aligned, where a program may take the stages' shared memory (FWD_STAGED None: never). ``packed``: the
    per-column operands the kernel holds as words (LayerNorm's weight and bias), each None or bf16 and word
    aligned."""
    if FWD_STAGED is None or x2.shape[1] < FWD_STAGED_MIN_N:
        return False
    if not (x2.dtype == y2.dtype == torch.bfloat16 and word_aligned(x2, y2)):
        return False
    vectors = [v for v in packed or () if v is not None]
    if not all(v.dtype == torch.bfloat16 for v in vectors) or not word_aligned(*vectors):
        return False
    return stages_fit(x2.device, FWD_STAGED.stages, 2 * FWD_STAGED.slice_cols)


def _launch_fwd_staged(x2, w, b, y2, mean, rstd, eps, weight_offset, is_rms) -> bool:
    """The staged norm forward through :func:`_launch_split` (False: not launched)."""
    cfg = FWD_STAGED
    # RMSNorm adds its offset always (as measured on the H200); LayerNorm only a nonzero one (an add an element less)
    offset = float(weight_offset) if is_rms or weight_offset else None

    taken: dict = {}  # "pooled": the slots lent by the pool; "clear": the words this launch zeroes
    pdl = pdl_options(x2.device)  # once a call: build runs twice

    def slots_of(words):
        got = take_fwd_slots(words, x2.device)
        if got is None:  # fresh zeros, nothing to zero
            slots = torch.zeros(words, dtype=torch.int64, device=x2.device)
            taken["clear"] = slots[:0]
            return slots
        taken["pooled"], taken["clear"] = got
        return got[0]

    def build(slots, parts, pp, groups):
        m, n = x2.shape
        clear = taken["clear"]
        args = (x2, w, b, y2, mean, rstd, slots, clear, m, n, parts, x2.stride(0), y2.stride(0), float(eps), offset,
                clear.numel())  # fmt: skip
        meta = dict(IS_RMS=bool(is_rms), HAS_WEIGHT=w is not None, HAS_BIAS=b is not None,
                    STORE_STATS=rstd is not None, SLICE=cfg.slice_cols, PARTS_POW2=pp, SPIN_LIMIT=_SPIN_LIMIT,
                    STAGES=cfg.stages, num_warps=cfg.warps, **pdl)  # fmt: skip
        return args, meta

    launched = False
    try:
        launched = _launch_split(_norm_fwd_staged_kernel, x2, 1, build, cfg.slice_cols, x2.device,
                                 slots_of=slots_of) > 0
    finally:
        if "pooled" in taken:
            give_back_fwd_slots(taken["pooled"], launched)
    return launched


def launch_softmax_fwd_split(x2, y2) -> bool:
    """Softmax forward on [M, N] row views through the split path (False: not launched). No checks. (Wide bf16
    rows on NVIDIA take :mod:`fly_norm._kernels.resident` first.)"""
    cfg = _fwd_slice(x2.shape[1])

    def build(slots, parts, pp, groups):
        m, n = x2.shape
        args = (x2, y2, slots, m, n, parts, x2.stride(0), y2.stride(0))
        return args, dict(SLICE=cfg.slice_cols, PARTS_POW2=pp, SPIN_LIMIT=_SPIN_LIMIT, **_launch_opts(cfg))

    return x2.shape[0] == 0 or _launch_split(_softmax_fwd_split_kernel, x2, 2, build, cfg.slice_cols, x2.device) > 0


def launch_softmax_bwd_split(dy2, y2, dx2) -> bool:
    """Softmax backward on [M, N] row views through the split path (False: not launched). No checks."""

    cfg = SOFTMAX_BWD_SLICE_WIDE if y2.shape[1] >= SOFTMAX_BWD_WIDE_MIN_N else SOFTMAX_BWD_SLICE

    def build(slots, parts, pp, groups):
        m, n = y2.shape
        args = (dy2, y2, dx2, slots, m, n, parts, dy2.stride(0), y2.stride(0), dx2.stride(0))
        lanes = slot_lanes(pp, cfg.warps, flydsl.arch.current(y2.device).warp_size)
        return args, dict(SLICE=cfg.slice_cols, PARTS_POW2=pp, SPIN_LIMIT=_SPIN_LIMIT, LANES=lanes, **_launch_opts(cfg))

    return y2.shape[0] == 0 or _launch_split(_softmax_bwd_split_kernel, y2, 1, build, cfg.slice_cols, y2.device,
                                             max_parts=SOFTMAX_BWD_MAX_PARTS) > 0  # fmt: skip


def _staged(h2, dy2, dres2, dx2) -> bool:
    """Whether the split backward runs staged (:func:`_norm_bwd_staged_kernel`): bf16 rows (and residual
    gradient) of even widths and strides on 4-byte boundaries, where a program may take the stages' shared
    memory (BWD_STAGED None: never)."""
    rows = [t for t in (h2, dy2, dres2, dx2) if t is not None]
    if BWD_STAGED is None or not (all(t.dtype == torch.bfloat16 for t in rows) and word_aligned(*rows)):
        return False
    return stages_fit(h2.device, BWD_STAGED.stages, 2 * BWD_STAGED.slice_cols * (len(rows) - 1))  # the rows it loads


@flyc.jit(skip_empty=False)
def launch_bwd_split(
    h2, w, dy2, dres2, mean, rstd, dx2, need_dw, need_db, weight_offset, is_rms, stream=None, pooled=False
):  # fmt: skip
    """Backward of either norm on [M, N] row views through the split path: writes dx2 and returns the
    [groups, N] fp32 weight-gradient partials (dw, db; None where not needed) for the caller's column sum,
    or None when nothing was launched (see :func:`_launch_split`). ``M > 0``. ``pooled`` (the caller's
    column sum zeroes the slots): the staged kernel's slots from :func:`take_slots`, and a third value
    returned, that buffer (None: fresh slots), which the caller's column-sum launch zeroes before it calls
    :func:`give_back_slots`.
    """
    partials: dict = {}
    lent: list = []

    def slots_of(words):
        buf = take_slots(words, h2.device) if pooled and staged and (need_dw or need_db) else None
        if buf is None:
            return torch.zeros(words, dtype=torch.int64, device=h2.device)
        lent.append(buf)
        return buf

    def build(slots, parts, pp, groups):
        m, n = h2.shape
        if groups is None:
            dwp = dbp = slots.view(torch.float32)  # sizing the wave: any fp32 buffer keys the same specialization
        else:
            dev = h2.device
            dwp = partials["dw"] = torch.empty(groups, n, dtype=torch.float32, device=dev) if need_dw else None
            dbp = partials["db"] = torch.empty(groups, n, dtype=torch.float32, device=dev) if need_db else None
        # fmt: off
        args = (
            h2, w, dy2, dres2, mean, rstd, dx2, dwp if need_dw else None, dbp if need_db else None, slots,
            m, n, parts, h2.stride(0), dy2.stride(0), 0 if dres2 is None else dres2.stride(0), dx2.stride(0),
            float(weight_offset),
        )
        meta = dict(
            IS_RMS=bool(is_rms), HAS_WEIGHT=w is not None, HAS_DRES=dres2 is not None, COMPUTE_DW=need_dw,
            COMPUTE_DB=need_db, SLICE=cfg.slice_cols, PARTS_POW2=pp, SPIN_LIMIT=_SPIN_LIMIT,
            **(_staged_opts(cfg) if staged else _launch_opts(cfg)),
            **({"PAIR": pair} if staged else {}),
            **({"ROWS": tile_rows} if tiled or tile_rows > 1 else {}),
            **({"LEAD": cfg.lead} if tiled else {}),
        )
        # fmt: on
        return args, meta

    staged = _staged(h2, dy2, dres2, dx2)
    tiled_cfg = BWD_TILED if is_rms else LN_BWD_TILED
    tiled = tiled_cfg is not None and not staged
    cfg = BWD_STAGED if staged else tiled_cfg if tiled else BWD_SLICE
    tile_rows = tiled_cfg.tile_rows if tiled else (BWD_ROWS if is_rms and not staged else 1)
    kernel = _norm_bwd_staged_kernel if staged else _norm_bwd_tiled_kernel if tiled else _norm_bwd_split_kernel
    # the staged kernel's LayerNorm PAIR form only without a residual gradient (with one it spills: 69% of copy
    # against 92%); it and RMSNorm's staged kernel take one slot a slice, the rest two
    pair = dres2 is None
    one_slot = staged and (is_rms or pair)
    if not _launch_split(kernel, h2, 1 if one_slot else 2, build, cfg.slice_cols, h2.device, tile_rows,
                         slots_of=slots_of):
        for buf in lent:  # nothing launched: the buffer is still all zeros
            give_back_slots(buf)
        return None
    out = partials.get("dw"), partials.get("db")
    return (*out, lent[0] if lent else None) if pooled else out
