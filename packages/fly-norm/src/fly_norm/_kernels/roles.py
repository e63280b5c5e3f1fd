"""The norm backward for wide rows in two roles, with no exchange between programs.

The backward's two outputs need the rows in two different ways:

- dx needs each row's statistics c1 = mean(g * xhat), c2 = mean(g) (g = dy * w), reduced over the
  whole row;
- dweight and dbias (sum over the rows of dy * xhat and of dy) need nothing but the rows themselves
  and the forward's saved mean and rstd, but a running sum a column, which past 8K columns a program
  that owns whole rows cannot hold in registers.

The split kernels (:mod:`.split`) give each program a column slice and exchange the row statistics
between the slices; their pace is set by that exchange (PERF.md v7, v11). Here each program of one
resident wave does both, one after the other, every iteration: the dx of one whole row (its chunks
twice: the statistics, then dx, the second read from L2), then its share of the dweight/dbias sums for
the rows the wave's programs are doing in that iteration, over one column slice that the program owns
for the whole launch (so its sums stay in registers). The two parts of an iteration read the same
rows, so whichever comes second finds them in L2: every element is read from memory once. No program
ever waits for another.

Programs: ``parts`` column slices x ``groups`` (so ``parts * groups`` rows an iteration). Program
``pid`` = (group, slice) = (pid // parts, pid % parts): the dx of row ``it * P + pid``; the sums of rows
``it * P + group + groups * j`` (j < parts) over its slice's columns. Those cover each (row, slice)
of the iteration once. The weight-gradient partials are [groups, N] fp32, summed over the groups by
the caller.
"""

from __future__ import annotations

import torch

import flydsl
import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset, sum2_f32

from .affine import input_grad, load_bwd_rows, load_weight

__all__ = ["ROUTED", "ROLES_CONFIG", "launch_bwd_roles"]

# Whether the norm backward past SPLIT_MIN_N_BWD columns takes this kernel instead of the split one
# (norm.backward_into), and its config: (dx chunk columns, slice columns, rows a sums step, warps,
# register cap or None). Not measured yet: not routed.
ROUTED = False
ROLES_CONFIG = (4096, 2048, 4, 16, None)
# Chunked rows unroll with the width fixed (passes.row_meta's N_FIXED) up to this width.
_FIXED_MAX_N = 65536


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _norm_bwd_roles_kernel(
    h_ptr, w_ptr, dy_ptr, dres_ptr, mean_ptr, rstd_ptr,   # inputs (None when absent)
    dx_ptr, dwp_ptr, dbp_ptr,                             # dx, [groups, N] weight-gradient partials
    M, N, parts, stride_h, stride_dy, stride_dres, stride_dx, weight_offset,
    IS_RMS: fx.constexpr, HAS_WEIGHT: fx.constexpr, HAS_DRES: fx.constexpr, COMPUTE_DW: fx.constexpr,
    COMPUTE_DB: fx.constexpr, CHUNK: fx.constexpr, SLICE: fx.constexpr, SUM_ROWS: fx.constexpr,
    N_FIXED: fx.constexpr,
):
    # fmt: on
    if N_FIXED != 0:
        N = N_FIXED  # a compile-time width: the chunk loops unroll
    pid = fx.program_id(0)
    programs = fx.num_programs(0)
    groups = programs // parts
    group = pid // parts
    c = fx.arange(0, CHUNK)
    sc = (pid % parts) * SLICE + fx.arange(0, SLICE)  # this program's slice of the sums
    smask = sc < N
    j = fx.arange(0, SUM_ROWS)
    dw = fx.zeros([SUM_ROWS, SLICE], dtype=fx.float32)
    db = fx.zeros([SUM_ROWS, SLICE], dtype=fx.float32)
    for it in range(0, fx.cdiv(M, programs)):
        # 1. dx of one row: its statistics over the chunks (read from memory, kept in L2), then dx (from L2)
        r1 = it * programs + pid + fx.arange(0, 1)  # a [1] block: int64 offsets on tensors
        ok = r1 < M
        h_row = h_ptr + row_offset(r1, stride_h)[:, None]
        dy_row = dy_ptr + row_offset(r1, stride_dy)[:, None]
        rstd = fx.load(rstd_ptr + r1, mask=ok, other=0.0)
        if IS_RMS:
            mean = fx.zeros_like(rstd)
        else:
            mean = fx.load(mean_ptr + r1, mask=ok, other=0.0)
        s1 = fx.zeros([1, CHUNK], dtype=fx.float32)
        s2 = fx.zeros([1, CHUNK], dtype=fx.float32)
        for start in range(0, N, CHUNK):
            cc = start + c
            m2 = ok[:, None] & (cc < N)[None, :]
            h = fx.load(h_row + cc[None, :], mask=m2, other=0.0, eviction_policy="evict_last").to(fx.float32)
            dy = fx.load(dy_row + cc[None, :], mask=m2, other=0.0, eviction_policy="evict_last").to(fx.float32)
            g = dy * load_weight(w_ptr, cc, cc < N, weight_offset, HAS_WEIGHT, "evict_last")[None, :]
            s1 += g * (h - mean[:, None]) * rstd[:, None]  # masked columns: g = 0
            s2 += g
        if IS_RMS:
            c1 = fx.sum(s1, axis=1) / N
            c2 = c1  # unused
        else:
            c1, c2 = sum2_f32(s1, s2, 1)  # one exchange between warps for both
            c1 = c1 / N
            c2 = c2 / N
        for start in range(0, N, CHUNK):
            cc = start + c
            m2 = ok[:, None] & (cc < N)[None, :]
            h = fx.load(h_row + cc[None, :], mask=m2, other=0.0).to(fx.float32)
            dy = fx.load(dy_row + cc[None, :], mask=m2, other=0.0).to(fx.float32)
            w = load_weight(w_ptr, cc, cc < N, weight_offset, HAS_WEIGHT, "evict_last")[None, :]
            dx = input_grad(h, dy, w, mean, rstd, c1, c2, IS_RMS)
            if HAS_DRES:
                dx += fx.load(dres_ptr + row_offset(r1, stride_dres)[:, None] + cc[None, :], mask=m2,
                              other=0.0).to(fx.float32)  # fmt: skip
            fx.store(dx_ptr + row_offset(r1, stride_dx)[:, None] + cc[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=m2)  # fmt: skip
        # 2. this program's share of the iteration's weight-gradient sums: rows it * P + group + groups * j
        if COMPUTE_DW or COMPUTE_DB:
            for j0 in range(0, parts, SUM_ROWS):
                rows = it * programs + group + groups * (j0 + j)
                rows = fx.where(j0 + j < parts, rows, M)  # past the iteration's rows: masked (row M)
                # (names of their own: the loop-carried values of part 1 keep their [1]-row shapes)
                hs, dys, rstds, means = load_bwd_rows(h_ptr, dy_ptr, mean_ptr, rstd_ptr, rows, M, sc, smask,
                                                      stride_h, stride_dy, IS_RMS, "evict_first")  # fmt: skip
                dyf = dys.to(fx.float32)
                if COMPUTE_DW:
                    dw += dyf * ((hs.to(fx.float32) - means[:, None]) * rstds[:, None])  # masked: dy = 0
                if COMPUTE_DB:
                    db += dyf
    if COMPUTE_DW:
        fx.store(dwp_ptr + row_offset(group, N) + sc, fx.sum(dw, axis=0), mask=smask)
    if COMPUTE_DB:
        fx.store(dbp_ptr + row_offset(group, N) + sc, fx.sum(db, axis=0), mask=smask)


def _call(h2, w, dy2, dres2, mean, rstd, dx2, dwp, dbp, parts, weight_offset, is_rms, cfg):
    """(args, meta) of the kernel; absent operands go as None."""
    m, n = h2.shape
    # fmt: off
    args = (
        h2, w, dy2, dres2, mean, rstd, dx2, dwp, dbp,
        m, n, parts, h2.stride(0), dy2.stride(0), 0 if dres2 is None else dres2.stride(0), dx2.stride(0),
        float(weight_offset),
    )
    meta = dict(
        IS_RMS=bool(is_rms), HAS_WEIGHT=w is not None, HAS_DRES=dres2 is not None, COMPUTE_DW=dwp is not None,
        COMPUTE_DB=dbp is not None, CHUNK=cfg[0], SLICE=cfg[1], SUM_ROWS=cfg[2],
        N_FIXED=n if n <= _FIXED_MAX_N else 0, num_warps=cfg[3], **({} if cfg[4] is None else {"maxnreg": cfg[4]}),
    )
    # fmt: on
    return args, meta


def launch_bwd_roles(h2, w, dy2, dres2, mean, rstd, dx2, need_dw, need_db, weight_offset, is_rms, cfg=None):
    """Backward of either norm on [M, N] row views (``M > 0``) through the two-role kernel: writes dx2 and
    returns the [groups, N] fp32 weight-gradient partials (dw, db; None where not needed) for the caller's
    column sum. One resident wave: ``parts`` slices x as many groups as fit."""
    cfg = cfg or ROLES_CONFIG
    m, n = h2.shape
    parts = flyc.cdiv(n, cfg[1])
    dev = h2.device
    part = rstd  # sizing the wave: any fp32 buffer keys the same specialization as the partials
    args, meta = _call(h2, w, dy2, dres2, mean, rstd, dx2, part if need_dw else None, part if need_db else None,
                       parts, weight_offset, is_rms, cfg)  # fmt: skip
    wave = flyc.programs_per_sm(_norm_bwd_roles_kernel, *args, **meta) * flydsl.arch.current(dev).sm_count
    groups = max(1, min(wave // parts, flyc.cdiv(m, parts)))
    dwp = torch.empty(groups, n, dtype=torch.float32, device=dev) if need_dw else None
    dbp = torch.empty(groups, n, dtype=torch.float32, device=dev) if need_db else None
    args, meta = _call(h2, w, dy2, dres2, mean, rstd, dx2, dwp, dbp, parts, weight_offset, is_rms, cfg)
    flyc.launch(_norm_bwd_roles_kernel, (groups * parts,), *args, **meta)
    return dwp, dbp
