"""Probes of the norm backward at 8K-32K columns (PERF.md v14-v14b): python probe_bwd_wide.py [--part ...]

Design probes, not the benchmark; bf16, M * N = 2^27, each against the shipped backward (through autograd)
in the same process, % of the copy measured in the same run.

- ``pipe``: the single-pass backward (one program a row at a time, a persistent loop) with the row's h and
  dy loaded as int32 words (two columns each) through the software pipeliner (``fx.range(...,
  num_stages=STAGES)``: cp.async into shared memory, the next rows' bytes in flight without registers),
  widened once for the row sums and again for dx; W_IN_LOOP says how the weight is held. Its RMSNorm form
  with the weight held in fp32 is what ships (``norm._pipelined_bwd_rows``).
- ``pipe_split``: the split backward (a row over several programs of one wave, the slices' sums exchanged
  as tagged words) with the same staging, the wait inside one asm statement (``peek`` / ``collect_from``:
  the pipeliner refuses loops with nested loops), and LEAD 0 (pass 1, then the wait, each row), 1 (pass 1
  a row ahead, ``split._staged_pass1``) or 2 (also the wait's first read before pass 1: what ships as
  ``split._norm_bwd_staged_kernel``).
- ``staged_narrow``: the shipped staged kernel on rows of one or two slices (4K-16K); with ``--widths`` and
  ``--cfgs SLICE,WARPS,STAGES ...``, on other widths and configs.

Measured and left out, kept in git: the backward in row and column roles (PERF.md v14, 7-54%), part
``cols``, commits 4d8f4bf and e9aa133, results ``results/probe-bwd-cols-r*.json``; the staged kernel with
fewer instructions an element (PERF.md v15c, slower), part ``staged_fma``, commit c18b354, results
``results/probe-bwd-wide-r7-staged-fma.json``.
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
from fly_norm._kernels.norm import launch_sum_partials
from fly_norm._kernels.split import _my_words, _staged_pass1, staged_dx
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps
from flydsl_common.device import (
    as_words,
    bf16_pairs,
    bf16_pairs_third,
    bf16_words,
    collect_from,
    peek,
    row_offset,
    sum2_f32,
)

_DT = torch.bfloat16


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
        de, do, xe, xo, dxe, dxo = staged_dx(hw, dyw, mean, rstd, we, wo, c0, c1)  # the row widened anew
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


def _setups(widths, copy, out):
    """For each width and norm: fresh inputs, the shipped backward timed through autograd (a row appended to
    ``out``) and its gradients, the reference of every case. Yields (n, op, h, w, b, dy, mean, rstd, grads,
    nbytes) with ``mean`` None for RMSNorm (``b`` then unused)."""
    from fly_norm import layer_norm, rms_norm

    for n in widths:
        m = (1 << 27) // n
        for is_rms in (True, False):
            x = torch.randn(m, n, dtype=_DT, device="cuda").requires_grad_()
            w = (torch.rand(n, dtype=_DT, device="cuda") + 0.5).requires_grad_()
            b = torch.randn(n, dtype=_DT, device="cuda").requires_grad_()
            dy = torch.randn(m, n, dtype=_DT, device="cuda")
            params = (x, w) if is_rms else (x, w, b)
            eps = 1e-6 if is_rms else 1e-5
            y = rms_norm(x, w, eps) if is_rms else layer_norm(x, w, b, eps)
            grads = torch.autograd.grad(y, params, dy, retain_graph=True)
            # as the benchmark counts: x, dy, dx; w, dw (b, db); rstd (mean)
            nbytes = 2 * 3 * m * n + (2 if is_rms else 4) * 2 * n + (1 if is_rms else 2) * 4 * m
            op = "rms" if is_rms else "layer"
            us = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True)).median_us
            out.append(dict(N=n, op=op, kernel="shipped", us=us, frac_copy=nbytes / (us * 1e-6) / 1e9 / copy))
            print(out[-1], flush=True)
            h = x.detach()
            mean, rstd = _stats(h, is_rms, eps)
            yield n, op, h, w.detach(), b.detach(), dy, mean, rstd, grads, nbytes
            torch.cuda.empty_cache()


def _measure(out, launch, h, w, b, grads, nbytes, copy, **fields):
    """Run ``launch(dx, dw, db)`` on outputs poisoned with NaN, check them against ``grads``, time it, append
    a row to ``out`` (a failure is recorded, not raised)."""
    dx, dw, db = torch.full_like(h, float("nan")), torch.full_like(w, float("nan")), torch.full_like(b, float("nan"))
    try:
        launch(dx, dw, db)
        torch.cuda.synchronize()
        got = (dx, dw, db)[: len(grads)]
        err = max(_rel(g, e) for g, e in zip(got, grads, strict=True))
        us = bench(lambda: launch(dx, dw, db)).median_us
        row = dict(fields, us=us, frac_copy=nbytes / (us * 1e-6) / 1e9 / copy, rel_err=err)
    except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
        row = dict(fields, error=repr(e)[:300])
    print(row, flush=True)
    out.append(row)


def _pipe_part(copy: float) -> list[dict]:
    out = []
    for n, op, h, w, b, dy, mean, rstd, grads, nbytes in _setups(sorted({c[0] for c in PIPE_CASES}), copy, out):
        for cn, warps, stages, w_in_loop, per_sm in PIPE_CASES:
            if cn == n:
                _measure(out, lambda dx, dw, db: launch_pipe(h, w, dy, mean, rstd, dx, dw, db, warps, stages,
                                                             w_in_loop, per_sm),
                         h, w, b, grads, nbytes, copy, N=n, op=op, kernel="pipe",
                         case=(warps, stages, w_in_loop, per_sm))  # fmt: skip
    return out


# ------------------------------------------------------------------ part pipe_split


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _bwd_pipe_split_kernel(
    h_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dwp_ptr, dbp_ptr, slot_ptr, M, N, parts, stride_h, stride_dy,
    stride_dx, IS_RMS: fx.constexpr, SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, STAGES: fx.constexpr,
    LEAD: fx.constexpr,
):
    # fmt: on
    # A row over ``parts`` programs (SLICE columns each) of one resident wave; each program's slice of its rows
    # (row = group, group + groups, ...) loaded as packed words through the pipeliner (split._staged_pass1
    # publishes a slice's sums), the sums awaited in asm. LEAD: see the module doc.
    group, groups, part, c2, ok2, _, _ = _my_words(N, parts, SLICE, PARTS_POW2)
    we = load_weight(w_ptr, 2 * c2, ok2, 0.0, True, "")
    wo = load_weight(w_ptr, 2 * c2 + 1, ok2, 0.0, True, "")
    dwe = fx.zeros([SLICE // 2], dtype=fx.float32)
    dwo = fx.zeros([SLICE // 2], dtype=fx.float32)
    dbe = fx.zeros([SLICE // 2], dtype=fx.float32)
    dbo = fx.zeros([SLICE // 2], dtype=fx.float32)
    k = fx.arange(0, 2 * PARTS_POW2)  # a row's slots: [part, value] flattened
    kmask = (k // 2 < parts) & (k % 2 < 2 - IS_RMS)
    if LEAD:
        hw, dyw, rstd, mean = _staged_pass1(h_ptr, dy_ptr, mean_ptr, rstd_ptr, slot_ptr, group, M, c2, ok2, we, wo,
                                            part, stride_h, stride_dy, IS_RMS, PARTS_POW2)  # fmt: skip
    for row in fx.range(group, M, groups, num_stages=STAGES):
        slots = slot_ptr + row_offset(row, 2 * PARTS_POW2) + k
        if LEAD == 2:
            early = peek(slots)
        nxt = row + groups if LEAD else row  # the row pass 1 works on
        hw_n, dyw_n, rstd_n, mean_n = _staged_pass1(h_ptr, dy_ptr, mean_ptr, rstd_ptr, slot_ptr, nxt, M, c2, ok2, we,
                                                    wo, part, stride_h, stride_dy, IS_RMS, PARTS_POW2)  # fmt: skip
        if not LEAD:
            hw, dyw, rstd, mean = hw_n, dyw_n, rstd_n, mean_n
        if LEAD != 2:
            early = peek(slots)
        vals = collect_from(early, slots, kmask, 1 << 20)
        c1 = fx.sum(fx.where(k % 2 == 0, vals, 0.0), axis=0) / N
        c0 = fx.sum(fx.where(k % 2 == 1, vals, 0.0), axis=0) / N
        de, do, xe, xo, dxe, dxo = staged_dx(hw, dyw, mean, rstd, we, wo, c0, c1)
        fx.store(as_words(dx_ptr) + row_offset(row, stride_dx // 2) + c2, bf16_words(dxe, dxo), mask=ok2)
        dwe += de * xe
        dwo += do * xo
        if not IS_RMS:
            dbe += de
            dbo += do
        if LEAD:
            hw, dyw, rstd, mean = hw_n, dyw_n, rstd_n, mean_n
    pw = row_offset(group, N) + 2 * c2
    fx.store(dwp_ptr + pw, dwe, mask=ok2)
    fx.store(dwp_ptr + pw + 1, dwo, mask=ok2)
    if not IS_RMS:
        fx.store(dbp_ptr + pw, dbe, mask=ok2)
        fx.store(dbp_ptr + pw + 1, dbo, mask=ok2)


def launch_pipe_split(h, w, dy, mean, rstd, dx, dw, db, slice_cols=8192, warps=16, stages=3, lead=2):
    """The pipelined split backward and the partials' column sums (GPU only: its programs wait for each other)."""
    m, n = h.shape
    is_rms = mean is None
    parts = flyc.cdiv(n, slice_cols)
    pp = flyc.next_power_of_2(parts)
    meta = dict(IS_RMS=is_rms, SLICE=slice_cols, PARTS_POW2=pp, STAGES=stages, LEAD=lead, num_warps=warps)
    slots = torch.zeros(m, 2 * pp, dtype=torch.int64, device=h.device)
    probe = (h, w, dy, rstd if is_rms else mean, rstd, dx, rstd, rstd, slots, m, n, parts, h.stride(0), dy.stride(0),
             dx.stride(0))  # fmt: skip
    wave = flyc.programs_per_sm(_bwd_pipe_split_kernel, *probe, **meta) * flydsl.arch.current(h.device).sm_count
    groups = max(1, min(m, wave // parts))
    dwp = torch.empty(groups, n, dtype=torch.float32, device=h.device)
    dbp = dwp if is_rms else torch.empty(groups, n, dtype=torch.float32, device=h.device)
    args = (h, w, dy, rstd if is_rms else mean, rstd, dx, dwp, dbp, slots, m, n, parts, h.stride(0), dy.stride(0),
            dx.stride(0))  # fmt: skip
    flyc.launch(_bwd_pipe_split_kernel, (groups * parts,), *args, **meta)
    launch_sum_partials(dwp, dw)
    if not is_rms:
        launch_sum_partials(dbp, db)


# (slice, warps, stages, lead). r2-r4 ran an earlier form of this kernel, with pass 1 and the asm wait
# written out in this file; they are now split._staged_pass1 and collect_from.
PIPE_SPLIT_CASES = ((8192, 16, 3, 0), (8192, 16, 3, 1), (8192, 16, 3, 2), (4096, 8, 3, 2), (2048, 4, 4, 2))


def _pipe_split_part(copy: float) -> list[dict]:
    out = []
    for n, op, h, w, b, dy, mean, rstd, grads, nbytes in _setups((16384, 32768), copy, out):
        for case in PIPE_SPLIT_CASES:
            _measure(out, lambda dx, dw, db: launch_pipe_split(h, w, dy, mean, rstd, dx, dw, db, *case),
                     h, w, b, grads, nbytes, copy, N=n, op=op, kernel="pipe_split", case=case)  # fmt: skip
    return out


def _staged_narrow_part(copy: float, widths=(4096, 8192, 16384), cfgs=((8192, 16, 3), (4096, 8, 3), (4096, 16, 3))):
    """The shipped staged split kernel (split.launch_bwd_split) on rows of one or two slices (4K-16K), where
    the single pass or the pipelined single pass serve now: kernel + column sums against the whole backward."""
    from fly_norm._kernels import split

    out = []
    shipped_cfg = split.BWD_STAGED
    for n, op, h, w, b, dy, mean, rstd, grads, nbytes in _setups(widths, copy, out):
        is_rms = mean is None

        def launch(dx, dw, db):
            dwp, dbp = split.launch_bwd_split(h, w, dy, None, mean, rstd, dx, True, not is_rms, 0.0, is_rms)
            launch_sum_partials(dwp, dw)
            if not is_rms:
                launch_sum_partials(dbp, db)

        for cfg in cfgs:
            split.BWD_STAGED = cfg
            try:
                _measure(out, launch, h, w, b, grads, nbytes, copy, N=n, op=op, kernel="staged", case=cfg)
            finally:
                split.BWD_STAGED = shipped_cfg  # r5 lacked this: its later "shipped" rows ran the last cfg
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--part", nargs="*", default=["pipe"])
    ap.add_argument("--widths", nargs="*", type=int, default=[4096, 8192, 16384], help="staged_narrow's widths")
    ap.add_argument("--cfgs", nargs="*", default=["8192,16,3", "4096,8,3", "4096,16,3"],
                    help="staged_narrow's (slice, warps, stages)")
    args = ap.parse_args()
    copy = copy_gbps(1 << 29)
    rows = [dict(copy_GBps=copy)]
    if "pipe" in args.part:
        rows += _pipe_part(copy)
    if "staged_narrow" in args.part:
        cfgs = [tuple(int(v) for v in c.split(",")) for c in args.cfgs]
        rows += _staged_narrow_part(copy, tuple(args.widths), cfgs)
    if "pipe_split" in args.part:
        rows += _pipe_split_part(copy)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe-bwd-wide.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
