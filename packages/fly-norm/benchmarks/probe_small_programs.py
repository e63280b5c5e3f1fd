"""Probe: the norms' wide forward and their 16K-32K backward as many small resident programs an SM.

    python benchmarks/probe_small_programs.py --compile              (offline sm_90: registers, shared memory)
    python benchmarks/probe_small_programs.py --out DIR              (GPU: check against fp64, then time)

v19 found the resident softmax fastest as five 4-warp programs an SM with 16K-column slices (88-91% of the
copy from 64K to 1M) where one 16-warp program an SM with 64K slices ran 75-86%. The eighteenth session's
resident probes of the norms' forward and backward (commit 2aef40d, measured in v19: far behind the shipped
kernels) used one program an SM. Here the same two kernels, a program's slice of each row in a ring of
``cp.async`` chunks, sized as the shipped split paths size their waves (``split._launch_split``: the programs an
SM the compiled kernel allows), with small programs:

forward (``CHUNK:CHUNKS:RING:WARPS:WB``): a slice of CHUNKS chunks of CHUNK words; the weight and bias held
as words in registers, loaded once (WB 1, one chunk a slice) or loaded from global memory (L1 / L2) for
every row (WB 2). Pass 1 sums x and x^2 as the chunks land (M2 about the slice's mean again where the sums
cancel), one word a slice published, Chan's merge; pass 2 writes y = (x - mean) * (rstd * w) + b.

backward (``CHUNK:RING:WARPS``): a slice of one chunk of x and one of dy a row, RING / 2 rows in flight; the
weight and the columns' dw / db sums in registers, [groups, N] partials at the end.

Prediction (written before the first run): forward layer_norm 128K / 256K from 84 / 82% (shipped staged) to
86-89% for 2048:1:4:4:1 (4096-column slices, four or five programs an SM, 32-64 slices a row) and 8192:1
alike; WB 2 1-3 points under WB 1 (the weight and bias through L1 / L2 every row). Backward layer_norm
16K / 32K from 79 / 77% to 82-87% for 1024:8:4 and 1024:12:4 (2048-column slices, 8-16 a row); 2048:8:8
between.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--compile" in sys.argv:
    os.environ.setdefault("FLYDSL_INTERPRET", "0")  # compile for the GPU target on a machine without one

import torch

import flydsl  # noqa: E402, F401 - choose compiled vs interpreted Triton first
import flydsl.compiler as flyc
import flydsl.gexpr as gx
from fly_norm._kernels.passes import word_aligned
from fly_norm._kernels.resident import _issue, chunk_words
from fly_norm._kernels.split import _SPIN_LIMIT, _launch_split
from flydsl_common.device import (
    bf16_pairs,
    bf16_words,
    collect_from,
    collect_pairs_from,
    publish,
    publish_pair,
    sum2_f32,
)


@flyc.gluon_kernel
def _all_sum2(a, b):
    """Sums of two [REPS, THREADS, 4] blocks over the program: the threads' own elements first, one exchange."""
    a, b = sum2_f32(a, b, 2)
    a, b = sum2_f32(a, b, 0)
    return sum2_f32(a, b, 0)


# ---------------------------------------------------------------- forward


@flyc.gluon_kernel(do_not_specialize=["M", "groups"])
def _norm_fwd_small_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, slot_ptr, M, N, P, groups, stride_x, stride_y, eps,
    CHUNK: gx.constexpr, CHUNKS: gx.constexpr, RING: gx.constexpr, WARPS: gx.constexpr, PP: gx.constexpr,
    WB: gx.constexpr, SPIN_LIMIT: gx.constexpr, IS_RMS: gx.constexpr,
):  # fmt: skip
    THREADS: gx.constexpr = 32 * WARPS
    REPS: gx.constexpr = CHUNK // (4 * THREADS)
    layout: gx.constexpr = gx.BlockedLayout([1, 1, 4], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
    ring = gx.allocate_shared_memory(gx.int32, [RING, REPS, THREADS, 4], gx.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    cols = chunk_words(REPS, THREADS, layout)
    xw_ptr = x_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    yw_ptr = y_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    ww_ptr = w_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    bw_ptr = b_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    W = N // 2
    stride_xw = stride_x // 2
    pid = gx.program_id(0)
    part = pid % P
    group = pid // P
    col0 = part * (CHUNKS * CHUNK)
    if WB == 1:  # one chunk a slice: its weight and bias words held in registers
        ww = gx.load(ww_ptr + col0 + cols, mask=col0 + cols < W, other=0)
        bw = ww if IS_RMS else gx.load(bw_ptr + col0 + cols, mask=col0 + cols < W, other=0)
    n_mine = gx.minimum(W - col0, CHUNKS * CHUNK) * 2.0  # the slice's columns
    k = gx.arange(0, PP, layout=gx.BlockedLayout([1], [32], [WARPS], [0]))
    n_k = gx.maximum(gx.minimum(W - k * (CHUNKS * CHUNK), CHUNKS * CHUNK), 1) * 2.0  # each slice's columns
    kmask = k < P
    for t in gx.static_range(RING):
        _issue(ring, xw_ptr, t, group, groups, col0, M, W, stride_xw, cols, CHUNK, CHUNKS, RING)
    for it in range(gx.cdiv(M - group, groups)):
        row = group + it * groups
        base = it * CHUNKS
        # pass 1, each chunk as it lands (issued so far: base + RING); masked columns read 0
        s1 = gx.zeros(cols.shape, gx.float32, layout)
        s2 = gx.zeros(cols.shape, gx.float32, layout)
        for j in gx.static_range(CHUNKS):
            gx.async_copy.wait_group(RING - 1 - j)
            gx.thread_barrier()
            xe, xo = bf16_pairs(ring.index((base + j) % RING).load(layout))
            s1 += xe + xo
            s2 += xe * xe + xo * xo
        t1, t2 = _all_sum2(s1, s2)
        if IS_RMS:
            if PP > 1:
                publish(slot_ptr + row.to(gx.int64) * PP + part, t2, row < M)
                t2 = gx.sum(collect_from((k * 0).to(gx.int64), slot_ptr + row.to(gx.int64) * PP + k, kmask,
                                         SPIN_LIMIT), axis=0)  # fmt: skip
            mean = 0.0
            rstd = gx.rsqrt(t2 / N + eps)
        else:
            m_mine = t1 / n_mine
            m2 = t2 - t1 * m_mine
            if m2 * 64.0 < t2:  # cancellation: M2 about the slice's mean again, from the chunks held
                acc = gx.zeros(cols.shape, gx.float32, layout)
                for j in gx.static_range(CHUNKS):
                    xe, xo = bf16_pairs(ring.index((base + j) % RING).load(layout))
                    ok = col0 + j * CHUNK + cols < W
                    de = gx.where(ok, xe - m_mine, 0.0)
                    do = gx.where(ok, xo - m_mine, 0.0)
                    acc += de * de + do * do
                m2 = gx.sum(gx.sum(gx.sum(acc, axis=2), axis=0), axis=0)
            if PP > 1:
                publish_pair(slot_ptr + row.to(gx.int64) * PP + part, t1, m2, row < M)
                sums, m2s = collect_pairs_from((k * 0).to(gx.int64), slot_ptr + row.to(gx.int64) * PP + k, kmask,
                                               SPIN_LIMIT)  # fmt: skip
                mean = gx.sum(sums, axis=0) / N
                dev = gx.where(kmask, sums / n_k - mean, 0.0)
                m2, spread = sum2_f32(m2s, n_k * dev * dev, 0)  # Chan: the slices' M2s and their means' spread
                m2 = m2 + spread
            else:
                mean = m_mine
            rstd = gx.rsqrt(m2 / N + eps)
            gx.store(mean_ptr + row, mean, mask=(part == 0) & (row < M))
        gx.store(rstd_ptr + row, rstd, mask=(part == 0) & (row < M))
        # pass 2: y from the chunks, each slot refilled once every thread has read it
        yrow = yw_ptr + row.to(gx.int64) * (stride_y // 2)
        for j in gx.static_range(CHUNKS):
            c = col0 + j * CHUNK + cols
            xe, xo = bf16_pairs(ring.index((base + j) % RING).load(layout))
            if WB == 2:
                ww = gx.load(ww_ptr + c, mask=c < W, other=0)
                bw = ww if IS_RMS else gx.load(bw_ptr + c, mask=c < W, other=0)
            we, wo = bf16_pairs(ww)
            if IS_RMS:
                ye = xe * (rstd * we)
                yo = xo * (rstd * wo)
            else:
                be, bo = bf16_pairs(bw)
                ye = gx.fma(xe - mean, we * rstd, be)
                yo = gx.fma(xo - mean, wo * rstd, bo)
            gx.store(yrow + c, bf16_words(ye, yo), mask=c < W)
            gx.thread_barrier()
            _issue(ring, xw_ptr, base + j + RING, group, groups, col0, M, W, stride_xw, cols, CHUNK, CHUNKS, RING)
    gx.async_copy.wait_group(0)


def _out(like, poison, *shape, dtype=None):
    """A fresh output: NaN throughout for the checks, uninitialized for the timing."""
    shape = shape or like.shape
    t = torch.empty(shape, dtype=dtype or like.dtype, device=like.device)
    return t.fill_(float("nan")) if poison else t


def launch_fwd(x, w, b, eps, is_rms, cfg, poison=True):
    """(y, mean, rstd) of bf16 rows [M, N] (word aligned) through one wave of the small-program forward."""
    chunk, chunks, ring, warps, wb = cfg
    assert wb in (1, 2) and (wb == 2 or chunks == 1) and word_aligned(x, w)
    m, n = x.shape
    y = _out(x, poison)
    mean = _out(x, poison, m, dtype=torch.float32)
    rstd = _out(x, poison, m, dtype=torch.float32)

    def build(slots, parts, pp, groups):
        args = (x, w, w if b is None else b, y, mean, rstd, slots, m, n, parts, groups or 1, x.stride(0),
                y.stride(0), float(eps))  # fmt: skip
        meta = dict(CHUNK=chunk, CHUNKS=chunks, RING=ring, WARPS=warps, PP=pp, WB=wb, SPIN_LIMIT=_SPIN_LIMIT,
                    IS_RMS=is_rms, num_warps=warps)  # fmt: skip
        return args, meta

    assert _launch_split(_norm_fwd_small_kernel, x, 1, build, 2 * chunk * chunks, x.device) > 0, "not launched"
    return y, mean, rstd


# ---------------------------------------------------------------- backward


@flyc.gluon_kernel
def _issue_row(ring, w_ptr, stride_w, row, slot, col0, M, W, cols):
    """Queue the copy of ``row``'s slice (words from col0) of one tensor into ``slot``, as one commit group."""
    c = col0 + cols
    gx.async_copy.async_copy_global_to_shared(ring.index(slot), w_ptr + row.to(gx.int64) * stride_w + c,
                                              mask=(row < M) & (c < W))  # fmt: skip
    gx.async_copy.commit_group()


@flyc.gluon_kernel(do_not_specialize=["M", "groups"])
def _norm_bwd_small_kernel(
    x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dwp_ptr, dbp_ptr, slot_ptr,
    M, N, P, groups, stride_x, stride_dy, stride_dx,
    CHUNK: gx.constexpr, RING: gx.constexpr, WARPS: gx.constexpr, PP: gx.constexpr, SPIN_LIMIT: gx.constexpr,
    IS_RMS: gx.constexpr,
):  # fmt: skip
    THREADS: gx.constexpr = 32 * WARPS
    REPS: gx.constexpr = CHUNK // (4 * THREADS)
    ROWS: gx.constexpr = RING // 2  # rows in the ring: x and dy of each
    layout: gx.constexpr = gx.BlockedLayout([1, 1, 4], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
    ring = gx.allocate_shared_memory(gx.int32, [RING, REPS, THREADS, 4], gx.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    cols = chunk_words(REPS, THREADS, layout)
    xw_ptr = x_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    dyw_ptr = dy_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    dxw_ptr = dx_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    W = N // 2
    pid = gx.program_id(0)
    part = pid % P
    group = pid // P
    col0 = part * CHUNK
    ok = col0 + cols < W
    we, wo = bf16_pairs(gx.load(w_ptr.to(gx.pointer_type(gx.int32), bitcast=True) + col0 + cols, mask=ok, other=0))
    dwe = gx.zeros(cols.shape, gx.float32, layout)
    dwo = gx.zeros(cols.shape, gx.float32, layout)
    dbe = gx.zeros(cols.shape, gx.float32, layout)
    dbo = gx.zeros(cols.shape, gx.float32, layout)
    k = gx.arange(0, 2 * PP, layout=gx.BlockedLayout([1], [32], [WARPS], [0]))  # [part, (g * xhat, g)]
    kmask = (k // 2 < P) & (k % 2 < 2 - IS_RMS)
    for r in gx.static_range(ROWS):
        _issue_row(ring, xw_ptr, stride_x // 2, group + r * groups, 2 * r, col0, M, W, cols)
        _issue_row(ring, dyw_ptr, stride_dy // 2, group + r * groups, 2 * r + 1, col0, M, W, cols)
    for it in range(gx.cdiv(M - group, groups)):
        row = group + it * groups
        sx = (2 * it) % RING
        sdy = sx + 1
        rstd = gx.load(rstd_ptr + row, mask=row < M, other=0.0)
        mean = 0.0 if IS_RMS else gx.load(mean_ptr + row, mask=row < M, other=0.0)
        gx.async_copy.wait_group(RING - 2)  # issued so far: 2 * it + RING; this row's two are the oldest
        gx.thread_barrier()
        # pass 1: the slice's sums of g * (x - mean) and g (masked columns read 0: dy = 0 there, g too)
        xe, xo = bf16_pairs(ring.index(sx).load(layout))
        de, do = bf16_pairs(ring.index(sdy).load(layout))
        ge = de * we
        go = do * wo
        if IS_RMS:
            s_gh = gx.sum(gx.sum(gx.sum(ge * xe + go * xo, axis=2), axis=0), axis=0)
            s_g = s_gh * 0.0
        else:
            s_gh, s_g = _all_sum2(ge * (xe - mean) + go * (xo - mean), ge + go)
        c1 = s_gh * rstd
        c0 = s_g
        if PP > 1:
            mine = slot_ptr + row.to(gx.int64) * (2 * PP) + 2 * part
            publish(mine, c1, row < M)
            if not IS_RMS:
                publish(mine + 1, c0, row < M)
            sums = collect_from((k * 0).to(gx.int64), slot_ptr + row.to(gx.int64) * (2 * PP) + k, kmask,
                                SPIN_LIMIT)  # fmt: skip
            c1, c0 = sum2_f32(gx.where(k % 2 == 0, sums, 0.0), gx.where(k % 2 == 1, sums, 0.0), 0)
        c1 = c1 / N  # mean(g * xhat)
        c0 = c0 / N  # mean(g); 0 for RMSNorm
        # pass 2: dx, and the columns' weight-gradient sums; then the row's two slots refilled
        xe, xo = bf16_pairs(ring.index(sx).load(layout))
        de, do = bf16_pairs(ring.index(sdy).load(layout))
        he = (xe - mean) * rstd
        ho = (xo - mean) * rstd
        dxe = (de * we - c0 - he * c1) * rstd
        dxo = (do * wo - c0 - ho * c1) * rstd
        gx.store(dxw_ptr + row.to(gx.int64) * (stride_dx // 2) + col0 + cols, bf16_words(dxe, dxo),
                 mask=ok & (row < M))  # fmt: skip
        dwe += de * he
        dwo += do * ho
        dbe += de
        dbo += do
        gx.thread_barrier()
        _issue_row(ring, xw_ptr, stride_x // 2, row + ROWS * groups, sx, col0, M, W, cols)
        _issue_row(ring, dyw_ptr, stride_dy // 2, row + ROWS * groups, sdy, col0, M, W, cols)
    gx.async_copy.wait_group(0)
    out = group.to(gx.int64) * N + 2 * (col0 + cols)
    gx.store(dwp_ptr + out, dwe, mask=ok)
    gx.store(dwp_ptr + out + 1, dwo, mask=ok)
    if not IS_RMS:
        gx.store(dbp_ptr + out, dbe, mask=ok)
        gx.store(dbp_ptr + out + 1, dbo, mask=ok)


def launch_bwd(h, w, dy, mean, rstd, is_rms, cfg, poison=True):
    """(dx, dw, db or None) of bf16 rows [M, N] (word aligned): one wave of the small-program backward, then the
    [groups, N] partials summed by torch (the shipped backward sums its partials in a kernel of its own)."""
    chunk, ring, warps = cfg
    assert word_aligned(h, dy, w) and h.dtype == dy.dtype == w.dtype == torch.bfloat16
    m, n = h.shape
    dx = _out(h, poison)
    out = {}

    def build(slots, parts, pp, groups):
        if groups is not None:
            out["dwp"] = torch.empty(groups, n, dtype=torch.float32, device=h.device)
            out["dbp"] = None if is_rms else torch.empty_like(out["dwp"])
        dwp = out.get("dwp", rstd)
        dbp = out.get("dbp") if out.get("dbp") is not None else dwp
        args = (h, w, dy, rstd if mean is None else mean, rstd, dx, dwp, dbp, slots, m, n, parts, groups or 1,
                h.stride(0), dy.stride(0), dx.stride(0))  # fmt: skip
        meta = dict(CHUNK=chunk, RING=ring, WARPS=warps, PP=pp, SPIN_LIMIT=_SPIN_LIMIT, IS_RMS=is_rms,
                    num_warps=warps)  # fmt: skip
        return args, meta

    assert _launch_split(_norm_bwd_small_kernel, h, 2, build, 2 * chunk, h.device) > 0, "not launched"
    return dx, out["dwp"].sum(0), None if is_rms else out["dbp"].sum(0)


# ---------------------------------------------------------------- offline compile, references, probe


def _compile_offline(kind, n, is_rms, cfg):
    """'REG:n STACK:n SHARED:n' of the probe's kernel for sm_90 (tools/sm90_compile.py)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
    from sm90_compile import resources  # noqa: PLC0415

    if kind == "fwd":
        chunk, chunks, ring, warps, wb = cfg
        sig = {p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}
        sig.update({p: "*fp32" for p in ("mean_ptr", "rstd_ptr")}, slot_ptr="*i64", eps="fp32")
        sig.update({a: "i32" for a in ("M", "N", "P", "groups", "stride_x", "stride_y")})
        parts = flyc.cdiv(n // 2, chunk * chunks)
        consts = dict(CHUNK=chunk, CHUNKS=chunks, RING=ring, WARPS=warps, PP=flyc.next_power_of_2(parts), WB=wb,
                      SPIN_LIMIT=_SPIN_LIMIT, IS_RMS=is_rms)  # fmt: skip
        return resources(_norm_fwd_small_kernel, sig, consts, warps)
    chunk, ring, warps = cfg
    sig = {p: "*bf16" for p in ("x_ptr", "w_ptr", "dy_ptr", "dx_ptr")}
    sig.update({p: "*fp32" for p in ("mean_ptr", "rstd_ptr", "dwp_ptr", "dbp_ptr")}, slot_ptr="*i64")
    sig.update({a: "i32" for a in ("M", "N", "P", "groups", "stride_x", "stride_dy", "stride_dx")})
    parts = flyc.cdiv(n // 2, chunk)
    consts = dict(CHUNK=chunk, RING=ring, WARPS=warps, PP=flyc.next_power_of_2(parts), SPIN_LIMIT=_SPIN_LIMIT,
                  IS_RMS=is_rms)  # fmt: skip
    return resources(_norm_bwd_small_kernel, sig, consts, warps)


def _fwd_reference(x, w, b, is_rms, eps):
    xd = x.double()
    if is_rms:
        rstd = torch.rsqrt(xd.pow(2).mean(-1) + eps)
        return xd * rstd[:, None] * w.double(), None, rstd
    mean = xd.mean(-1)
    rstd = torch.rsqrt(xd.var(-1, unbiased=False) + eps)
    return (xd - mean[:, None]) * rstd[:, None] * w.double() + b.double(), mean, rstd


def _bwd_reference(h, w, dy, is_rms, eps):
    """(dx, dw, db) in fp64 through autograd, and the fp32 (mean, rstd) the kernel takes."""
    hd = h.double().requires_grad_()
    wd = w.double().requires_grad_()
    if is_rms:
        rstd = torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps)
        y, mean = hd * rstd * wd, None
    else:
        mean = hd.mean(-1, keepdim=True)
        rstd = torch.rsqrt(hd.var(-1, unbiased=False, keepdim=True) + eps)
        y = (hd - mean) * rstd * wd
    dx, dw = torch.autograd.grad(y, (hd, wd), dy.double())
    db = None if is_rms else dy.double().sum(0)
    stats = (None if mean is None else mean.squeeze(-1).float(), rstd.squeeze(-1).float())
    return dx, dw, db, stats


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _check_fwd(n, is_rms, cfg):
    for m in (3, 301):  # a row a program, and programs taking several rows
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
        x[1] += 100.0  # far from 0: the sums cancel (M2 about the slice mean taken again)
        w = (torch.rand(n, device="cuda") + 0.5).bfloat16()
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y, mean, rstd = launch_fwd(x, w, b, 1e-5, is_rms, cfg)
        ry, rmean, rrstd = _fwd_reference(x, w, b, is_rms, 1e-5)
        errs = [_rel(y, ry), _rel(rstd, rrstd)] + ([] if is_rms else [_rel(mean, rmean)])
        assert max(errs) < 1e-2, (n, is_rms, cfg, m, errs)
    return max(errs)


def _check_bwd(n, is_rms, cfg):
    for m in (3, 301):
        h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
        w = (torch.rand(n, device="cuda") + 0.5).bfloat16()
        dy = torch.randn_like(h)
        rdx, rdw, rdb, (mean, rstd) = _bwd_reference(h, w, dy, is_rms, 1e-5)
        dx, dw, db = launch_bwd(h, w, dy, mean, rstd, is_rms, cfg)
        errs = [_rel(dx, rdx), _rel(dw, rdw)] + ([] if is_rms else [_rel(db, rdb)])
        assert max(errs) < 1e-2, (n, is_rms, cfg, m, errs)
    return max(errs)


def _checked(check, n, is_rms, variants):
    """[(config, its largest relative error)] of the variants whose outputs pass the fp64 check."""
    good = []
    for cfg in variants:
        try:
            good.append((cfg, check(n, is_rms, cfg)))
        except AssertionError as e:
            print("check failed", n, is_rms, cfg, e, flush=True)
    return good


def _time_fwd(n, is_rms, variants, record, bench):
    import fly_norm

    good = _checked(_check_fwd, n, is_rms, variants)
    m = (1 << 27) // n
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
    w = (torch.rand(n, device="cuda") + 0.5).bfloat16()
    b = None if is_rms else torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ship = (lambda: fly_norm.rms_norm(x, w)) if is_rms else (lambda: fly_norm.layer_norm(x, w, b))
    for _rep in range(2):
        record(op="fwd", N=n, rms=is_rms, variant="shipped", us=bench(ship).median_us, moved=4 * m * n)
        for cfg, err in good:
            us = bench(lambda cfg=cfg: launch_fwd(x, w, b, 1e-5, is_rms, cfg, False)).median_us
            record(op="fwd", N=n, rms=is_rms, variant=":".join(map(str, cfg)), us=us, moved=4 * m * n, rel_err=err)


def _time_bwd(n, is_rms, variants, record, bench):
    import fly_norm

    good = _checked(_check_bwd, n, is_rms, variants)
    m = (1 << 27) // n
    h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
    w = (torch.rand(n, device="cuda") + 0.5).bfloat16()
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(h)
    params = tuple(t.detach().requires_grad_() for t in ((h, w) if is_rms else (h, w, b)))
    y = fly_norm.rms_norm(*params) if is_rms else fly_norm.layer_norm(*params)
    mean = None if is_rms else torch.zeros(m, device="cuda")
    rstd = torch.ones(m, device="cuda")
    for _rep in range(2):
        us = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True)).median_us
        record(op="bwd", N=n, rms=is_rms, variant="shipped", us=us, moved=6 * m * n)
        for cfg, err in good:
            us = bench(lambda cfg=cfg: launch_bwd(h, w, dy, mean, rstd, is_rms, cfg, False)).median_us
            record(op="bwd", N=n, rms=is_rms, variant=":".join(map(str, cfg)), us=us, moved=6 * m * n, rel_err=err)


FWD_VARIANTS = ["2048:1:4:4:1", "2048:1:6:4:1", "2048:1:4:4:2", "4096:1:4:8:1", "1024:4:6:4:2", "1024:8:10:4:2"]
BWD_VARIANTS = ["1024:8:4", "1024:12:4", "2048:8:8", "2048:8:4", "512:8:4"]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="offline sm_90 registers and shared memory")
    ap.add_argument("--fwd-widths", type=int, nargs="+", default=[65536, 131072, 262144])
    ap.add_argument("--bwd-widths", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--fwd", nargs="*", default=FWD_VARIANTS, help="CHUNK:CHUNKS:RING:WARPS:WB")
    ap.add_argument("--bwd", nargs="*", default=BWD_VARIANTS, help="CHUNK:RING:WARPS")
    ap.add_argument("--rms", action="store_true", help="rms_norm too")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    fwd = [tuple(map(int, v.split(":"))) for v in args.fwd]
    bwd = [tuple(map(int, v.split(":"))) for v in args.bwd]
    norms = (False, True) if args.rms else (False,)
    if args.compile:
        for cfg in fwd:
            for is_rms in norms:
                print("fwd", cfg, "rms" if is_rms else "layer", _compile_offline("fwd", 131072, is_rms, cfg))
        for cfg in bwd:
            for is_rms in norms:
                print("bwd", cfg, "rms" if is_rms else "layer", _compile_offline("bwd", 16384, is_rms, cfg))
        return
    from flydsl.autotune.timer import bench
    from flydsl_common.bench import copy_gbps

    copy = copy_gbps(1 << 29)
    rows = [dict(copy_GBps=copy)]

    def record(**r):
        r["frac"] = r["moved"] / (r["us"] * 1e-6) / 1e9 / copy
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
        rows.append(r)

    for n in args.fwd_widths:
        for is_rms in norms:
            _time_fwd(n, is_rms, fwd, record, bench)
    for n in args.bwd_widths:
        for is_rms in norms:
            _time_bwd(n, is_rms, bwd, record, bench)
    if args.out:
        with open(os.path.join(args.out, "probe-small-programs.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
