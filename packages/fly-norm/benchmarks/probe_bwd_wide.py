"""Probes of the norm backward at 8K-16K columns (PERF.md v14): python probe_bwd_wide.py [--part cols pipe]

Design probes, not the benchmark; bf16, M * N = 2^27, against the shipped backward in the same process.

Part ``pipe``: the single-pass backward (one program a row at a time, a persistent loop) with the row's h
and dy loaded as int32 words (two columns each) through the software pipeliner (``fx.range(...,
num_stages=STAGES)``: cp.async into shared memory, the next rows' bytes in flight without registers),
widened once for the row sums and again for dx. Registers then hold one packed row and the per-column
weight-gradient sums, which at 16K fit one 16-warp program (the shipped single pass holds the row in fp32
and the next one in registers: it spills past 8K, where the split kernels take over at 58-69%).

Part ``cols``: rows and columns in two roles. Every program of one resident wave does two jobs each
step of a persistent loop:

- role A (rows): the row sum c1 = mean(g * xhat) of one row chunk (the program's row of the current
  band; a band is one row per program), read from memory; at the row's last chunk it publishes c1 in
  the row's slot (a tagged word);
- role B (columns): for a column slice it owns for the whole launch, dx of the rows of a band that role
  A finished LAG steps earlier, re-read from L2, and the dweight sums of its slice: no per-program
  partial rows, no exchange of partial sums, no column sum kernel after.

Role A's loads for a step are issued before role B's work and consumed after it, so a row's bytes are
in flight while the program works from L2. Each element is read from memory once (role A) and from L2
once (role B); the bands role A has read and role B has not fit L2 (about 8 MB a step).

RMSNorm, bf16, even N, stride even. Compared with the shipped backward (the tiled split kernel) in one
process: the op's own launches (backward_into) and this kernel, % of the copy measured in the same run.
"""

# ruff: noqa: B023 - each closure runs within its own loop iteration

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import flydsl  # noqa: F401
import flydsl.arch
import flydsl.compiler as flyc
import flydsl.expr as fx
from fly_norm._kernels.affine import load_weight
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps
from flydsl_common.device import (
    as_words,
    bf16_pairs,
    bf16_pairs_again,
    bf16_pairs_third,
    bf16_words,
    collect,
    publish,
    row_offset,
    sum2_f32,
)

_DT = torch.bfloat16
# (programs, warps, columns a chunk, lag, ahead, spin limit: 0 reads the row sums once, unsynchronized)
CASES = (
    (128, 16, 8192, 3, 1, 1 << 20),
    (128, 16, 8192, 3, 1, 0),
    (256, 8, 4096, 3, 1, 1 << 20),
    (256, 8, 4096, 3, 1, 0),
    (256, 8, 2048, 3, 2, 0),
)


@flyc.func
def _a_loads(h_words, dy_words, t, R, pid, M, cw, amask, stride_h, stride_dy, Q: fx.constexpr):
    """Role A's loads for step ``t``: the int32 words of its chunk of h and dy (zeros past the last row)."""
    row = t * R + pid // Q
    ok = amask & (row < M)
    hw = fx.load(h_words + row_offset(row, stride_h // 2) + cw, mask=ok, other=0)
    dyw = fx.load(dy_words + row_offset(row, stride_dy // 2) + cw, mask=ok, other=0)
    return hw, dyw


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _bwd_cols_kernel(
    h_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_ptr, slot_ptr, M, N, stride_h, stride_dy, stride_dx,
    CH: fx.constexpr, Q: fx.constexpr, SLICE: fx.constexpr, RB: fx.constexpr, LAG: fx.constexpr,
    AHEAD: fx.constexpr, SPIN_LIMIT: fx.constexpr,
):
    # fmt: on
    # A step's rows: R = P / Q (Q chunks of CH columns a row, P a multiple of Q). Role A: program pid
    # reduces chunk pid % Q of the step's row pid // Q and publishes the chunk's sum of dy * w * h in
    # slot [row, chunk]; its loads are issued AHEAD (1 or 2) steps early. Role B: dx of the R rows of step
    # t - LAG over this program's SLICE columns; its tile loads are issued before it waits for the rows'
    # sums, and its dweight sums accumulate per element, reduced once after the loop.
    pid = fx.program_id(0)
    P = fx.num_programs(0)
    R = P // Q
    cw = (pid % Q) * (CH // 2) + fx.arange(0, CH // 2)  # role A: int32 words (column pairs) of its chunk
    amask = cw < N // 2
    c = pid * SLICE + fx.arange(0, SLICE)  # role B: this program's columns
    smask = c < N
    w_b = fx.load(w_ptr + c, mask=smask, other=0.0).to(fx.float32)
    dw = fx.zeros([RB, SLICE], dtype=fx.float32)
    rb = fx.arange(0, RB)
    qk = fx.arange(0, Q)
    h_words = as_words(h_ptr)
    dy_words = as_words(dy_ptr)
    w_words = as_words(w_ptr)
    hw0, dyw0 = _a_loads(h_words, dy_words, 0, R, pid, M, cw, amask, stride_h, stride_dy, Q)
    hw1, dyw1 = _a_loads(h_words, dy_words, AHEAD - 1, R, pid, M, cw, amask, stride_h, stride_dy, Q)
    for t in range(0, fx.cdiv(M, R) + LAG):
        hw2, dyw2 = _a_loads(h_words, dy_words, t + AHEAD, R, pid, M, cw, amask, stride_h, stride_dy, Q)
        # role B: the rows role A took LAG steps ago
        if t >= LAG:
            rows = (t - LAG) * R + rb
            rok = (rb < R) & (rows < M)
            m2 = rok[:, None] & smask[None, :]
            hb = fx.load(h_ptr + row_offset(rows, stride_h)[:, None] + c[None, :], mask=m2, other=0.0)
            dyb = fx.load(dy_ptr + row_offset(rows, stride_dy)[:, None] + c[None, :], mask=m2, other=0.0)
            rs = fx.load(rstd_ptr + rows, mask=rok, other=0.0)
            slots = slot_ptr + row_offset(rows, Q)[:, None] + qk[None, :]
            if SPIN_LIMIT:
                parts, ok = collect(slots, rok[:, None] & (qk[None, :] < Q), SPIN_LIMIT)
            else:  # diagnosis: the slots read once, with the tile, unpublished ones as 0 (dx then wrong)
                words = fx.load(slots, mask=rok[:, None] & (qk[None, :] < Q), other=0, volatile=True)
                parts = words.to(fx.int32).to(fx.float32, bitcast=True)
                ok = True
            c1 = fx.sum(parts, axis=1) * rs / N
            xhat = hb.to(fx.float32) * rs[:, None]
            dyf = dyb.to(fx.float32)
            dx = (dyf * w_b[None, :] - xhat * c1[:, None]) * rs[:, None]
            dx = fx.where(ok, dx, float("nan"))
            fx.store(dx_ptr + row_offset(rows, stride_dx)[:, None] + c[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=m2)  # fmt: skip
            dw += dyf * xhat
        # role A: reduce step t's chunk and publish its sum
        row = t * R + pid // Q
        ww = fx.load(w_words + cw, mask=amask, other=0)
        he, ho = bf16_pairs(hw0)
        de, do = bf16_pairs(dyw0)
        we, wo = bf16_pairs(ww)
        publish(slot_ptr + row_offset(row, Q) + pid % Q, fx.sum(de * we * he + do * wo * ho, axis=0), row < M)
        if AHEAD == 1:
            hw0, dyw0 = hw2, dyw2
        else:
            hw0, dyw0 = hw1, dyw1
            hw1, dyw1 = hw2, dyw2
    fx.store(dw_ptr + c, fx.sum(dw, axis=0), mask=smask)


def launch_cols(h, w, dy, rstd, dx, dw, programs, ch=16384, lag=1, warps=16, ahead=1, spin=1 << 20):
    m, n = h.shape
    ch = min(ch, flyc.next_power_of_2(n))
    q = flyc.cdiv(n, ch)
    programs = programs // q * q
    sl = flyc.cdiv(flyc.cdiv(n, programs), 64) * 64  # role B's columns a program
    assert flyc.cdiv(n, sl) <= programs
    rb = flyc.next_power_of_2(programs // q)
    slots = torch.zeros(m, q, dtype=torch.int64, device=h.device)
    args = (h, w, dy, rstd, dx, dw, slots, m, n, h.stride(0), dy.stride(0), dx.stride(0))
    meta = dict(CH=ch, Q=q, SLICE=sl, RB=rb, LAG=lag, AHEAD=ahead, SPIN_LIMIT=spin, num_warps=warps)
    if not flyc.interpreting():  # every program must be resident: they wait for each other
        wave = flyc.programs_per_sm(_bwd_cols_kernel, *args, **meta) * flydsl.arch.current(h.device).sm_count
        assert programs <= wave, f"{programs} programs, a wave holds {wave}"
    flyc.launch(_bwd_cols_kernel, (programs,), *args, **meta)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------ part pipe


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _bwd_pipe_kernel(
    h_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dwp_ptr, dbp_ptr, M, N, stride_h, stride_dy, stride_dx,
    IS_RMS: fx.constexpr, BLOCK_N: fx.constexpr, STAGES: fx.constexpr, W_IN_LOOP: fx.constexpr,
):
    # fmt: on
    pid = fx.program_id(0)
    programs = fx.num_programs(0)
    c2 = fx.arange(0, BLOCK_N // 2)
    ok2 = c2 < N // 2
    w_words = as_words(w_ptr) + c2
    dwe = fx.zeros([BLOCK_N // 2], dtype=fx.float32)
    dwo = fx.zeros([BLOCK_N // 2], dtype=fx.float32)
    dbe = fx.zeros([BLOCK_N // 2], dtype=fx.float32)
    dbo = fx.zeros([BLOCK_N // 2], dtype=fx.float32)
    # W_IN_LOOP: 0 the weight held in fp32, 1 loaded each row (pipelined with the row), 2 held packed and
    # widened each row through an operand the compiler cannot hoist (a zero from rstd's sign bit), 3 read
    # each row from L1 through an asm load the pipeliner does not see (neither held nor staged)
    if W_IN_LOOP == 0:
        we, wo = bf16_pairs(fx.load(w_words, mask=ok2, other=0))
    if W_IN_LOOP == 2:
        w_held = fx.load(w_words, mask=ok2, other=0)
    # the row statistics one row ahead by hand (scalars: cheap to hold, and not left to the pipeliner)
    rstd_nx = fx.load(rstd_ptr + pid, mask=pid < M, other=0.0)
    mean_nx = 0.0 if IS_RMS else fx.load(mean_ptr + pid, mask=pid < M, other=0.0)
    for row in fx.range(pid, M, programs, num_stages=STAGES):
        hw = fx.load(as_words(h_ptr) + row_offset(row, stride_h // 2) + c2, mask=ok2, other=0)
        dyw = fx.load(as_words(dy_ptr) + row_offset(row, stride_dy // 2) + c2, mask=ok2, other=0)
        rstd = rstd_nx
        mean = mean_nx
        nxt = row + programs
        rstd_nx = fx.load(rstd_ptr + nxt, mask=nxt < M, other=0.0)
        if not IS_RMS:
            mean_nx = fx.load(mean_ptr + nxt, mask=nxt < M, other=0.0)
        if W_IN_LOOP == 1:
            we, wo = bf16_pairs(fx.load(w_words, mask=ok2, other=0, eviction_policy="evict_last"))
        if W_IN_LOOP == 2:
            we, wo = bf16_pairs_third(w_held, rstd.to(fx.int32, bitcast=True) >> 31)
        if W_IN_LOOP == 3:
            w_now = fx.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [w_words], dtype=fx.int32,
                                              is_pure=False, pack=1)  # fmt: skip
            we, wo = bf16_pairs(fx.where(ok2, w_now, 0))
        he, ho = bf16_pairs(hw)
        de, do = bf16_pairs(dyw)
        xe = fx.where(ok2, (he - mean) * rstd, 0.0)
        xo = fx.where(ok2, (ho - mean) * rstd, 0.0)
        if IS_RMS:
            c1 = fx.sum(de * we * xe + do * wo * xo, axis=0) / N
            c0 = 0.0
        else:
            s1, s0 = sum2_f32(de * we * xe + do * wo * xo, de * we + do * wo, 0)
            c1 = s1 / N
            c0 = s0 / N
        # the row again, widened anew after the sums (no fp32 copy held through them)
        he, ho = bf16_pairs_again(hw)
        de, do = bf16_pairs_again(dyw)
        xe = fx.where(ok2, (he - mean) * rstd, 0.0)
        xo = fx.where(ok2, (ho - mean) * rstd, 0.0)
        dxe = (de * we - c0 - xe * c1) * rstd
        dxo = (do * wo - c0 - xo * c1) * rstd
        fx.store(as_words(dx_ptr) + row_offset(row, stride_dx // 2) + c2, bf16_words(dxe, dxo), mask=ok2)
        dwe += de * xe
        dwo += do * xo
        if not IS_RMS:
            dbe += de
            dbo += do
    part = row_offset(pid, N) + 2 * c2
    fx.store(dwp_ptr + part, dwe, mask=ok2)
    fx.store(dwp_ptr + part + 1, dwo, mask=ok2)
    if not IS_RMS:
        fx.store(dbp_ptr + part, dbe, mask=ok2)
        fx.store(dbp_ptr + part + 1, dbo, mask=ok2)


def launch_pipe(h, w, dy, mean, rstd, dx, dw, db, warps=16, stages=2, w_in_loop=False, per_sm=None):
    """The pipelined packed backward and the partials' column sums: dx, dw (and db for layer_norm)."""
    from fly_norm._kernels.norm import launch_sum_partials

    m, n = h.shape
    is_rms = mean is None
    meta = dict(IS_RMS=is_rms, BLOCK_N=flyc.next_power_of_2(n), STAGES=stages, W_IN_LOOP=w_in_loop, num_warps=warps)
    probe = (h, w, dy, rstd if is_rms else mean, rstd, dx, rstd, rstd, m, n, h.stride(0), dy.stride(0), dx.stride(0))
    fit = 1 if flyc.interpreting() else flyc.programs_per_sm(_bwd_pipe_kernel, *probe, **meta)
    sms = 1 if flyc.interpreting() else flydsl.arch.current(h.device).sm_count
    programs = min(m, min(per_sm or fit, fit) * sms)
    dwp = torch.empty(programs, n, dtype=torch.float32, device=h.device)
    dbp = dwp if is_rms else torch.empty(programs, n, dtype=torch.float32, device=h.device)
    args = (h, w, dy, rstd if is_rms else mean, rstd, dx, dwp, dbp, m, n, h.stride(0), dy.stride(0), dx.stride(0))
    flyc.launch(_bwd_pipe_kernel, (programs,), *args, **meta)
    launch_sum_partials(dwp, dw)
    if not is_rms:
        launch_sum_partials(dbp, db)


# (N, warps, stages, W_IN_LOOP, programs an SM at most)
PIPE_CASES = (
    (8192, 16, 2, 0, None),
    (8192, 16, 3, 0, None),
    (16384, 16, 3, 0, None),
    (16384, 16, 2, 1, None),
    (16384, 32, 2, 1, None),
    (16384, 32, 2, 0, None),
)


def _stats(x, is_rms, eps):
    xf = x.float()
    if is_rms:
        return None, torch.rsqrt(xf.square().mean(1) + eps)
    mean = xf.mean(1)
    return mean, torch.rsqrt((xf - mean[:, None]).square().mean(1) + eps)


def _pipe_part(copy: float) -> list[dict]:
    from fly_norm import layer_norm, rms_norm

    out = []
    for n in sorted({c[0] for c in PIPE_CASES}):
        m = (1 << 27) // n
        for is_rms in (True, False):
            x = torch.randn(m, n, dtype=_DT, device="cuda").requires_grad_()
            w = (torch.rand(n, dtype=_DT, device="cuda") + 0.5).requires_grad_()
            b = torch.randn(n, dtype=_DT, device="cuda").requires_grad_()
            dy = torch.randn(m, n, dtype=_DT, device="cuda")
            params = (x, w) if is_rms else (x, w, b)
            eps = 1e-6 if is_rms else 1e-5
            y = rms_norm(x, w, eps) if is_rms else layer_norm(x, w, b, eps)
            ref = torch.autograd.grad(y, params, dy, retain_graph=True)
            nbytes = 2 * 3 * m * n + (2 if is_rms else 4) * 2 * n + (1 if is_rms else 2) * 4 * m
            op = "rms" if is_rms else "layer"
            us = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True)).median_us
            r = dict(N=n, op=op, kernel="shipped", us=us, frac_copy=nbytes / (us * 1e-6) / 1e9 / copy)
            print(r, flush=True)
            out.append(r)
            h = x.detach()
            mean, rstd = _stats(h, is_rms, eps)
            for cn, warps, stages, w_in_loop, per_sm in PIPE_CASES:
                if cn != n:
                    continue
                dx = torch.full_like(h, float("nan"))
                dw = torch.full_like(w, float("nan"))
                db = torch.full_like(b, float("nan"))
                case = (warps, stages, w_in_loop, per_sm)
                try:

                    def run():
                        launch_pipe(h, w.detach(), dy, mean, rstd, dx, dw, db, warps, stages, w_in_loop, per_sm)

                    run()
                    torch.cuda.synchronize()
                    got = (dx, dw) if is_rms else (dx, dw, db)
                    err = max(_rel(g, e) for g, e in zip(got, ref, strict=True))
                    us = bench(run).median_us
                    r = dict(N=n, op=op, kernel="pipe", case=case, us=us, frac_copy=nbytes / (us * 1e-6) / 1e9 / copy,
                             rel_err=err)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                    r = dict(N=n, op=op, kernel="pipe", case=case, error=repr(e)[:300])
                print(r, flush=True)
                out.append(r)
            torch.cuda.empty_cache()
    return out



# ------------------------------------------------------------------ part pipe_split

# Wait for a published tagged word (flydsl_common.device.publish) inside one asm statement, so the row loop
# holds no scf.while and the software pipeliner still stages its loads: $0 <- the word's fp32 bits once its
# tag is set (0 where the mask $2 is 0; a quiet NaN after 2^20 polls).
_SPIN_WAIT = fx.constexpr("""{
.reg .pred %p;
.reg .b32 %lo, %hi, %n;
.reg .b64 %w;
mov.b32 $0, 0;
setp.eq.s32 %p, $2, 0;
@%p bra DONE${:uid};
mov.u32 %n, 0;
SPIN${:uid}:
ld.relaxed.gpu.global.b64 %w, [$1];
mov.b64 {%lo, %hi}, %w;
mov.b32 $0, %lo;
setp.ne.b32 %p, %hi, 0;
@%p bra DONE${:uid};
add.u32 %n, %n, 1;
setp.lt.u32 %p, %n, 1048576;
@%p bra SPIN${:uid};
mov.b32 $0, 0x7FC00000;
DONE${:uid}:
}""")


# The same wait from a word read earlier ($1: one poll's latency off the critical path when it is published).
_SPIN_FROM = fx.constexpr("""{
.reg .pred %p;
.reg .b32 %lo, %hi, %n;
.reg .b64 %w;
mov.b32 $0, 0;
setp.eq.s32 %p, $3, 0;
@%p bra DONE${:uid};
mov.b64 %w, $1;
mov.u32 %n, 0;
CHECK${:uid}:
mov.b64 {%lo, %hi}, %w;
mov.b32 $0, %lo;
setp.ne.b32 %p, %hi, 0;
@%p bra DONE${:uid};
add.u32 %n, %n, 1;
setp.ge.u32 %p, %n, 1048576;
@%p bra FAIL${:uid};
ld.relaxed.gpu.global.b64 %w, [$2];
bra CHECK${:uid};
FAIL${:uid}:
mov.b32 $0, 0x7FC00000;
DONE${:uid}:
}""")


@flyc.func
def _peek(slots):
    """One relaxed read of the int64 ``slots`` (issued where written: an asm with effects)."""
    return fx.inline_asm_elementwise("ld.relaxed.gpu.global.b64 $0, [$1];", "=l,l", [slots], dtype=fx.int64,
                                     is_pure=False, pack=1)  # fmt: skip


@flyc.func
def _spin_from(words, slots, mask):
    """:func:`_spin_collect` starting from ``words``, read earlier by :func:`_peek`."""
    bits = fx.inline_asm_elementwise(_SPIN_FROM, "=r,l,l,r", [words, slots, mask.to(fx.int32)], dtype=fx.int32,
                                     is_pure=False, pack=1)  # fmt: skip
    return bits.to(fx.float32, bitcast=True)


@flyc.func
def _spin_collect(slots, mask):
    """fp32 values of the int64 tagged ``slots`` (0 where ``mask`` is off), each polled until published."""
    bits = fx.inline_asm_elementwise(_SPIN_WAIT, "=r,l,r", [slots, mask.to(fx.int32)], dtype=fx.int32,
                                     is_pure=False, pack=1)  # fmt: skip
    return bits.to(fx.float32, bitcast=True)


@flyc.func
def _publish_slice(h_ptr, dy_ptr, mean_ptr, rstd_ptr, slot_ptr, row, M, c2, ok2, we, wo, part, stride_h, stride_dy,
                   IS_RMS: fx.constexpr, PARTS_POW2: fx.constexpr):  # fmt: skip
    """Pass 1 of ``row`` (nothing past M): load its slice as words, publish the slice's sums; the words, rstd, mean."""
    ok = row < M
    hw = fx.load(as_words(h_ptr) + row_offset(row, stride_h // 2) + c2, mask=ok2 & ok, other=0)
    dyw = fx.load(as_words(dy_ptr) + row_offset(row, stride_dy // 2) + c2, mask=ok2 & ok, other=0)
    rstd = fx.load(rstd_ptr + row, mask=ok, other=0.0)
    mean = 0.0 if IS_RMS else fx.load(mean_ptr + row, mask=ok, other=0.0)
    he, ho = bf16_pairs(hw)
    de, do = bf16_pairs(dyw)
    xe = fx.where(ok2, (he - mean) * rstd, 0.0)
    xo = fx.where(ok2, (ho - mean) * rstd, 0.0)
    base = slot_ptr + row_offset(row, 2 * PARTS_POW2) + 2 * part
    if IS_RMS:
        publish(base, fx.sum(de * we * xe + do * wo * xo, axis=0), ok)
    else:
        s1, s0 = sum2_f32(de * we * xe + do * wo * xo, de * we + do * wo, 0)
        publish(base, s1, ok)
        publish(base + 1, s0, ok)
    return hw, dyw, rstd, mean


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _bwd_pipe_split_kernel(
    h_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dwp_ptr, dbp_ptr, slot_ptr, M, N, parts, stride_h, stride_dy,
    stride_dx, IS_RMS: fx.constexpr, SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, STAGES: fx.constexpr,
    LEAD: fx.constexpr = 0,
):
    # fmt: on
    # A row over ``parts`` programs (SLICE columns each) of one resident wave; each program's slice of its rows
    # (row = group, group + groups, ...) loaded as packed words through the pipeliner, the slices' sums
    # exchanged as tagged words and awaited in asm (no loop the pipeliner would refuse).
    pid = fx.program_id(0)
    groups = fx.num_programs(0) // parts
    group = pid // parts
    part = pid - group * parts
    c2 = part * (SLICE // 2) + fx.arange(0, SLICE // 2)
    ok2 = c2 < N // 2
    we = load_weight(w_ptr, 2 * c2, ok2, 0.0, True, "")
    wo = load_weight(w_ptr, 2 * c2 + 1, ok2, 0.0, True, "")
    dwe = fx.zeros([SLICE // 2], dtype=fx.float32)
    dwo = fx.zeros([SLICE // 2], dtype=fx.float32)
    dbe = fx.zeros([SLICE // 2], dtype=fx.float32)
    dbo = fx.zeros([SLICE // 2], dtype=fx.float32)
    k = fx.arange(0, 2 * PARTS_POW2)  # a row's slots: [part, value] flattened
    kmask = (k // 2 < parts) & (k % 2 < 2 - IS_RMS)
    live = group < fx.minimum(M, groups)  # programs past the last full group take no rows
    if LEAD:
        # pass 1 a row ahead: publish the next row's sums, then wait for this row's, published an iteration ago
        hw_c, dyw_c, rstd_c, mean_c = _publish_slice(h_ptr, dy_ptr, mean_ptr, rstd_ptr, slot_ptr, group, M, c2, ok2, we,
                                                      wo, part, stride_h, stride_dy, IS_RMS, PARTS_POW2)  # fmt: skip
        for row in fx.range(group, M * live, groups, num_stages=STAGES):
            slots = slot_ptr + row_offset(row, 2 * PARTS_POW2) + k
            early = _peek(slots) if LEAD == 2 else 0
            hw_n, dyw_n, rstd_n, mean_n = _publish_slice(h_ptr, dy_ptr, mean_ptr, rstd_ptr, slot_ptr, row + groups, M,
                                                          c2, ok2, we, wo, part, stride_h, stride_dy, IS_RMS,
                                                          PARTS_POW2)  # fmt: skip
            if LEAD == 2:  # this row's slots read before pass 1 of the next
                vals = _spin_from(early, slots, kmask)
            else:
                vals = _spin_collect(slots, kmask)
            c1 = fx.sum(fx.where(k % 2 == 0, vals, 0.0), axis=0) / N
            c0 = fx.sum(fx.where(k % 2 == 1, vals, 0.0), axis=0) / N
            he, ho = bf16_pairs_again(hw_c)
            de, do = bf16_pairs_again(dyw_c)
            xe = fx.where(ok2, (he - mean_c) * rstd_c, 0.0)
            xo = fx.where(ok2, (ho - mean_c) * rstd_c, 0.0)
            dx = bf16_words((de * we - c0 - xe * c1) * rstd_c, (do * wo - c0 - xo * c1) * rstd_c)
            fx.store(as_words(dx_ptr) + row_offset(row, stride_dx // 2) + c2, dx, mask=ok2)
            dwe += de * xe
            dwo += do * xo
            if not IS_RMS:
                dbe += de
                dbo += do
            hw_c, dyw_c, rstd_c, mean_c = hw_n, dyw_n, rstd_n, mean_n
    else:
        rstd_nx = fx.load(rstd_ptr + group, mask=group < M, other=0.0)
        mean_nx = 0.0 if IS_RMS else fx.load(mean_ptr + group, mask=group < M, other=0.0)
        for row in fx.range(group, M * live, groups, num_stages=STAGES):
            hw = fx.load(as_words(h_ptr) + row_offset(row, stride_h // 2) + c2, mask=ok2, other=0)
            dyw = fx.load(as_words(dy_ptr) + row_offset(row, stride_dy // 2) + c2, mask=ok2, other=0)
            rstd = rstd_nx
            mean = mean_nx
            nxt = row + groups
            rstd_nx = fx.load(rstd_ptr + nxt, mask=nxt < M, other=0.0)
            if not IS_RMS:
                mean_nx = fx.load(mean_ptr + nxt, mask=nxt < M, other=0.0)
            he, ho = bf16_pairs(hw)
            de, do = bf16_pairs(dyw)
            xe = fx.where(ok2, (he - mean) * rstd, 0.0)
            xo = fx.where(ok2, (ho - mean) * rstd, 0.0)
            base = slot_ptr + row_offset(row, 2 * PARTS_POW2)
            if IS_RMS:
                publish(base + 2 * part, fx.sum(de * we * xe + do * wo * xo, axis=0), row < M)
            else:
                s1, s0 = sum2_f32(de * we * xe + do * wo * xo, de * we + do * wo, 0)
                publish(base + 2 * part, s1, row < M)
                publish(base + 2 * part + 1, s0, row < M)
            vals = _spin_collect(base + k, kmask)
            c1 = fx.sum(fx.where(k % 2 == 0, vals, 0.0), axis=0) / N
            c0 = fx.sum(fx.where(k % 2 == 1, vals, 0.0), axis=0) / N
            he, ho = bf16_pairs_again(hw)
            de, do = bf16_pairs_again(dyw)
            xe = fx.where(ok2, (he - mean) * rstd, 0.0)
            xo = fx.where(ok2, (ho - mean) * rstd, 0.0)
            dx = bf16_words((de * we - c0 - xe * c1) * rstd, (do * wo - c0 - xo * c1) * rstd)
            fx.store(as_words(dx_ptr) + row_offset(row, stride_dx // 2) + c2, dx, mask=ok2)
            dwe += de * xe
            dwo += do * xo
            if not IS_RMS:
                dbe += de
                dbo += do
    pw = row_offset(group, N) + 2 * c2
    fx.store(dwp_ptr + pw, dwe, mask=ok2 & live)
    fx.store(dwp_ptr + pw + 1, dwo, mask=ok2 & live)
    if not IS_RMS:
        fx.store(dbp_ptr + pw, dbe, mask=ok2 & live)
        fx.store(dbp_ptr + pw + 1, dbo, mask=ok2 & live)


def launch_pipe_split(h, w, dy, mean, rstd, dx, dw, db, slice_cols=8192, warps=16, stages=3, per_sm=None,
                      lead=False):
    """The pipelined split backward and the partials' column sums (GPU only: its programs wait for each other)."""
    from fly_norm._kernels.norm import launch_sum_partials

    m, n = h.shape
    is_rms = mean is None
    parts = flyc.cdiv(n, slice_cols)
    pp = flyc.next_power_of_2(parts)
    meta = dict(IS_RMS=is_rms, SLICE=slice_cols, PARTS_POW2=pp, STAGES=stages, LEAD=lead, num_warps=warps)
    slots = torch.zeros(m, 2 * pp, dtype=torch.int64, device=h.device)
    probe = (h, w, dy, rstd if is_rms else mean, rstd, dx, rstd, rstd, slots, m, n, parts, h.stride(0), dy.stride(0),
             dx.stride(0))  # fmt: skip
    fit = flyc.programs_per_sm(_bwd_pipe_split_kernel, *probe, **meta)
    wave = min(per_sm or fit, fit) * flydsl.arch.current(h.device).sm_count
    groups = max(1, min(m, wave // parts))
    dwp = torch.empty(groups, n, dtype=torch.float32, device=h.device)
    dbp = dwp if is_rms else torch.empty(groups, n, dtype=torch.float32, device=h.device)
    args = (h, w, dy, rstd if is_rms else mean, rstd, dx, dwp, dbp, slots, m, n, parts, h.stride(0), dy.stride(0),
            dx.stride(0))  # fmt: skip
    flyc.launch(_bwd_pipe_split_kernel, (groups * parts,), *args, **meta)
    launch_sum_partials(dwp, dw)
    if not is_rms:
        launch_sum_partials(dbp, db)


# (slice, warps, stages, programs an SM at most, lead: 0 none, 1 pass 1 a row ahead, 2 also the wait's first read early)
PIPE_SPLIT_CASES = (
    (8192, 16, 3, None, 1),
    (8192, 16, 3, None, 2),
    (8192, 16, 4, None, 2),
    (2048, 4, 4, None, 2),
    (4096, 8, 3, None, 2),
)


def _pipe_split_part(copy: float) -> list[dict]:
    from fly_norm import layer_norm, rms_norm

    out = []
    for n in (16384, 32768):
        m = (1 << 27) // n
        for is_rms in (True, False):
            x = torch.randn(m, n, dtype=_DT, device="cuda").requires_grad_()
            w = (torch.rand(n, dtype=_DT, device="cuda") + 0.5).requires_grad_()
            b = torch.randn(n, dtype=_DT, device="cuda").requires_grad_()
            dy = torch.randn(m, n, dtype=_DT, device="cuda")
            params = (x, w) if is_rms else (x, w, b)
            eps = 1e-6 if is_rms else 1e-5
            y = rms_norm(x, w, eps) if is_rms else layer_norm(x, w, b, eps)
            ref = torch.autograd.grad(y, params, dy, retain_graph=True)
            nbytes = 2 * 3 * m * n + (2 if is_rms else 4) * 2 * n + (1 if is_rms else 2) * 4 * m
            op = "rms" if is_rms else "layer"
            us = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True)).median_us
            r = dict(N=n, op=op, kernel="shipped", us=us, frac_copy=nbytes / (us * 1e-6) / 1e9 / copy)
            print(r, flush=True)
            out.append(r)
            h = x.detach()
            mean, rstd = _stats(h, is_rms, eps)
            for case in PIPE_SPLIT_CASES:
                dx = torch.full_like(h, float("nan"))
                dw = torch.full_like(w, float("nan"))
                db = torch.full_like(b, float("nan"))
                try:

                    def run():
                        launch_pipe_split(h, w.detach(), dy, mean, rstd, dx, dw, db, *case)

                    run()
                    torch.cuda.synchronize()
                    got = (dx, dw) if is_rms else (dx, dw, db)
                    err = max(_rel(g, e) for g, e in zip(got, ref, strict=True))
                    us = bench(run).median_us
                    r = dict(N=n, op=op, kernel="pipe_split", case=case, us=us,
                             frac_copy=nbytes / (us * 1e-6) / 1e9 / copy, rel_err=err)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                    r = dict(N=n, op=op, kernel="pipe_split", case=case, error=repr(e)[:300])
                print(r, flush=True)
                out.append(r)
            torch.cuda.empty_cache()
    return out



def _staged_narrow_part(copy: float) -> list[dict]:
    """The shipped staged split kernel (split.launch_bwd_split) on rows of one or two slices (4K-16K), where
    the single pass or the pipelined single pass serve now: kernel + column sums against the whole backward."""
    from fly_norm import layer_norm, rms_norm
    from fly_norm._kernels import split
    from fly_norm._kernels.norm import launch_sum_partials

    out = []
    shipped_cfg = split.BWD_STAGED
    for n in (4096, 8192, 16384):
        m = (1 << 27) // n
        for is_rms in (True, False):
            x = torch.randn(m, n, dtype=_DT, device="cuda").requires_grad_()
            w = (torch.rand(n, dtype=_DT, device="cuda") + 0.5).requires_grad_()
            b = torch.randn(n, dtype=_DT, device="cuda").requires_grad_()
            dy = torch.randn(m, n, dtype=_DT, device="cuda")
            params = (x, w) if is_rms else (x, w, b)
            eps = 1e-6 if is_rms else 1e-5
            y = rms_norm(x, w, eps) if is_rms else layer_norm(x, w, b, eps)
            ref = torch.autograd.grad(y, params, dy, retain_graph=True)
            nbytes = 2 * 3 * m * n + (2 if is_rms else 4) * 2 * n + (1 if is_rms else 2) * 4 * m
            op = "rms" if is_rms else "layer"
            us = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True)).median_us
            r = dict(N=n, op=op, kernel="shipped", us=us, frac_copy=nbytes / (us * 1e-6) / 1e9 / copy)
            print(r, flush=True)
            out.append(r)
            h = x.detach()
            mean, rstd = _stats(h, is_rms, eps)
            for cfg in ((8192, 16, 3), (4096, 8, 3), (4096, 16, 3)):
                dx = torch.full_like(h, float("nan"))
                dw = torch.full_like(w, float("nan"))
                db = torch.full_like(b, float("nan"))
                split.BWD_STAGED = cfg
                try:

                    def run():
                        dwp, dbp = split.launch_bwd_split(h, w.detach(), dy, None, mean, rstd, dx, True, not is_rms,
                                                          0.0, is_rms)  # fmt: skip
                        launch_sum_partials(dwp, dw)
                        if not is_rms:
                            launch_sum_partials(dbp, db)

                    run()
                    torch.cuda.synchronize()
                    got = (dx, dw) if is_rms else (dx, dw, db)
                    err = max(_rel(g, e) for g, e in zip(got, ref, strict=True))
                    us = bench(run).median_us
                    r = dict(N=n, op=op, kernel="staged", case=cfg, us=us, frac_copy=nbytes / (us * 1e-6) / 1e9 / copy,
                             rel_err=err)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                    r = dict(N=n, op=op, kernel="staged", case=cfg, error=repr(e)[:300])
                finally:
                    split.BWD_STAGED = shipped_cfg  # r5 lacked this: its later "shipped" rows ran the last cfg
                print(r, flush=True)
                out.append(r)
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--part", nargs="*", default=["pipe"])
    args = ap.parse_args()
    copy = copy_gbps(1 << 29)
    rows = [dict(copy_GBps=copy)]
    if "pipe" in args.part:
        rows += _pipe_part(copy)
    if "staged_narrow" in args.part:
        rows += _staged_narrow_part(copy)
    if "pipe_split" in args.part:
        rows += _pipe_split_part(copy)
    if "cols" in args.part:
        rows += _cols_part(copy)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe-bwd-wide.json").write_text(json.dumps(rows, indent=1))


def _cols_part(copy: float) -> list[dict]:
    from fly_norm._kernels.norm import backward_into

    rows = []
    for n in (16384,):
        m = (1 << 27) // n
        h = torch.randn(m, n, dtype=_DT, device="cuda")
        dy = torch.randn(m, n, dtype=_DT, device="cuda")
        w = torch.rand(n, dtype=_DT, device="cuda") + 0.5
        rstd = torch.rand(m, dtype=torch.float32, device="cuda") + 0.5
        dx_ref, dw_ref = torch.empty_like(h), torch.empty_like(w)

        def shipped():
            backward_into(h, w, dy, None, None, rstd, dx_ref, dw_ref, None, 0.0, True, None)

        shipped()
        nbytes = 2 * 3 * m * n + 2 * 2 * n + 4 * m
        us = bench(shipped).median_us
        r = dict(N=n, kernel="shipped", us=us, frac_copy=nbytes / (us * 1e-6) / 1e9 / copy)
        print(r, flush=True)
        rows.append(r)
        for programs, warps, ch, lag, ahead, spin in CASES:
            dx = torch.full_like(h, float("nan"))
            dw32 = torch.full((n,), float("nan"), dtype=torch.float32, device="cuda")
            try:

                def run():
                    launch_cols(h, w, dy, rstd, dx, dw32, programs, ch=ch, lag=lag, warps=warps, ahead=ahead, spin=spin)
                    return dw32.to(_DT)

                dwc = run()
                torch.cuda.synchronize()
                err = max(_rel(dx, dx_ref), _rel(dwc, dw_ref))
                us = bench(run).median_us
                r = dict(N=n, kernel="cols", case=(programs, warps, ch, lag, ahead, spin), us=us,
                         frac_copy=nbytes / (us * 1e-6) / 1e9 / copy, rel_err=err,
                         nan_dx=bool(torch.isnan(dx).any()))  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                r = dict(N=n, kernel="cols", case=(programs, warps, ch, lag, ahead, spin), error=repr(e)[:300])
            print(r, flush=True)
            rows.append(r)
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
