"""Probe: the norm backward at 16K-32K columns with rows and columns in two roles: python probe_bwd_cols.py

Design probe for PERF.md v14, not the benchmark. Every program of one resident wave does two jobs each
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
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps
from flydsl_common.device import as_words, bf16_pairs, collect, publish, row_offset

_DT = torch.bfloat16
# (programs, warps, columns a chunk, lag, ahead)
CASES = (
    (128, 16, 8192, 2, 1),
    (128, 16, 8192, 3, 1),
    (128, 16, 4096, 3, 2),
    (128, 16, 4096, 4, 2),
    (256, 8, 2048, 3, 2),
    (256, 8, 2048, 4, 2),
    (256, 8, 4096, 3, 1),
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
            parts, ok = collect(slot_ptr + row_offset(rows, Q)[:, None] + qk[None, :], rok[:, None] & (qk[None, :] < Q),
                                SPIN_LIMIT)  # fmt: skip
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from fly_norm._kernels.norm import backward_into

    copy = copy_gbps(1 << 29)
    rows = [dict(copy_GBps=copy)]
    for n in (16384, 32768):
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
        for programs, warps, ch, lag, ahead in CASES:
            dx = torch.full_like(h, float("nan"))
            dw32 = torch.full((n,), float("nan"), dtype=torch.float32, device="cuda")
            try:

                def run():
                    launch_cols(h, w, dy, rstd, dx, dw32, programs, ch=ch, lag=lag, warps=warps, ahead=ahead)
                    return dw32.to(_DT)

                dwc = run()
                torch.cuda.synchronize()
                err = max(_rel(dx, dx_ref), _rel(dwc, dw_ref))
                us = bench(run).median_us
                r = dict(N=n, kernel="cols", programs=programs, warps=warps, ch=ch, lag=lag, ahead=ahead, us=us,
                         frac_copy=nbytes / (us * 1e-6) / 1e9 / copy, rel_err=err,
                         nan_dx=bool(torch.isnan(dx).any()))  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                r = dict(N=n, kernel="cols", case=(programs, warps, ch, lag, ahead), error=repr(e)[:300])
            print(r, flush=True)
            rows.append(r)
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe-bwd-cols.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
