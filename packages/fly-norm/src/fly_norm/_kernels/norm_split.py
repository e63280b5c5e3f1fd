"""RMSNorm / LayerNorm forward for rows too wide for one program: each row is split over several programs.

A row of N columns is cut into ``parts`` slices of SLICE columns (the last
may be short). The grid is one resident wave of ``groups * parts`` programs;
program ``pid`` always works on slice ``pid % parts`` of the rows ``group,
group + groups, ...`` (``group = pid // parts``). For each of its rows a
program

1. turns its slice, already in registers, into h = x (+ residual) and the
   slice's statistics (RMSNorm: the sum of squares; LayerNorm: the slice's
   mean and M2), stores them to ``part[row]`` and counts itself in at the
   row's arrival counter;
2. loads the slice of its next row (a prefetch: those loads are in flight
   while it waits);
3. waits until every program of the row has arrived, merges the partial
   statistics (LayerNorm: Chan's parallel formula, exact in fp32 and free of
   E[h^2] - E[h]^2 cancellation) and writes its slice of y from registers.

Every element is read once and written once: the copy's floor, where the
chunked path of :mod:`fly_norm._kernels.norm` reads each row twice (and the
second read misses L2 once 132 rows of 128 KB+ are in flight).

The waits need every program of a row to be running at once: the grid never
exceeds one wave (:func:`flydsl.compiler.programs_per_sm`). A wait that does
not end within SPIN_LIMIT polls poisons its row with NaN instead of hanging
the GPU. The interpreter runs programs one at a time, so there this path is
never used (:func:`split_applies`).
"""

from __future__ import annotations

import torch

import flydsl.arch
import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import arrive, row_offset, wait_count

__all__ = ["SPLIT_MIN_N", "split_applies", "launch_fwd_split"]

SPLIT_MIN_N = 32768  # rows at least this wide take the split path on a GPU
_SLICE = 16384  # columns a program holds: 16 warps x 32 threads x 32 elements
_WARPS = 16
_SPIN_LIMIT = 1 << 20  # polls of a counter (~1 us each: about a second) before a row is given up, poisoned


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _norm_fwd_split_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr,              # inputs (None when absent)
    y_ptr, h_ptr, mean_ptr, rstd_ptr,        # outputs (None when not wanted)
    part_ptr, cnt_ptr,                       # fp32 [M, 2 * PARTS_POW2] slice statistics, int32 [M] arrivals (zeroed)
    M, N, parts, stride_x, stride_r, stride_y, stride_h, eps, weight_offset,
    IS_RMS: fx.constexpr, HAS_RESIDUAL: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_BIAS: fx.constexpr,
    STORE_STATS: fx.constexpr, SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, SPIN_LIMIT: fx.constexpr,
):
    # fmt: on
    pid = fx.program_id(0)
    groups = fx.num_programs(0) // parts
    part = pid % parts
    group = pid // parts
    c = part * SLICE + fx.arange(0, SLICE)
    cmask = c < N
    n_here = fx.minimum(N - part * SLICE, SLICE) * 1.0  # elements of this slice
    p_idx = fx.arange(0, PARTS_POW2)
    p_ok = p_idx < parts
    p_count = fx.where(p_ok, fx.minimum(N - p_idx * SLICE, SLICE) * 1.0, 0.0)

    x_nx = fx.load(x_ptr + row_offset(group, stride_x) + c, mask=cmask & (group < M), other=0.0)
    if HAS_RESIDUAL:
        r_nx = fx.load(r_ptr + row_offset(group, stride_r) + c, mask=cmask & (group < M), other=0.0)
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
        base = part_ptr + row_offset(row, 2 * PARTS_POW2)
        fx.store(base + part, s1)
        fx.store(base + PARTS_POW2 + part, s2)
        arrive(cnt_ptr + row)
        # 2. the next row's slice, in flight during the wait
        nxt = row + groups
        x_nx = fx.load(x_ptr + row_offset(nxt, stride_x) + c, mask=cmask & (nxt < M), other=0.0)
        if HAS_RESIDUAL:
            r_nx = fx.load(r_ptr + row_offset(nxt, stride_r) + c, mask=cmask & (nxt < M), other=0.0)
        # 3. the row's statistics from every slice, then y
        ok = wait_count(cnt_ptr + row, parts, SPIN_LIMIT)
        a = fx.load(base + p_idx, mask=p_ok, other=0.0, cache_modifier=".cg")
        if IS_RMS:
            mean = 0.0
            var = fx.sum(a, axis=0) / N
        else:
            b = fx.load(base + PARTS_POW2 + p_idx, mask=p_ok, other=0.0, cache_modifier=".cg")
            mean = fx.sum(a * p_count, axis=0) / N
            dm = fx.where(p_ok, a - mean, 0.0)
            var = (fx.sum(b, axis=0) + fx.sum(p_count * dm * dm, axis=0)) / N
        rstd = fx.where(ok, fx.rsqrt(var + eps), float("nan"))
        y = (h - mean) * rstd
        if HAS_WEIGHT:
            y = y * (fx.load(w_ptr + c, mask=cmask, other=0.0).to(fx.float32) + weight_offset)
        if HAS_BIAS:
            y = y + fx.load(b_ptr + c, mask=cmask, other=0.0).to(fx.float32)
        fx.store(y_ptr + row_offset(row, stride_y) + c, y.to(y_ptr.dtype.element_ty), mask=cmask)
        if STORE_STATS:
            if not IS_RMS:
                fx.store(mean_ptr + row, mean, mask=part == 0)
            fx.store(rstd_ptr + row, rstd, mask=part == 0)


def split_applies(n: int, quantized: bool = False) -> bool:
    """Whether rows of ``n`` columns take the split path: compiled GPU runs, wide rows, float output."""
    return n >= SPLIT_MIN_N and not quantized and not flyc.interpreting()


def _call(x2, r2, w, b, y2, h2, mean, rstd, part, cnt, parts, eps, weight_offset, is_rms):
    m, n = x2.shape
    # fmt: off
    args = (
        x2, r2, w, b, y2, h2, mean, rstd, part, cnt,
        m, n, parts, x2.stride(0), 0 if r2 is None else r2.stride(0), y2.stride(0),
        0 if h2 is None else h2.stride(0), float(eps), float(weight_offset),
    )
    meta = dict(
        IS_RMS=bool(is_rms), HAS_RESIDUAL=r2 is not None, HAS_WEIGHT=w is not None, HAS_BIAS=b is not None,
        STORE_STATS=rstd is not None, SLICE=_SLICE, PARTS_POW2=flyc.next_power_of_2(parts),
        SPIN_LIMIT=_SPIN_LIMIT, num_warps=_WARPS,
    )
    # fmt: on
    return args, meta


@flyc.jit(skip_empty=False)
def launch_fwd_split(x2, r2, w, b, y2, h2, mean, rstd, eps, weight_offset, is_rms, stream=None) -> bool:
    """Forward of either norm on [M, N] row views through the split path; False (nothing launched) when
    one wave cannot hold all the slices of a row (N past ~2M columns): the caller takes the chunked path.

    Operands as :func:`fly_norm._kernels.norm.launch_fwd` (None when absent); no quantized output.
    """
    m, n = x2.shape
    if m == 0:
        return True
    parts = flyc.cdiv(n, _SLICE)
    pp = flyc.next_power_of_2(parts)
    part = torch.empty(m, 2 * pp, dtype=torch.float32, device=x2.device)
    cnt = torch.zeros(m, dtype=torch.int32, device=x2.device)
    args, meta = _call(x2, r2, w, b, y2, h2, mean, rstd, part, cnt, parts, eps, weight_offset, is_rms)
    wave = flyc.programs_per_sm(_norm_fwd_split_kernel, *args, **meta) * flydsl.arch.current(x2.device).sm_count
    if wave < parts:
        return False
    groups = min(m, wave // parts)
    flyc.launch(_norm_fwd_split_kernel, (groups * parts,), *args, **meta)
    return True
